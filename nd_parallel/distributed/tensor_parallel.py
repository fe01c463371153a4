"""Tensor parallelism from the model's own ``tp_plan``.

The plan is data: transformers ships one per model family (``model.tp_plan``: module-name patterns ->
style names such as ``"colwise"``). We read that plan, merge the user's overrides, and apply it with
torch's ``parallelize_module`` and its ``ParallelStyle`` classes. Why torch's styles and not
transformers' own ``apply_tensor_parallelism``: its signature and style classes changed between 5.16 and
5.24 (it is an internal of their loading path), while torch's styles are a stable API that is designed
to compose with ``fully_shard`` and DCP, which the rest of nd_parallel builds on.
"""

from __future__ import annotations

import difflib
import logging
import re

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from nd_parallel.distributed import sequence_parallel as sp
from nd_parallel.distributed import tensor_parallel_styles as moe
from nd_parallel.distributed.tensor_parallel_lora import KeepRequiresGrad, expand_plan
from nd_parallel.distributed.tensor_parallel_quantized import (
    apply_quantized_tp,
    check_quantized_tp,
    is_quantized_linear,
)
from nd_parallel.distributed.vocab_parallel import GATHERING_HEAD_STYLES, head_style
from nd_parallel.models import hf
from nd_parallel.models import moe as experts_of

logger = logging.getLogger(__name__)


def _replicated_with_grad_allreduce() -> ParallelStyle:
    # Used for per-head norms (Qwen3/Gemma3 q_norm, k_norm): the weight is whole on every TP rank, but each
    # rank normalises only its own heads, so the weight gradient is a partial sum that must be all-reduced
    # over TP. torch's SequenceParallel does exactly that: weights become Replicate DTensors and the input
    # is declared sharded on a non-normalised dim. Any dim except the last one is equivalent for a norm
    # over the last dim, and dim 0 exists for every input shape.
    return SequenceParallel(sequence_dim=0, use_local_output=True)


# HF style name -> factory (given the model's text config) of the torch ParallelStyle with the same meaning: every
# style a transformers 5.24 ``base_model_tp_plan`` names. The MoE/MLA ones are ours (tensor_parallel_styles.py).
STYLES = {
    "colwise": lambda cfg: ColwiseParallel(),
    "rowwise": lambda cfg: RowwiseParallel(),
    "colwise_rep": lambda cfg: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda cfg: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda cfg: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda cfg: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda cfg: RowwiseParallel(input_layouts=Replicate()),
    # torch's ColwiseParallel on an nn.Embedding splits embedding_dim; gathered, as transformers' EmbeddingParallel(1)
    "embedding_colwise": lambda cfg: ColwiseParallel(output_layouts=Replicate()),
    "replicated_with_grad_allreduce": lambda cfg: _replicated_with_grad_allreduce(),
    "moe_tp_experts": lambda cfg: moe.MoeExperts(),
    "moe_identity_expert": lambda cfg: moe.IdentityExpert(),
    "packed_colwise": lambda cfg: moe.PackedColwiseModule(),
    "packed_rowwise": None,  # parameter entries only (transformers' PackedRowwiseParallel has no forward either)
    "mla_kv_a_proj": lambda cfg: moe.MlaKvAProj(_rope_dim(cfg)),
    "local_params": lambda cfg: moe.LocalParams(),
    "all_reduce": lambda cfg: moe.AllReduceOutput(),
    "replicate": lambda cfg: moe.Replicated(),
}


def _rope_dim(cfg) -> int:
    rope = getattr(cfg, "qk_rope_head_dim", None)
    if rope is None:
        raise ValueError(f"tp_plan style mla_kv_a_proj needs qk_rope_head_dim in {type(cfg).__name__} (the rope "
                         "part of the kv_a projection); this model has none: drop that entry with tp_plan={...: None}")
    return rope


