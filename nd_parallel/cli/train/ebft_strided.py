"""`rl: ebft` with ``ebft.mode: strided`` in `nd-parallel train`: Axolotl 0.19's strided block-parallel energy-based
fine-tuning of raw documents (``ebft_pretrain.transform``) or prompt / completion records
(``ebft_strided_structured.transform``), with the meaning of its ``ebft:`` keys:

- anchors every ``stride`` tokens from ``context_length`` (structured rows: from the micro-batch's longest prompt +
  ``min_completion_prefix``, at least ``context_length``) up to ``sequence_len - generate_max_len``; from each anchor
  ``n_samples_per_prompt`` rollouts of ``generate_max_len`` tokens are sampled (``temperature``, ``top_p``), all
  blocks of a row at once: the blocks are appended step by step after the document, and a strided attention mask
  lets each generated token see the document up to its anchor, itself and its block's earlier tokens;
- a frozen feature network (the base with the adapter disabled under LoRA, else a frozen copy) reads the document
  with its rollouts under the same mask; the hidden states after ``feature_layers`` are L2-normalized per layer and
  concatenated; each block is pooled (``last_token`` or ``mean_pooling``) and compared with the document's own tokens
  at the same place (the ground truth): reward = ``alignment_coef`` x 2 cos - ``diversity_coef`` x 2 mean dot product
  with the other rollouts of the block (with ``use_whitening`` both whitened per block first);
- advantages per block: ``rloo`` (leave-one-out baseline), ``group_norm`` or ``reinforce`` (the reward); the loss is
  ``rl_coef`` x REINFORCE (-log-prob x advantage, averaged over the generated tokens) + ``ce_coef`` x the
  cross-entropy of the document (structured: of its completion's tokens), per micro-batch as in Axolotl; the
  ``ebft/*`` metrics are logged.

Written by hand: Axolotl's strided trainer is its own Trainer subclass. Differences, each so that it trains what it
means or so that the layouts train as one process does:

- **Found:** Axolotl reads each generated token's log-probability from the position before it in the appended
  layout and spreads each block's advantage over ``generate_max_len`` consecutive positions; the layout is step-major
  (step 0 of every block, then step 1, ...), so with more than one block a token's log-prob was predicted for another
  block and weighted by another block's advantage. Here each token's log-prob is read where it was sampled (the
  anchor's last context token for the first, the block's previous token after) with its own block's advantage:
  ``test_ebft_strided.py`` checks that these are the log-probs of the distribution the tokens were drawn from.
- rollouts are sampled with uniforms keyed by (seed, step, the document's tokens, the rollout, the generation step),
  not torch's global generator, so one process and every data-parallel layout draw the same tokens;
- the micro-batches' losses are averaged (the Trainer's gradient accumulation) and each rank's enters as 1/dp of the
  global mean (nd_parallel sums the dp gradients);
- attention runs as the model's ``attn_implementation`` with a dense additive mask (Axolotl: eager, or
  flex_attention's block mask on CUDA); flash attention cannot take the mask, so those models run SDPA here.

FSDP2 / HSDP / DDP only (generation runs the whole model on each rank): tensor, pipeline and context parallelism
split what the strided mask reads whole, and are refused (ebft.py).
"""

from __future__ import annotations

import contextlib
import zlib

import torch
import torch.nn.functional as F

from .ebft import STRIDED, frozen_copy, settings, whiten

ESTIMATORS = ("rloo", "group_norm", "reinforce")
METRICS = ("rl_loss", "ce_loss", "cfm_loss", "mean_reward", "alignment", "diversity", "num_blocks", "advantages_std")


def strided_settings(block: dict | None) -> dict:
    """The block's settings with Axolotl's defaults and its two adjustments for a single rollout per anchor."""
    s = {**STRIDED, **settings(block)}
    if s["n_samples_per_prompt"] == 1:  # Axolotl: no diversity and no leave-one-out baseline with one rollout
        s["diversity_coef"] = 0.0
        s["advantage_estimator"] = "reinforce" if s["advantage_estimator"] == "rloo" else s["advantage_estimator"]
    return s


