"""Axolotl's diffusion plugin (``plugins: [axolotl.integrations.diffusion.DiffusionPlugin]`` with a ``diffusion:``
block): masked-diffusion language-model training (LLaDA-style) of a causal LM's weights, with the meaning of
Axolotl 0.19's ``DiffusionTrainer``:

- each row draws a noise level ``t ~ U(0, 1)``; each of its tokens is replaced by the mask token with probability
  ``p = (1 - eps) * t + eps``, except padding, the tokenizer's bos / eos / pad tokens and tokens without a label;
- the model sees the noised row with bidirectional attention inside each packed sample (a 4-D mask; no token attends
  across samples or to padding), and its logits are shifted so that position i is read from position i - 1's
  output (Axolotl's ``shift_logits_to_input_positions``);
- the loss is the cross-entropy of the masked tokens, divided by ``p`` (``importance_weighting``, default true),
  summed per row and divided by the row's trained-token count, averaged over the rows.

Written by hand (Axolotl's plugin is Axolotl's Trainer subclass): the compute_loss above on transformers' Trainer,
and a collator that adds each row's sample ids. Differences, so that the layouts train as one process does: the
random draws come from a generator seeded with (seed, step, the row's tokens), not torch's global one (the ranks of a
layout consume that differently), so one process and every layout mask the same tokens of the same row; the
micro-batches' losses are averaged (Axolotl's Trainer takes them as already scaled for gradient accumulation), and
each rank's mean over its rows enters as its share of the global batch's mean (nd_parallel sums the dp gradients).
Keys Axolotl 0.19's training reads nowhere (``noise_schedule``, ``min_mask_ratio``, ``max_mask_ratio``,
``num_diffusion_steps``) are accepted as there, with one line; its sample generation during training
(``generate_samples`` and the ``generation_*`` keys: text logged every N steps) is not done here, one line says so.
``mask_token_id`` must be a token of the tokenizer (or ``mask_token_str`` one of its special tokens): the ranks
check it before the first step (Axolotl would add a new token and grow the embeddings). FSDP2 / HSDP / DDP only:
tensor, context and pipeline parallelism split what the 4-D mask and the loss read whole, and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .keys import model_splits
from .reward import reward_kind

PLUGIN = "axolotl.integrations.diffusion.DiffusionPlugin"
USED = {"eps": 1e-3, "importance_weighting": True, "mask_token_id": None, "mask_token_str": None}
UNREAD = ("noise_schedule", "min_mask_ratio", "max_mask_ratio", "num_diffusion_steps")
GENERATION = ("generate_samples", "generation_interval", "num_generation_samples", "generation_steps",
              "generation_temperature", "generation_max_length")


@dataclass(kw_only=True)
class DiffusionOptions:
    diffusion: dict | None = None
    """Axolotl's diffusion plugin block (eps, importance_weighting, mask_token_id / mask_token_str, ...): masked
    diffusion training (cli/train/diffusion.py)."""


def refusals(d: dict, layout) -> list[str]:
    block = d.get("diffusion")
    if block is None:
        return []
    if not isinstance(block, dict):
        return [f"diffusion={block!r}: write a mapping, e.g. {{eps: 0.001, mask_token_id: 128002}}"]
    out = []
    if PLUGIN not in (d.get("plugins") or []):
        out.append(f"diffusion: Axolotl reads this block only with its plugin: list {PLUGIN} under plugins:")
    unknown = sorted(set(block) - set(USED) - set(UNREAD) - set(GENERATION))
    if unknown:
        out.append(f"diffusion: {', '.join(unknown)} not keys of Axolotl's diffusion plugin; known: "
                   f"{', '.join([*USED, *UNREAD, *GENERATION])}")
    eps = block.get("eps", USED["eps"])
    if isinstance(eps, str):  # YAML reads 5e-4 (no decimal point) as a string; Axolotl's schema as the number
        try:
            eps = block["eps"] = float(eps)
        except ValueError:
            pass
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        out.append(f"diffusion.eps={eps!r}: write a number between 0 and 1 (the least masking probability)")
    if not isinstance(block.get("importance_weighting", USED["importance_weighting"]), bool):
        out.append(f"diffusion.importance_weighting={block['importance_weighting']!r}; use true or false")
    token = block.get("mask_token_id")
    if token is None and not isinstance(block.get("mask_token_str"), str):
        out.append("diffusion: give mask_token_id (a token id of the tokenizer) or mask_token_str (one of its "
                   "special tokens); Axolotl would add a new token and grow the embeddings, not done here")
    elif token is not None and (isinstance(token, bool) or not isinstance(token, int) or token < 0):
        out.append(f"diffusion.mask_token_id={token!r}: write a token id")
    if d.get("rl") or reward_kind(d) or d.get("processor_type"):
        out.append("diffusion with rl, a reward model or processor_type: Axolotl's diffusion objective trains a "
                   "text causal LM; drop one of them")
    aliases = ("flash_attention", "flex_attention", "xformers_attention", "sage_attention")
    kernel = d.get("attn_implementation") or next((k for k in aliases if d.get(k)), None)
    if kernel not in (None, "sdpa", "eager", "sdp_attention", "eager_attention"):
        out.append(f"diffusion with {kernel}: its bidirectional 4-D attention mask needs attn_implementation: sdpa or "
                   "eager (as Axolotl's diffusion examples set)")
    split = model_splits(layout)
    if split:
        out.append(f"diffusion with {split}: the bidirectional 4-D mask and the masked-token loss are read whole; "
                   "use dp_shard_size / dp_replicate_size")
    return out


def notes(d: dict) -> list[str]:
    block = d.get("diffusion")
    if not isinstance(block, dict):
        return []
    out = [f"diffusion.{k}: read by no Axolotl 0.19 training code (only declared); accepted, as there"
           for k in UNREAD if k in block]
    if block.get("generate_samples", True):
        out.append("diffusion.generate_samples: the samples Axolotl generates and logs during training are not "
                   "generated here (training is the same); sample from the saved model afterwards")
    return out


def segments(rows: list[dict], length: int):
    """Each row's sample ids (1, 2, ... per packed sample, restarting where position_ids restart; 0 = padding)."""
    import torch

    out = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        positions = torch.as_tensor(row.get("position_ids") or range(len(row["input_ids"])))
        out[i, :len(positions)] = (positions == 0).cumsum(0)
    return out


