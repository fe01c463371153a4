"""`rl: ebft` (structured mode) in `nd-parallel train`: Axolotl 0.19's energy-based fine-tuning, a GRPO run (grpo.py:
TRL's GRPOTrainer, keyed sampling, the same layouts) whose one reward is feature matching against the record's
``ground_truth``, with the meaning of Axolotl's ``ebft:`` block:

- a frozen feature network (the base with the adapter disabled under LoRA; under full fine-tuning a frozen copy of the
  checkpoint on each rank) reads prompt + completion and prompt + ground truth; the hidden states after the layers at
  ``feature_layers`` (fractions of the depth) are concatenated and pooled by ``embed_method`` (``last_token``,
  ``mean_pooling``, ``completion_mean``, ``concat``: the tokens at a quarter, half and three quarters);
- the embeddings are L2-normalized, or with ``use_whitening`` whitened per prompt group (an SVD of the group's
  completions' embeddings, the same map applied to the ground truth);
- reward = ``alignment_coef`` x 2 cos(completion, ground truth) - ``diversity_coef`` x 2 mean dot product with the
  group's other completions (the paper's equation 7); the alignment, diversity, reward and conditional
  feature-matching loss (the squared distance of the group's mean embedding to the ground truth's) are logged as
  ``ebft/*``.

Written by hand (Axolotl's trainer subclasses its own GRPO trainer): the reward above as a GRPO reward function.
A group's reward needs all its completions, so each rank's generation batch (micro_batch_size x
gradient_accumulation_steps) must hold whole groups of ``num_generations``: checked before any rank starts.
``ce_coef`` and the ``stride`` ... keys belong to strided mode (``mode: strided``: ebft_strided.py, which reuses
``whiten`` and the settings here); ``adaptive_max_tokens`` acts with vLLM generation only in Axolotl, and vLLM
is not used here (grpo.py), so completions run to ``max_completion_length`` as in Axolotl's runs without vLLM.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .data.sources import suggest

EMBED_METHODS = ("last_token", "mean_pooling", "completion_mean", "concat")
STRUCTURED = {"feature_layers": [0.25, 0.5, 0.75], "embed_method": "last_token", "use_whitening": False,
              "alignment_coef": 1.0, "diversity_coef": 1.0, "ce_coef": 0.0, "adaptive_max_tokens": True,
              "gt_length_multiplier": 1.5, "mode": "structured"}
# strided mode's own keys with Axolotl's defaults (ebft_strided.py)
STRIDED = {"stride": 8, "context_length": 8, "generate_max_len": 8, "n_samples_per_prompt": 4, "temperature": 0.6,
           "top_p": 1.0, "rl_coef": 1.0, "advantage_estimator": "rloo", "min_completion_prefix": 0}
MODES = ("structured", "strided")


def refusals(d: dict) -> list[str]:
    block = d.get("ebft") or {}
    if not isinstance(block, dict):
        return [f"ebft={block!r}: write a mapping, e.g. {{feature_layers: [0.25, 0.5, 0.75], embed_method: "
                "last_token}"]
    out = []
    mode = block.get("mode") or "structured"
    if mode not in MODES:
        out.append(f"ebft.mode={mode!r}; use one of {', '.join(MODES)}")
    elif mode == "strided":
        out += _strided_refusals(block)
    for key in sorted(set(block) - set(STRUCTURED) - set(STRIDED)):
        out.append(f"unknown key ebft.{key}; {suggest(key, STRUCTURED)}")
    if block.get("embed_method", "last_token") not in EMBED_METHODS:
        out.append(f"ebft.embed_method={block['embed_method']!r}; use one of {', '.join(EMBED_METHODS)}")
    layers = block.get("feature_layers", STRUCTURED["feature_layers"])
    if not isinstance(layers, list) or not layers or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1 for x in layers):
        out.append(f"ebft.feature_layers={layers!r}: write fractions of the depth between 0 and 1, e.g. [0.25, 0.5]")
    return out


def _strided_refusals(block: dict) -> list[str]:
    out = []
    for key in ("stride", "context_length", "generate_max_len", "n_samples_per_prompt"):
        value = block.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            out.append(f"ebft.{key}={value!r}: write an integer >= 1 (Axolotl's default {STRIDED[key]})")
    prefix = block.get("min_completion_prefix")
    if prefix is not None and (isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0):
        out.append(f"ebft.min_completion_prefix={prefix!r}: write an integer >= 0 (tokens of the completion before "
                   "the first anchor)")
    for key in ("temperature", "top_p", "rl_coef", "ce_coef"):
        value = block.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
                                  or key == "top_p" and not 0 < value <= 1):
            out.append(f"ebft.{key}={value!r}: write a number " + ("in (0, 1]" if key == "top_p" else ">= 0"))
    estimator = block.get("advantage_estimator")
    if estimator is not None and estimator not in ("rloo", "group_norm", "reinforce"):
        out.append(f"ebft.advantage_estimator={estimator!r}; use one of rloo, group_norm, reinforce")
    if block.get("embed_method") in ("completion_mean", "concat"):
        out.append(f"ebft.embed_method={block['embed_method']!r} with mode: strided: a block is pooled by "
                   "last_token or mean_pooling (Axolotl reads anything else as last_token); write one of those")
    return out


def strided(d: dict) -> bool:
    return d.get("rl") == "ebft" and isinstance(d.get("ebft"), dict) and d["ebft"].get("mode") == "strided"


def settings(block: dict | None) -> dict:
    return {**STRUCTURED, **{k: v for k, v in (block or {}).items() if v is not None}}


def notes(d: dict) -> list[str]:
    block = settings(d.get("ebft"))
    out = []
    if strided(d):
        return _strided_notes(d)
    if block["ce_coef"]:
        out.append(f"ebft.ce_coef={block['ce_coef']}: read by Axolotl's strided mode only; no effect in structured")
    if (d.get("ebft") or {}).get("adaptive_max_tokens"):
        out.append("ebft.adaptive_max_tokens: Axolotl applies it to vLLM generation only; completions here run to "
                   "trl.max_completion_length, as in Axolotl's runs without vLLM")
    out += [f"ebft.{k}: read in mode: strided only; unused in structured mode" for k in STRIDED
            if (d.get("ebft") or {}).get(k) is not None]
    return out


def _strided_notes(d: dict) -> list[str]:
    block = d["ebft"]
    out = ["ebft.mode: strided: each rollout token's log-prob is read at the position it was sampled from, with its "
           "own block's advantage (Axolotl reads the previous position of the appended rollouts, another block's "
           "when there are several); rollouts are sampled with noise keyed by (seed, step, document, rollout, "
           "position), so every data-parallel layout draws what one process draws"]
    out += [f"ebft.{k}: read in structured mode only; unused in strided mode" for k in ("adaptive_max_tokens",
                                                                                       "gt_length_multiplier")
            if block.get(k) is not None]
    if d.get("trl"):
        out.append("trl: Axolotl's strided EBFT reads none of it (the ebft: block sets the rollouts); unused")
    if str(d.get("attn_implementation") or "").startswith(("flash", "flex")) or d.get("flash_attention"):
        out.append("attn_implementation: the strided mask is a dense 4-D mask; the model runs SDPA with it here "
                   "(Axolotl: eager, or flex_attention's block mask on CUDA)")
    return out


def frozen_copy(t, model):
    """The feature network under full fine-tuning: a frozen copy of the model on each rank (as Axolotl); None under
    LoRA, where the base with the adapter disabled reads the features."""
    if t.adapter in ("lora", "qlora"):
        return None
    import copy

    return copy.deepcopy(model).requires_grad_(False).eval()


def pool(hidden: torch.Tensor, method: str, mask: torch.Tensor, prompt_lengths: torch.Tensor | None) -> torch.Tensor:
    """[B, S, D] hidden states -> [B, D'] sequence embeddings (right-padded rows; ``mask`` marks real tokens;
    ``prompt_lengths``, read by completion_mean only, the prompt's tokens per row)."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    lengths = mask.sum(1).long()
    if method == "last_token":
        return hidden[rows, lengths - 1]
    if method == "concat":  # the tokens at a quarter, half and three quarters of each row
        top = hidden.shape[1] - 1
        return torch.cat([hidden[rows, (lengths * k // 4).clamp(0, top)] for k in (1, 2, 3)], dim=-1)
    keep = mask.bool()
    if method == "completion_mean":
        keep = keep & (torch.arange(hidden.shape[1], device=hidden.device)[None] >= prompt_lengths[:, None])
    weights = keep.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)


def whiten(generated: torch.Tensor, truth: torch.Tensor, tol: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """One group's whitening: W = U diag(1/s) U^T from the SVD of its completions' embeddings (directions with
    s <= tol x max(s) dropped), applied to them and to the ground truth's."""
    u, s, _ = torch.linalg.svd(generated.float().T, full_matrices=False)
    inverse = torch.where(s > tol * s.max(), 1.0 / (s + 1e-12), torch.zeros_like(s))
    w = (u * inverse[None]) @ u.T
    return generated.float() @ w, truth.float() @ w


def feature_rewards(generated: torch.Tensor, truth: torch.Tensor, groups: int, block: dict):
    """(rewards, alignment, diversity, per-group CFM loss) of [prompts x groups, D] completion embeddings against
    [prompts, D] ground-truth embeddings (the paper's equation 7 with Axolotl's coefficients)."""
    if block["use_whitening"] and generated.shape[0] > 1:
        pairs = [whiten(generated[j * groups:(j + 1) * groups], truth[j:j + 1]) for j in range(truth.shape[0])]
        generated, truth = torch.cat([g for g, _ in pairs]), torch.cat([t for _, t in pairs])
    else:
        generated, truth = F.normalize(generated, dim=-1), F.normalize(truth, dim=-1)
    per_group = generated.view(truth.shape[0], groups, -1)
    alignment = 2 * F.cosine_similarity(generated, truth.repeat_interleave(groups, 0), dim=-1)
    sims = per_group @ per_group.transpose(1, 2)
    sims = sims.masked_fill(torch.eye(groups, dtype=torch.bool, device=sims.device), 0.0)
    diversity = 2 * (sims.sum(-1) / max(groups - 1, 1)).reshape(-1)
    rewards = block["alignment_coef"] * alignment - block["diversity_coef"] * diversity
    return rewards, alignment, diversity, ((per_group.mean(1) - truth) ** 2).sum(-1)


class FeatureMatchingReward:
    """EBFT's reward as a GRPO reward function of (prompts, completions, ground_truth): see the module docstring.
    ``trainer`` is set once the GRPOTrainer exists (its model is the feature network's source)."""

    __name__ = "feature_matching"

    def __init__(self, block: dict, frozen_copy=None):
        self.block, self.frozen, self.trainer = settings(block), frozen_copy, None

    def _texts(self, prompts, tails) -> tuple[list[str], list[str]]:
        tok = self.trainer.processing_class
        rendered = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True,
                                            **self.trainer.chat_template_kwargs) if isinstance(p, list) else p
                    for p in prompts]
        tails = [(t[0].get("content", "") if t else "") if isinstance(t, list) else t for t in tails]
        return [p + t for p, t in zip(rendered, tails)], rendered

    def _features(self, texts: list[str], prompt_texts: list[str]) -> torch.Tensor:
        tok, trainer = self.trainer.processing_class, self.trainer
        side, tok.padding_side = tok.padding_side, "right"
        try:
            batch = tok(text=texts, return_tensors="pt", padding=True, truncation=True, max_length=2048,
                        add_special_tokens=False)
        finally:
            tok.padding_side = side
        ids, mask = batch["input_ids"].to(trainer.accelerator.device), batch["attention_mask"].to(
            trainer.accelerator.device)
        prompt_lengths = None  # tokenized again only where the pooling reads them
        if self.block["embed_method"] == "completion_mean":
            prompt_lengths = torch.tensor([len(tok.encode(p, add_special_tokens=False)) for p in prompt_texts],
                                          device=ids.device)
        model = self.frozen if self.frozen is not None else trainer.model_wrapped
        unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        disabled = unwrapped.disable_adapter() if self.frozen is None else contextlib.nullcontext()
        config = unwrapped.config.get_text_config()
        layers = [int(f * config.num_hidden_layers) for f in self.block["feature_layers"]]
        with disabled, torch.no_grad():
            training = model.training
            model.eval()
            hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            model.train(training)
        stacked = torch.cat([hidden[i] for i in layers], dim=-1).float()
        return pool(stacked, self.block["embed_method"], mask, prompt_lengths)

    @torch.no_grad()
    def __call__(self, prompts, completions, ground_truth=None, **kwargs) -> list[float]:
        groups = self.trainer.num_generations
        if ground_truth is None:
            raise ValueError("rl: ebft reads each record's ground_truth; the prepared rows have none")
        texts, prompt_texts = self._texts(prompts, completions)
        generated = self._features(texts, prompt_texts)
        firsts = list(range(0, len(prompts), groups))  # one ground truth per prompt group
        truth_texts, truth_prompts = self._texts([prompts[i] for i in firsts], [ground_truth[i] for i in firsts])
        truth = self._features(truth_texts, truth_prompts)
        rewards, alignment, diversity, cfm = feature_rewards(generated, truth, groups, self.block)
        metrics = self.trainer._metrics["train" if self.trainer.model.training else "eval"]
        for name, value in (("alignment", alignment), ("diversity", diversity), ("reward", rewards), ("cfm_loss", cfm)):
            # over the global generation batch (as TRL logs rewards), not this rank's share
            metrics[f"ebft/{name}"].append(self.trainer.accelerator.gather(value.contiguous()).mean().item())
        return rewards.cpu().tolist()