def allowed(length: int, anchor: int, steps: int, max_gen: int, stride: int, blocks: int):
    """([total, total] bool: query may attend key, [total] positions) of a document of ``length`` tokens followed by
    ``steps`` generation steps of ``blocks`` tokens each, total = length + steps x blocks (Axolotl's strided mask
    and position ids)."""
    total = length + steps * blocks
    q, kv = torch.arange(total)[:, None], torch.arange(total)[None]
    prompt_q, prompt_kv = q < length, kv < length
    step, block = (q - length).div(blocks, rounding_mode="floor"), (q - length) % blocks
    kv_step, kv_block = (kv - length).div(blocks, rounding_mode="floor"), (kv - length) % blocks
    context_end = (block * stride + anchor).clamp(max=length - max_gen)
    mask = (prompt_q & prompt_kv & (q >= kv)) | (~prompt_q & prompt_kv & (kv < context_end)) | (q == kv)
    mask |= ~prompt_q & ~prompt_kv & (kv_block == block) & (kv_step < step)
    positions = torch.arange(total)
    gen = positions[length:] - length
    positions[length:] = anchor + (gen % blocks) * stride + gen.div(blocks, rounding_mode="floor")
    return mask, positions


def model_inputs(length, anchor, steps, s, blocks, rows: int, dtype, device):
    """(additive 4-D mask, position ids) for ``rows`` rows: what the model is called with."""
    mask, positions = allowed(length, anchor, steps, s["generate_max_len"], s["stride"], blocks)
    total = mask.shape[0]
    additive = torch.zeros(total, total, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    return (additive.to(device)[None, None].expand(rows, 1, total, total),
            positions.to(device)[None].expand(rows, total))


def sampled_from(length: int, anchor: int, stride: int, blocks: int, steps: int) -> torch.Tensor:
    """[steps, blocks] the position whose logits each generated token was sampled from."""
    step, block = torch.arange(steps)[:, None], torch.arange(blocks)[None]
    return torch.where(step == 0, anchor + block * stride - 1, length + (step - 1) * blocks + block)


def sample(logits: torch.Tensor, s: dict, keys: list[int], seed: int, step: int) -> torch.Tensor:
    """[rows, blocks] tokens from [rows, blocks, V] logits: Axolotl's temperature and top-p distribution (argmax at
    temperature 0), sampled by inverting its CDF at one uniform per token from a generator keyed per row (``keys``):
    one draw per token, whatever the vocabulary (Axolotl: torch.multinomial on torch's global generator)."""
    from nd_parallel.plugins.trainer.relora import keyed_generator

    if not s["temperature"]:
        return logits.argmax(-1)
    probs = torch.softmax(logits.double() / s["temperature"], dim=-1)
    if s["top_p"] < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        drop = ordered.cumsum(-1) > s["top_p"]
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        probs = probs.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)
    uniform = torch.stack([torch.rand(logits.shape[1], generator=keyed_generator(seed, step, key),
                                      dtype=torch.float64) for key in keys]).to(probs.device)
    cdf = probs.cumsum(-1)  # the first token whose CDF reaches u x total has a nonzero probability
    return torch.searchsorted(cdf, (uniform.clamp(min=1e-12) * cdf[..., -1])[..., None]).squeeze(-1).clamp(
        max=probs.shape[-1] - 1)


@torch.no_grad()
def generate(model, rows: torch.Tensor, blocks: int, anchor: int, s: dict, keys, seed: int, step: int):
    """The rows followed by their strided rollouts: [rows, length + generate_max_len x blocks]."""
    length, out = rows.shape[1], rows
    dtype = next(model.parameters()).dtype
    source = sampled_from(length, anchor, s["stride"], blocks, s["generate_max_len"]).to(rows.device)
    for k in range(s["generate_max_len"]):
        mask, positions = model_inputs(length, anchor, k, s, blocks, rows.shape[0], dtype, rows.device)
        logits = model(input_ids=out, attention_mask=mask, position_ids=positions).logits
        picked = sample(logits[:, source[k]].float(), s, [zlib.crc32(f"{key}:{k}".encode()) for key in keys],
                        seed, step)
        out = torch.cat([out, picked.to(out.dtype)], dim=1)
    return out


def block_embeddings(features: torch.Tensor, length: int, anchor: int, blocks: int, s: dict):
    """(rollouts, ground truth) [rows, blocks, D] pooled block embeddings of [rows, total, D] features."""
    gen = s["generate_max_len"]
    truth = features[:, anchor:length].unfold(1, gen, s["stride"]).permute(0, 1, 3, 2)[:, :blocks]
    rolled = features[:, length:length + blocks * gen].reshape(features.shape[0], gen, blocks, -1).transpose(1, 2)
    if s["embed_method"] == "mean_pooling":
        return rolled.mean(2), truth.mean(2)
    return rolled[:, :, -1], truth[:, :, -1]  # Axolotl: anything else is last_token


