"""What the planner needs to know about a model, read from the real model built on the meta device.

No weight is read and no memory is allocated: meta.py runs `AutoModelForCausalLM.from_config` under
`torch.device("meta")`, and every count below comes from that module tree (parameter shapes, which modules the
model's own TP plan shards, which Linears a LoRA adapter would wrap), not from the config's numbers alone. The
config is only used for what the module tree cannot say (head counts, tied embeddings, max positions).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch.nn as nn

from nd_parallel.models import hf
from nd_parallel.models.hf import UnsplittableModel, model_parts

from .errors import PlannerError
from .meta import load_config, meta_model
from .ops import OpCounts, count_ops


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and parameter counts of a decoder-only causal LM, per part (embedding, one layer, head)."""

    name: str
    """Model class and source, for reports."""
    num_layers: int
    """Decoder layers in the stack the pipeline split cuts."""
    hidden: int
    """Width of the residual stream (h)."""
    heads: int
    """Attention (query) heads."""
    kv_heads: int
    """Key/value heads (GQA: fewer than `heads`)."""
    head_dim: int
    """Width of one head."""
    ffn: int
    """Width of the MLP's inner projection (f)."""
    gated_mlp: bool
    """Three MLP projections (gate, up, down: SwiGLU/GeGLU) rather than two."""
    qk_norm: bool
    """Per-head norms on q and k (Qwen3, Gemma3), which save activations of their own."""
    vocab: int
    """Rows of the input embedding (= columns of the logits)."""
    tied: bool
    """lm_head shares the embedding's weight."""
    max_positions: int | None
    """config.max_position_embeddings, or None when the model has no such limit."""
    layer_params: int
    """Parameters of one decoder layer (the largest, if they differ)."""
    layer_tp_params: int
    """Of those, the ones the model's TP plan shards over tp ranks (the rest are replicated: norms)."""
    layer_matmul_params: int
    """Of those, the weights of Linears: 2 FLOPs per weight per token forward."""
    pre_params: int
    """Parameters before the stack (embeddings)."""
    post_params: int
    """Parameters after it (final norm, and lm_head unless tied)."""
    head_params: int
    """lm_head's weight (counted in `post_params` unless tied)."""
    embed_tp_sharded: bool
    """The TP plan shards the embedding by vocabulary rows."""
    head_tp_sharded: bool
    """The TP plan shards lm_head by vocabulary (colwise with gathered output)."""
    largest_param: int
    """Elements of the largest parameter tensor (the single-tensor AdamW step's temporary)."""
    lora_linears: tuple[tuple[int, int], ...]
    """(in_features, out_features) of each Linear a LoRA adapter targets in one layer."""
    linear_head: bool = True
    """The head is one nn.Linear and the config sets no soft-cap or logit scale: the chunked loss's fast path (one
    chunk buffer, one head gradient; decided at run time by distributed/linear_loss.py, predicted here)."""
    layer_tensors: int = 0
    """Parameter tensors of one decoder layer (the for-loop AdamW pays its ops per tensor)."""
    rest_tensors: int = 0
    """Parameter tensors outside the stack (embedding, final norm, untied head)."""
    layer_colwise: int = 0
    """Modules of one layer the TP plan shards colwise: each all-reduces its input gradient backward."""
    layer_rowwise: int = 0
    """Modules of one layer the TP plan shards rowwise: each all-reduces its output forward."""
    ops: OpCounts = field(default_factory=OpCounts.none)
    """Aten ops per layer and per step, counted on the model (see ops.py); all zero when not counted."""
    layer_expert_params: int = 0
    """Of `layer_params`, the stacked expert weights [num_experts, ...] of a mixture-of-experts layer (0: dense)."""
    num_experts: int = 0
    """Experts per MoE layer (the stacked weights' leading dim); 0 for a dense model."""
    experts_per_token: int = 0
    """Experts each token runs through (top-k): only their weights count in the FLOPs."""
    moe_layers: int = 0
    """Decoder layers with stacked experts (the rest are dense, e.g. DeepSeek's first_k_dense_replace)."""
    layer_expert_tp_params: int = 0
    """Of `layer_expert_params`, the ones the TP plan splits (moe_tp_experts); under expert parallelism they are
    split over ep instead and whole on every tp rank."""
    expert_ffn: int = 0
    """Of `ffn`, the width of the experts a token runs through (top-k x expert width): not split by tp under ep."""

    @property
    def total_params(self) -> int:
        return self.pre_params + self.num_layers * self.layer_params + self.post_params

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: a MoE layer's experts count k / num_experts of theirs."""
        if not self.num_experts:
            return self.total_params
        idle = self.layer_expert_params * (self.num_experts - self.experts_per_token) // self.num_experts
        return self.total_params - self.moe_layers * idle

    def expert_parallel_sizes(self) -> list[int]:
        """The ep sizes a search may try: divisors of num_experts (1 for a dense model)."""
        return [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0] if self.num_experts else [1]

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    def lora_layer_params(self, rank: int) -> int:
        """Trainable parameters a rank-`rank` LoRA adds to one layer: A (r x in) + B (out x r) per target."""
        return sum(rank * (i + o) for i, o in self.lora_linears)