def check_styles(plan: dict[str, str | None]) -> None:
    """Every style named in a plan must be one we can apply (None = keep the module replicated)."""
    for key, style in plan.items():
        if style is None:
            continue
        if style not in STYLES:
            close = difflib.get_close_matches(style, STYLES, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise NotImplementedError(
                f"tp_plan entry '{key}': '{style}' is not a supported style; {hint}supported: {sorted(STYLES)}. "
                f"To keep that module replicated instead, pass tp_plan={{'{key}': None}}"
            )


def resolve_plan(model: nn.Module, overrides: dict[str, str | None] | None) -> dict[str, str]:
    """Merge overrides into the model's plan (None removes an entry) and validate the style names."""
    plan = hf.tp_plan(model)
    for key, style in (overrides or {}).items():
        if style is None:
            plan.pop(key, None)
        else:
            plan[key] = style
    check_styles(plan)
    return plan


def _pattern_to_regex(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")


def match_params(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Concrete parameter name -> style for every parameter a plan pattern names (stacked expert weights,
    attention sinks); module patterns never match a parameter name (first match wins)."""
    compiled = [(_pattern_to_regex(k), v) for k, v in plan.items()]
    return {name: style for name, _ in model.named_parameters()
            for style in [next((v for r, v in compiled if r.match(name)), None)] if style is not None}


def match_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Concrete module name -> style for every module a plan pattern matches (first match wins)."""
    compiled = [(_pattern_to_regex(k), v) for k, v in plan.items()]
    matched = {}
    for name, module in model.named_modules():
        style = next((v for r, v in compiled if r.match(name)), None)
        # Parameter-free modules are pipeline stand-ins for modules another stage owns, except the one style made
        # for a parameter-free module (longcat's zero experts: nn.Identity inside the experts).
        if style is not None and (style == "moe_identity_expert" or next(module.parameters(), None) is not None):
            matched[name] = style
    return {**moe.region_scalars(model, matched), **matched}


# The module types each style's torch class can split: torch's own error ("ColwiseParallel currently only support
# nn.Linear and nn.Embedding!") comes mid-parallelize and names neither the module nor the fix. None: any module.
_SPLITS = {"colwise": (nn.Linear, nn.Embedding), "rowwise": (nn.Linear, nn.Embedding),
           "colwise_rep": (nn.Linear, nn.Embedding), "colwise_gather_output": (nn.Linear, nn.Embedding),
           "rowwise_rep": (nn.Linear, nn.Embedding), "rowwise_split_input": (nn.Linear, nn.Embedding),
           "embedding_rowwise": (nn.Linear, nn.Embedding), "embedding_colwise": (nn.Embedding,),
           "packed_colwise": (nn.Linear,), "packed_rowwise": (), **dict.fromkeys(
               ("replicated_with_grad_allreduce", "moe_tp_experts", "moe_identity_expert", "mla_kv_a_proj",
                "local_params", "all_reduce", "replicate"))}


def check_module_types(model: nn.Module, overrides: dict[str, str | None] | None) -> None:
    """Every module a plan entry matches must be one its style can split (e.g. a user-wrapped lm_head), refused
    before any collective with the override that fixes it."""
    for name, style in match_plan(model, resolve_plan(model, overrides)).items():
        needs = _SPLITS[style]
        module = model.get_submodule(name)
        if needs == ():
            raise ValueError(f"tp_plan style {style} places parameters, but '{name}' matched the module "
                             f"{type(module).__name__}; name its parameter (e.g. '{name}.weight') instead")
        if needs is None or isinstance(module, needs) or hasattr(module, "base_layer"):  # PEFT: expand_plan's
            continue
        inner = [f"{name}.{n}" for n, m in module.named_modules() if n and isinstance(m, needs)]
        move = f"{{'{name}': None, '{inner[0]}': '{style}'}}" if len(inner) == 1 else f"{{'{name}': None}}"
        raise ValueError(
            f"`{name}` is a {type(module).__name__}, the tp_plan style {style} needs "
            f"{' or '.join('nn.' + t.__name__ for t in needs)}; pass ParallelismConfig(tp_plan={move}) "
            f"(None keeps `{name}` replicated){'' if len(inner) == 1 else ', or shard the module inside it'}")


def _key_of(plan: dict[str, str], name: str) -> str:
    """The plan key (pattern) that matched a concrete name: what an override must name."""
    return next((k for k in plan if _pattern_to_regex(k).match(name)), name)


def check_param_entries(model: nn.Module, plan: dict[str, str], tp_size: int) -> None:
    """Parameter entries (stacked expert weights, sinks) must be placeable, divisible, and owned by a module whose
    forward runs on local shards; such a module's own parameters must all be split (a whole one would be counted
    tp_size times by the experts' output sum). Checked before any collective."""
    modules = match_plan(model, plan)
    params = match_params(model, plan)
    for name, style in params.items():
        owner, _, own = name.rpartition(".")
        if style not in moe.PARAM_STYLES:
            raise ValueError(f"tp_plan entry '{_key_of(plan, name)}': {style!r} places modules, but it matched the "
                             f"parameter '{name}'; "
                             f"parameter styles: {list(moe.PARAM_STYLES)}")
        split = moe.shard_dim_size(style, own, model.get_parameter(name).shape)
        if split is None:
            continue
        if modules.get(owner) not in moe.LOCAL_FORWARD:
            raise NotImplementedError(
                f"tp_plan splits the parameter '{name}' ({style}) but its module '{owner}' has no "
                f"{' / '.join(moe.LOCAL_FORWARD)} entry, so its forward would mix shards with whole tensors; add "
                f"tp_plan={{'{_key_of(plan, owner) if owner in modules else owner}': 'local_params'}} (or "
                f"'moe_tp_experts' for experts), or keep it whole with tp_plan={{'{_key_of(plan, name)}': None}}")
        dim, packed = split
        size = model.get_parameter(name).shape[dim]
        if size % (tp_size * packed):
            ok = [d for d in range(1, size // packed + 1) if size % (d * packed) == 0]
            raise ValueError(f"tp_size={tp_size} does not split dim {dim} (size {size}"
                             f"{', two packed halves' if packed == 2 else ''}) of '{name}' ({style}) evenly; "
                             f"use tp_size in {ok}")
    for owner, style in modules.items():
        if style == "mla_kv_a_proj":
            _rope_dim(hf.text_config(model))
        if style != "moe_tp_experts":
            continue
        owned = list(model.get_submodule(owner).named_parameters(recurse=False))
        if not owned:
            raise NotImplementedError(
                f"tp_plan entry '{_key_of(plan, owner)}': 'moe_tp_experts' is for a module holding stacked expert weights "
                f"[num_experts, ...]; {type(model.get_submodule(owner)).__name__} owns none (its submodules' own "
                f"styles split them, and summing its output again would count it tp_size times); keep it whole with "
                f"tp_plan={{'{_key_of(plan, owner)}': None}}")
        for own, _ in owned:
            full = f"{owner}.{own}"
            if full not in params or moe.shard_dim_size(params[full], own, model.get_parameter(full).shape) is None:
                raise NotImplementedError(
                    f"'{owner}' is moe_tp_experts but its parameter '{full}' is whole on every rank: the experts' "
                    f"summed output would count it tp_size={tp_size} times; give it a splitting entry "
                    f"(tp_plan={{'{_key_of(plan, full)}': 'colwise' or 'packed_colwise'}}), or keep the experts "
                    f"whole with tp_plan={{'{_key_of(plan, owner)}': None}} and None for their weights' entries")


def check_adapters(model: nn.Module, overrides: dict[str, str | None] | None, tp_size: int = 1) -> None:
    """PEFT adapters on modules the plan shards must be splittable, and so must 4-bit base layers (checked before
    any collective)."""
    for name, style in expand_plan(model, match_plan(model, resolve_plan(model, overrides))).items():
        if is_quantized_linear(model.get_submodule(name)):
            check_quantized_tp(name, model.get_submodule(name), style, tp_size)


def check_divisibility(model: nn.Module, tp_size: int) -> None:
    """Refuse tp sizes that do not split the attention heads evenly (checked before any collective)."""
    cfg = hf.text_config(model)
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    for label, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if value is not None and value % tp_size != 0:
            divisors = [d for d in range(1, value + 1) if value % d == 0]
            raise ValueError(
                f"tp_size={tp_size} does not divide {label}={value} of {type(model).__name__}; "
                f"use tp_size in {divisors}"
            )


def plan_overrides(model: nn.Module, config) -> dict[str, str | None] | None:
    """The user's ``tp_plan`` overrides, plus, under expert parallelism, ``None`` for every entry that names an
    experts module or anything inside it.

    EP x TP as torchtitan's ``etp=1``: the experts are split over ep (borrowed from dp_shard) and *not* over tp;
    attention, dense MLPs and shared experts keep their TP entries, the router stays replicated. The experts'
    input is then the whole hidden state on every tp rank (the attention's rowwise output is all-reduced), so the
    tp ranks of one ep group compute the same experts on the same tokens: exact, at tp times the expert compute.
    An entry on a module *around* the experts (summing or splitting their output over tp) would then count the
    experts' output tp times or feed them a shard: refused here, before any collective.
    """
    overrides = config.tp_plan
    if config.ep_size == 1:
        return overrides
    found = experts_of.expert_modules(model)
    inside = [n for e in found for n in [e.name, *(f"{e.name}.{s}" for s, _ in e.module.named_modules() if s),
                                        *(f"{e.name}.{p}" for p, _ in e.module.named_parameters())]]
    roots = [e.name for e in found]
    plan = resolve_plan(model, overrides)
    merged = dict(overrides or {})
    for key, style in plan.items():
        regex = _pattern_to_regex(key)
        if any(regex.match(n) for n in inside):
            merged[key] = None
        around = next((r for r in roots if any(regex.match(a) for a in _ancestors(r))), None)
        if around is not None:
            raise NotImplementedError(
                f"tp_plan entry '{key}': {style!r} on a module around the experts '{around}' cannot be exact with "
                f"ep_size={config.ep_size}: the experts are split over ep and whole on every tp rank, so their "
                f"output would be split or summed over tp; drop it with tp_plan={{'{key}': None}}, or use ep_size=1 "
                "to split the experts over tp")
    return merged


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def check_model(model: nn.Module, config) -> None:
    """Everything TP needs from a model under ``config`` (tp_size > 1), checked before any collective."""
    check_divisibility(model, config.tp_size)
    overrides = plan_overrides(model, config)
    plan = resolve_plan(model, overrides)
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no tp_plan, so tp_size={config.tp_size} cannot shard it; pass "
            "ParallelismConfig(tp_plan={'model.layers.*.mlp.up_proj': 'colwise', ...}) or use tp_size=1")
    check_module_types(model, overrides)
    check_param_entries(model, plan, config.tp_size)
    moe.check_own_masks(model, match_plan(model, plan), config.tp_size)
    check_adapters(model, overrides, config.tp_size)
    if config.sequence_parallel is True:
        matched = expand_plan(model, _vocab_entries(model, plan, match_plan(model, plan), config.tp_size))
        reason = sp.reason_not_exact(model, matched)
        if reason is not None:
            raise NotImplementedError(f"sequence_parallel=True is not exact for {type(model).__name__}: {reason}; "
                                      "use sequence_parallel='auto' (off for this model) or False")


def _vocab_entries(model: nn.Module, plan: dict[str, str], matched: dict[str, str], tp_size: int) -> dict[str, str]:
    """Keep the vocab-sharded embedding / lm_head only where that is exact and consistent."""
    emb, head = hf.slot_name(model, "get_input_embeddings"), hf.slot_name(model, "get_output_embeddings")
    here = [n for n in (emb, head) if n in matched]
    if not here:
        return matched
    cfg = hf.text_config(model)
    # Tied-ness from the config, not object identity: a pipeline stage may hold only one of the pair.
    tied = hf.ties_embeddings(cfg)
    patterns = [_pattern_to_regex(k) for k in plan]
    in_plan = lambda name: name is not None and any(r.match(name) for r in patterns)  # noqa: E731
    reason = None
    if cfg.vocab_size % tp_size:
        reason = f"vocab size {cfg.vocab_size} is not divisible by tp_size={tp_size}"
    elif tied and not (in_plan(emb) and in_plan(head)):
        reason = "the embedding and lm_head share one weight but the plan shards only one of them"
    if reason:
        logger.info("keeping %s replicated: %s", " and ".join(here), reason)
        return {k: v for k, v in matched.items() if k not in here}
    return matched


def _styles(model: nn.Module, matched: dict[str, str], head_input: Placement | None) -> dict[str, ParallelStyle]:
    """The torch style of each matched module. This is the one place that decides the head's layouts: a plan entry
    that gathers a vocabulary-split head becomes ``vocab_parallel.VocabParallelHead`` (gathered logits as before,
    vocabulary-sharded ones inside the chunked loss), its input layout ``head_input`` (None = Replicate; sequence
    parallelism passes Shard(1)). A PEFT-wrapped head (its base layer and adapter entries) keeps the plan's style."""
    cfg = hf.text_config(model)
    head = hf.slot_name(model, "get_output_embeddings")
    return {name: head_style(head_input) if name == head and style in GATHERING_HEAD_STYLES else STYLES[style](cfg)
            for name, style in matched.items()}


def _sequence_plan(model: nn.Module, matched: dict[str, str], wanted: bool | str) -> sp.SequencePlan | None:
    """The sequence-parallel plan of this part where wanted and exact (an explicit True was checked up front)."""
    if not wanted:
        return None
    found = sp.sequence_plan(model, matched)
    if isinstance(found, str):
        logger.info("sequence parallelism off for %s: %s", type(model).__name__, found)
        return None
    return found


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, plan_overrides: dict[str, str | None] | None = None,
             sequence_parallel: bool | str = False, head_input: Placement | None = None) -> int:
    """Shard ``model`` in place over ``tp_mesh`` following its plan, with sequence parallelism between the TP
    regions where ``sequence_parallel`` asks and it is exact. Returns the number of modules sharded.
    ``head_input``: the layout of the hidden states reaching the head (``_styles``)."""
    tp_size = tp_mesh.size()
    check_divisibility(model, tp_size)
    plan = resolve_plan(model, plan_overrides)
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no tp_plan (config.base_model_tp_plan is empty), so tp_size={tp_size} "
            "cannot shard it; pass ParallelismConfig(tp_plan={...}) with entries such as "
            "{'model.layers.*.mlp.up_proj': 'colwise', 'model.layers.*.mlp.down_proj': 'rowwise'}, or use tp_size=1"
        )
    check_param_entries(model, plan, tp_size)
    matched = match_plan(model, plan)
    matched = {**moe.per_head_norms(model, matched), **matched}
    params = match_params(model, plan)
    if not matched:
        raise ValueError(
            f"no module of {type(model).__name__} matches its tp_plan {sorted(plan)}; check the override names"
        )
    matched = _vocab_entries(model, plan, matched, tp_size)
    # A plan names HF modules; where PEFT wrapped one, its base layer takes the style and the adapter follows it.
    matched = expand_plan(model, matched)
    seq_plan = _sequence_plan(model, matched, sequence_parallel)
    styles = _styles(model, matched, head_input)
    for name in seq_plan.rowwise if seq_plan else ():  # reduce-scatter onto the sequence instead of all-reduce
        styles[name] = RowwiseParallel(output_layouts=Shard(1))
    for name in seq_plan.colwise if seq_plan else ():  # input gradient left partial for the region's reduce-scatter
        styles[name] = sp.RegionColwiseParallel()
    emb, head = hf.embedding_and_head(model)
    tied = hf.shares_embedding(model)
    with KeepRequiresGrad(model):
        for name, style in params.items():  # stacked expert weights, sinks: placed here, used by their module's style
            owner, _, own = name.rpartition(".")
            moe.shard_param(model.get_submodule(owner), own, style, tp_mesh)
        # A 4-bit base cannot become a DTensor: its own style keeps packed bytes (tensor_parallel_quantized.py).
        quantized = {n: s for n, s in matched.items() if is_quantized_linear(model.get_submodule(n))}
        kept = {n: apply_quantized_tp(model.get_submodule(n), s, tp_mesh) for n, s in quantized.items()}
        parallelize_module(model, tp_mesh, {n: style for n, style in styles.items() if n not in quantized})
        if seq_plan is not None:
            sp.apply_sequence_parallel(model, tp_mesh, seq_plan)
    if quantized:
        logger.info("4-bit base layers under TP: %d sharded, %d replicated (blocks not aligned with the split)",
                    sum(v == "sharded" for v in kept.values()), sum(v == "replicated" for v in kept.values()))
    moe.clone_outputs_modified_in_place(model, matched)
    if tied:
        # Sharding gave the embedding and lm_head separate DTensor parameters; share one again (both are
        # Shard(0) over the vocabulary, or both replicated) so the summed gradient keeps them equal.
        head.weight = emb.weight
    logger.info("applied TP over %d ranks to %d modules and %d parameters", tp_size, len(matched), len(params))
    return len(matched)