def block_rewards(rolled: torch.Tensor, truth: torch.Tensor, docs: int, s: dict):
    """(rewards [docs, n, blocks], alignment, diversity, CFM loss) of [docs x n, blocks, D] embeddings."""
    n = s["n_samples_per_prompt"]
    gen, gt = rolled.view(docs, n, rolled.shape[1], -1), truth.view(docs, n, truth.shape[1], -1)
    if s["use_whitening"]:
        pairs = [[whiten(gen[b, :, k], gt[b, :, k]) for k in range(gen.shape[2])] for b in range(docs)]
        gen = torch.stack([torch.stack([g for g, _ in row], 1) for row in pairs])
        gt = torch.stack([torch.stack([t for _, t in row], 1) for row in pairs])
    alignment = 2 * F.cosine_similarity(gen, gt, dim=-1)
    diversity = torch.zeros_like(alignment)
    if n > 1:
        per_block = gen.permute(0, 2, 1, 3)  # [docs, blocks, n, D]
        sims = (per_block @ per_block.transpose(-1, -2)).masked_fill(torch.eye(n, dtype=torch.bool), 0.0)
        diversity = 2 * (sims.sum(-1) / (n - 1)).permute(0, 2, 1)
    cfm = ((gen.mean(1, keepdim=True) - gt[:, :1]) ** 2).sum(-1).mean()
    rewards = s["alignment_coef"] * alignment - s["diversity_coef"] * diversity
    return rewards, alignment.mean(), diversity.mean(), cfm


def advantages(rewards: torch.Tensor, estimator: str) -> torch.Tensor:
    """[docs x n, blocks] advantages of [docs, n, blocks] rewards (Axolotl's three estimators)."""
    n = rewards.shape[1]
    if estimator == "rloo" and n > 1:
        out = rewards - (rewards.sum(1, keepdim=True) - rewards) / (n - 1)
    elif estimator == "group_norm" and n > 1:
        out = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-8)
    else:
        out = rewards
    return out.reshape(-1, rewards.shape[2])


def anchor_of(inputs: dict, s: dict) -> tuple[int, bool]:
    """(where anchors start, whether rows are structured): after the micro-batch's longest prompt (its prompt_length
    column, else the first labelled token) + min_completion_prefix, at least context_length (Axolotl's rule)."""
    ids = inputs["input_ids"]
    if "prompt_length" in inputs:
        prompts = inputs["prompt_length"]
    elif "labels" in inputs:
        labelled = inputs["labels"] != -100
        prompts = torch.where(labelled.any(1), labelled.float().argmax(1), float(ids.shape[1])).long()
        if prompts.min().item() == 0:
            return s["context_length"], False
    else:
        return s["context_length"], False
    return max(int(prompts.max().item()) + s["min_completion_prefix"], s["context_length"]), True


def features(net, off, full, mask, positions, layers: list[float], depth: int) -> torch.Tensor:
    """[rows, total, D x layers]: the frozen feature network's (``net`` inside ``off``, the adapter-disabling context
    under LoRA) hidden states after ``layers`` (fractions of ``depth``), each L2-normalized."""
    with off, torch.no_grad():
        training = net.training
        net.eval()
        hidden = net(input_ids=full, attention_mask=mask, position_ids=positions, output_hidden_states=True)
        net.train(training)
    return torch.cat([F.normalize(hidden.hidden_states[int(f * depth)].float(), dim=-1) for f in layers], dim=-1)