def _matches(plan: dict[str, str], name: str) -> str | None:
    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name):
            return style
    return None


TP_STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "local_colwise", "local_rowwise")


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _lora_targets(layer: nn.Module, targets: tuple[str, ...] | None) -> tuple[tuple[int, int], ...]:
    """Linears a LoRA adapter wraps: every Linear of the layer ('all-linear'), or those named in `targets`."""
    found = []
    for name, mod in layer.named_modules():
        if isinstance(mod, nn.Linear) and (targets is None or name.rsplit(".", 1)[-1] in targets):
            found.append((mod.in_features, mod.out_features))
    return tuple(found)


def _stacked_experts(layer: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Modules of a layer holding stacked expert weights: 3-D parameters [num_experts, ...] with one leading dim.
    Found from the module tree, not from names (a dense layer has none)."""
    found = {}
    for name, module in layer.named_modules():
        stacked = [p for p in module.parameters(recurse=False) if p.ndim == 3]
        if stacked and len({p.shape[0] for p in stacked}) == 1:
            found[name] = stacked
    return found


def _moe(layer: nn.Module, layers, plan: dict, prefix: str, text) -> dict:
    """ModelSpec's MoE fields of `layer` (the largest one), plus what TP splits and the active MLP width."""
    experts = _stacked_experts(layer)
    if not experts:
        return {}
    stacked = [p for ps in experts.values() for p in ps]
    num = stacked[0].shape[0]
    k = getattr(text, "num_experts_per_tok", None) or getattr(text, "moe_topk", None) or getattr(text, "top_k", None)
    if not k:
        import warnings

        warnings.warn(f"planner: {type(text).__name__} has no num_experts_per_tok; counting all {num} experts as "
                      "active per token", stacklevel=3)
        k = num
    inner = {d for p in stacked for d in p.shape[1:] if d != text.hidden_size}
    tp_split = sum(p.numel() for name, ps in experts.items() if _matches(plan, f"{prefix}.{name}") == "moe_tp_experts"
                   for p in ps)
    return dict(layer_expert_params=sum(p.numel() for p in stacked), num_experts=num, experts_per_token=int(k),
                moe_layers=sum(1 for lay in layers if _stacked_experts(lay)), layer_expert_tp_params=tp_split,
                gated=any(2 * d in inner for d in inner) or len(stacked) >= 3)


# config keys of a step between the head's matmul and the loss (Gemma's soft-cap, Granite's and Cohere's scales,
# Falcon-H1's multiplier); 1.0 / None mean no step
_LOGIT_STEPS = ("final_logit_softcapping", "logits_scaling", "logit_scale", "lm_head_multiplier")


def _linear_head(head: nn.Module | None, text) -> bool:
    """Whether the chunked loss will take its linear fast path (the run decides exactly: linear_loss.linear_head)."""
    return (isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward
            and all(getattr(text, k, None) in (None, 1, 1.0) for k in _LOGIT_STEPS))


def model_spec(model: nn.Module, name: str = "", lora_targets: tuple[str, ...] | None = None) -> ModelSpec:
    """Read a ModelSpec from a (meta-device) causal LM; PlannerError when its layer stack cannot be found."""
    try:
        parts = model_parts(model)
    except UnsplittableModel as err:
        raise PlannerError(f"cannot find the decoder-layer stack of {type(model).__name__}: {err}") from None
    text = hf.text_config(model)
    layers = model.get_submodule(parts.layers_fqn)
    plan = hf.tp_plan(model)
    index = max(range(len(layers)), key=lambda i: _numel(layers[i]))  # a MoE layer, where some are dense
    layer_prefix = f"{parts.layers_fqn}.{index}"
    layer = layers[index]
    styles = {n: _matches(plan, f"{layer_prefix}.{n}") for n, _ in layer.named_modules() if n}
    tp_modules = [m for n, m in layer.named_modules() if n and styles[n] in TP_STYLES]
    moe = _moe(layer, layers, plan, layer_prefix, text)
    tp_params = sum(_numel(m) for m in tp_modules) + moe.get("layer_expert_tp_params", 0)
    matmul = sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
    mlp_linears = [m for n, m in layer.named_modules() if "mlp" in n.split(".")[0] and isinstance(m, nn.Linear)]
    gated = moe.pop("gated", len(mlp_linears) >= 3)
    ffn = getattr(text, "intermediate_size", None) or max((m.out_features for m in mlp_linears), default=4 * text.hidden_size)
    if moe:  # per token only its top-k experts run: their weights count in the FLOPs, their width in the activations
        active = moe["layer_expert_params"] * moe["experts_per_token"] // moe["num_experts"]
        ffn = (sum(m.weight.numel() for m in mlp_linears) + active) // (text.hidden_size * (3 if gated else 2))
        moe["expert_ffn"] = active // (text.hidden_size * (3 if gated else 2))
        matmul += active
    moe_tp = sum(1 for v in styles.values() if v == "moe_tp_experts")  # sums its output, all-reduces its inputs' grad
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    qk_norm = any(n.split(".")[-1] in ("q_norm", "k_norm", "q_layernorm", "k_layernorm") for n, _ in layer.named_modules())
    emb, head = hf.embedding_and_head(model)
    tied = hf.shares_embedding(model)
    modules = dict(model.named_modules())
    emb_name = next((n for n, m in modules.items() if m is emb), "")
    head_name = next((n for n, m in modules.items() if m is head), "")
    pre = sum(_numel(model.get_submodule(n)) for n in parts.pre)
    post = sum(_numel(model.get_submodule(n)) for n in parts.post)
    if tied:  # named_children lists lm_head under `post` although its weight is the embedding's
        post -= head.weight.numel() if head_name in parts.post else 0
    sharded_rest = [m for n, m in ((emb_name, emb), (head_name, head)) if m is not None and _matches(plan, n)]
    try:
        ops = count_ops(model.config, tp_modules, sharded_rest, lora_targets)
    except (RuntimeError, ValueError, TypeError, NotImplementedError, AttributeError) as err:
        # a model that will not run on meta with one or two layers: plan without the per-op overhead (it
        # matters for small models only) rather than refuse
        import warnings

        warnings.warn(f"planner: cannot count {type(model).__name__}'s ops on the meta device ({err}); the step "
                      "time leaves out per-op overhead", stacklevel=2)
        ops = OpCounts.none()
    return ModelSpec(
        name=name or type(model).__name__, num_layers=parts.num_layers, hidden=text.hidden_size, heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim, ffn=ffn,
        gated_mlp=gated, qk_norm=qk_norm, vocab=emb.weight.shape[0], tied=tied,
        max_positions=getattr(text, "max_position_embeddings", None),
        layer_params=max(_numel(l) for l in layers), layer_tp_params=tp_params, layer_matmul_params=matmul,
        pre_params=pre, post_params=post, head_params=head.weight.numel() if head is not None else 0,
        embed_tp_sharded=_matches(plan, emb_name) is not None,
        head_tp_sharded=head is not None and _matches(plan, head_name) is not None,
        largest_param=max(p.numel() for p in model.parameters()),
        lora_linears=_lora_targets(layer, lora_targets), linear_head=_linear_head(head, text),
        layer_tensors=len(list(layer.parameters())),
        rest_tensors=sum(len(list(model.get_submodule(n).parameters())) for n in (*parts.pre, *parts.post))
        - (1 if tied and head_name in parts.post else 0),
        layer_colwise=sum(1 for v in styles.values() if v and "colwise" in v and v != "packed_colwise") + moe_tp,
        layer_rowwise=sum(1 for v in styles.values() if v and "rowwise" in v and v != "packed_rowwise") + moe_tp,
        ops=ops, **moe)


def spec_from_path(model: str, lora_targets: tuple[str, ...] | None = None) -> ModelSpec:
    """Load the config at `model`, build the model on meta, and read its ModelSpec."""
    config = load_config(model)
    built = meta_model(config)
    return model_spec(built, name=f"{type(built).__name__} ({Path(model).name})", lora_targets=lora_targets)