def noise(input_ids, labels, sample_ids, special: set[int], eps: float, seed: int, step: int):
    """(masked positions, masking probability per position) of a micro-batch, each row from its own generator."""
    import torch

    from nd_parallel.plugins.trainer.relora import keyed_generator, tokens_key

    rows, length = input_ids.shape
    t = torch.empty(rows, dtype=torch.float32)
    draws = torch.empty(rows, length, dtype=torch.float32)
    for i in range(rows):  # (seed, step, the row's tokens): the same draws wherever the row lands
        g = keyed_generator(seed, step, tokens_key(input_ids[i]))
        t[i] = torch.rand((), generator=g)
        draws[i] = torch.rand(length, generator=g)
    p = ((1 - eps) * t + eps)[:, None].expand(rows, length).to(input_ids.device)
    keep = sample_ids > 0
    for token in special:
        keep &= input_ids != token
    masked = (draws.to(input_ids.device) < p) & keep & (labels != -100)
    return masked, p


def compute_loss(trainer, model, inputs: dict[str, Any], block: dict, special: set[int], mask_id: int):
    """Axolotl's diffusion loss of one micro-batch (module docstring), the mean over its rows."""
    import torch
    import torch.nn.functional as F

    sample_ids = inputs.pop("sample_ids")
    inputs.pop("position_ids", None)  # Axolotl passes input ids and the 4-D mask only
    inputs.pop("attention_mask", None)
    input_ids, labels = inputs["input_ids"], inputs["labels"]
    masked, p = noise(input_ids, labels, sample_ids, special, block.get("eps", USED["eps"]), trainer.args.seed,
                      trainer.state.global_step)
    noised = torch.where(masked, torch.full_like(input_ids, mask_id), input_ids)
    attend = (sample_ids[:, :, None] == sample_ids[:, None, :]) & (sample_ids[:, :, None] > 0)
    eye = torch.eye(attend.shape[1], dtype=torch.bool, device=attend.device)
    attend |= eye & (sample_ids == 0)[:, :, None]  # padding sees itself only: no empty softmax row in any kernel
    logits = model(input_ids=noised, attention_mask=attend[:, None]).logits
    logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # position i read from i - 1's output
    ce = F.cross_entropy(logits.float().transpose(1, 2), input_ids, reduction="none")
    weighted = torch.where(masked, ce / p if block.get("importance_weighting", USED["importance_weighting"]) else ce,
                           0.0)
    trained = (labels != -100).sum(1).clamp(min=1).float()
    return (weighted.sum(1) / trained).mean()  # on the graph even when nothing is masked: every rank backs


def trainer(t, base, args, collator, parts: dict):
    """transformers' Trainer (``base``) as the run needs it: with the diffusion loss and sample ids when
    ``t.diffusion`` is set, else as given."""
    if not t.diffusion:
        return base(args=args, data_collator=collator, **parts)
    block = dict(t.diffusion)

    def collate(rows):
        batch = collator(rows)
        batch["sample_ids"] = segments(rows, batch["input_ids"].shape[1])
        return batch

    from nd_parallel.plugins.trainer.dpo import global_mean_share

    tokenizer = parts["processing_class"]
    mask_id = mask_token(tokenizer, block)  # checked on every rank before training starts
    special = {i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}

    class DiffusionTrainer(base):
        loss_is_scaled_for_ga = False  # a mean over the micro-batch's rows: the Trainer averages micro-batches

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            rows = len(inputs["input_ids"])  # each rank's row mean is its share of the global mean (dp sums)
            loss = global_mean_share(self, compute_loss(self, model, inputs, block, special, mask_id), rows)
            return (loss, None) if return_outputs else loss

    return DiffusionTrainer(args=args, data_collator=collate, **parts)


def mask_token(tokenizer, block: dict) -> int:
    """mask_token_id if the tokenizer has it, else mask_token_str if it is one of its special tokens."""
    token, text = block.get("mask_token_id"), block.get("mask_token_str")
    if token is not None and 0 <= token < len(tokenizer):
        return token
    if text is not None and text in (tokenizer.all_special_tokens or []):
        return tokenizer.convert_tokens_to_ids(text)
    raise ValueError(f"diffusion: mask_token_id={token!r} / mask_token_str={text!r} is not a token of the tokenizer "
                     f"({len(tokenizer)} tokens); give an existing id, or add the token with tokens: / special_tokens:")