def _log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def strided_loss(trainer, model, inputs: dict, s: dict, frozen) -> tuple[torch.Tensor, dict]:
    """(Axolotl's strided EBFT loss of one micro-batch, its metrics); see the module docstring."""
    ids = inputs["input_ids"]
    docs, length = ids.shape
    n, gen = s["n_samples_per_prompt"], s["generate_max_len"]
    unwrapped = trainer.accelerator.unwrap_model(model)
    adapter = frozen is None
    anchor, structured = anchor_of(inputs, s)
    blocks = (length - gen - anchor) // s["stride"] + 1
    if blocks <= 0:  # too short for one block: zero loss, after the forwards the other ranks make (FSDP gathers)
        with torch.no_grad():
            for _ in range(gen + adapter):
                model(input_ids=ids[:, :1])
        return model(input_ids=ids[:, :1]).logits.float().sum() * 0.0, {}
    from nd_parallel.plugins.trainer.relora import tokens_key

    keys = [tokens_key(row) for row in ids]  # a document's rollouts: keyed by its tokens
    rows = ids.repeat_interleave(n, dim=0)
    full = generate(model, rows, blocks, anchor, s, [f"{keys[r // n]}:{r % n}" for r in range(len(rows))],
                    trainer.args.seed, trainer.state.global_step)
    dtype = next(model.parameters()).dtype
    mask, positions = model_inputs(length, anchor, gen, s, blocks, len(rows), dtype, ids.device)
    logits = model(input_ids=full, attention_mask=mask, position_ids=positions).logits
    source = sampled_from(length, anchor, s["stride"], blocks, gen).to(ids.device)  # [gen, blocks]
    generated = full[:, length:].view(len(rows), gen, blocks)
    logps = _log_probs(logits[:, source], generated)  # [rows, gen, blocks]: where each token was sampled
    with torch.no_grad():
        net, off = (model, unwrapped.disable_adapter()) if adapter else (frozen, contextlib.nullcontext())
        feats = features(net, off, full, mask, positions, s["feature_layers"],
                         unwrapped.config.get_text_config().num_hidden_layers)
        rolled, truth = block_embeddings(feats, length, anchor, blocks, s)
        rewards, alignment, diversity, cfm = block_rewards(rolled, truth, docs, s)
        adv = advantages(rewards, s["advantage_estimator"])  # [rows, blocks]
    rl_loss = -(logps * adv[:, None, :]).mean()
    ce_loss = torch.zeros((), device=ids.device)
    if s["ce_coef"] > 0:  # the document's next-token loss in its own (causal) part of the same forward
        targets = ids[:, 1:].repeat_interleave(n, dim=0)
        if structured and "labels" in inputs:
            keep = (inputs["labels"][:, 1:] != -100).repeat_interleave(n, dim=0)
        else:
            keep = torch.ones_like(targets, dtype=torch.bool)
        token_ce = -_log_probs(logits[:, :length - 1], targets)
        ce_loss = (token_ce * keep).sum() / keep.sum().clamp(min=1)
    loss = s["rl_coef"] * rl_loss + s["ce_coef"] * ce_loss
    metrics = {"rl_loss": rl_loss.detach(), "ce_loss": ce_loss.detach(), "cfm_loss": cfm, "mean_reward":
               rewards.mean(), "alignment": alignment, "diversity": diversity, "num_blocks": float(blocks),
               "advantages_std": adv.std()}
    if structured:
        metrics["anchor_offset"] = float(anchor)
    return loss, metrics


def collator(pad_id: int):
    """Rows of input_ids / labels (/ prompt_length) -> right-padded tensors (the transforms pad to sequence_len)."""
    def collate(rows: list[dict]) -> dict:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r["input_ids"])] = torch.as_tensor(r["input_ids"])
            labels[i, :len(r["input_ids"])] = torch.as_tensor(r.get("labels", r["input_ids"]))
        batch = {"input_ids": ids, "labels": labels}
        if all(r.get("prompt_length") is not None for r in rows):
            batch["prompt_length"] = torch.tensor([r["prompt_length"] for r in rows])
        return batch

    return collate


def trainer(t, trainer_args: dict, **parts):
    """transformers' Trainer with the strided EBFT loss (strided_loss), 1/dp loss shares and ebft/* metrics."""
    from transformers import Trainer, TrainingArguments

    from nd_parallel.plugins.trainer.dpo import global_mean_share

    s = strided_settings(t.ebft)
    model = parts["model"]
    if getattr(model.config, "_attn_implementation", None) not in ("eager", "sdpa"):
        model.set_attn_implementation("sdpa")  # flash attention cannot take the strided mask (ebft.notes says so)
    frozen = frozen_copy(t, model)

    class StridedEBFTTrainer(Trainer):
        loss_is_scaled_for_ga = False  # a micro-batch mean: the Trainer averages the micro-batches

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, metrics = strided_loss(self, model, inputs, s, frozen)
            for name, value in metrics.items() if model.training else ():  # evaluation: its loss only
                self.seen.setdefault(name, []).append(float(value))
            loss = global_mean_share(self, loss, 1)  # each rank's micro-batch mean: 1/dp of the global mean
            return (loss, None) if return_outputs else loss

        def log(self, logs, *args, **kwargs):
            if "loss" in logs and self.seen:  # the step's micro-batches, over the ranks
                names = sorted(self.seen)
                local = torch.tensor([sum(self.seen[k]) / len(self.seen[k]) for k in names],
                                     device=self.accelerator.device)
                logs.update({f"ebft/{k}": v for k, v in zip(names, self.accelerator.gather(local[None]).mean(0)
                                                            .tolist())})
                self.seen.clear()
            return super().log(logs, *args, **kwargs)

    args = TrainingArguments(**{**trainer_args, "prediction_loss_only": True})  # evaluation: the loss, no logits
    out = StridedEBFTTrainer(args=args, data_collator=collator(
        parts["processing_class"].pad_token_id or 0), **parts)
    out.seen = {}
    if frozen is not None:
        frozen.to(out.accelerator.device)
    return out
