"""HF-named, layout-independent state dicts of a prepared model and its optimizer.

A checkpoint stores every tensor under its Hugging Face name, whatever the layout, so it loads under any
other layout. Two things need care beyond torch's ``get_/set_model_state_dict`` and
``get_/set_optimizer_state_dict``:

- Under PP the prepared model is a ``PipelineModel`` whose ``stages`` are skeleton copies of the HF model.
  One stage per rank: the stage itself is the HF-named module. Several (interleaved / V schedules): a view
  module merges their trees so that the names stay HF names (no ``stages.0.`` prefix).
- A tied weight (``lm_head.weight`` = ``model.embed_tokens.weight``) is one parameter in one process but two
  separate, equal copies when embedding and head sit on different stages. The checkpoint holds it once, under
  the source name (what ``save_pretrained`` writes too); loading fills every copy from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from nd_parallel.models.hf import ties_embeddings

MODEL = "model"  # key prefixes inside the DCP checkpoint
OPTIM = "optim"
_OPTIM_SECTIONS = ("state", "param_groups")


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(
        n not in m._non_persistent_buffers_set for m in module.modules() for n, _ in m.named_buffers(recurse=False))


def _merge(modules: list[nn.Module]) -> nn.Module:
    """One module tree with the union of the state-holding parts of ``modules`` (skeletons of one HF model)."""
    holders = [m for m in modules if _holds_state(m)]
    if len(holders) <= 1:
        return holders[0] if holders else modules[0]
    view = nn.Module()
    for m in holders:
        for name, p in m.named_parameters(recurse=False):
            view.register_parameter(name, p)
        for name, b in m.named_buffers(recurse=False):
            view.register_buffer(name, b, persistent=name not in m._non_persistent_buffers_set)
    names = list(dict.fromkeys(n for m in holders for n, c in m._modules.items() if c is not None))
    for name in names:
        view.add_module(name, _merge([m._modules[name] for m in holders if m._modules.get(name) is not None]))
    return view


def hf_modules(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(HF-named module for state dicts, an HF model object for config / tied keys) of a prepared model."""
    from nd_parallel.models.peft import base_of

    model = base_of(model)  # a PeftModel is stored under the names of the HF model inside it (LoRA included)
    stages = getattr(model, "stages", None)
    if stages is None:
        return model, model
    if type(model).__name__ == "DeepSpeedPipelineModel":
        raise NotImplementedError(
            "save_state / load_state / save_model under pp_backend='deepspeed' are not supported: DeepSpeed's "
            "engine owns those weights; use pp_backend='torch' (the default) for resharding checkpoints"
        )
    stages = list(stages)
    return (stages[0] if len(stages) == 1 else _merge(stages)), stages[0]


def tied_keys(hf_model: nn.Module) -> dict[str, str]:
    """target -> source names of weights the HF model ties (empty when the config unties them)."""
    keys = getattr(hf_model, "all_tied_weights_keys", None)
    if keys is not None:
        return dict(keys)
    # transformers < 5: only the usual embedding / head pair
    if getattr(hf_model, "config", None) is None or not ties_embeddings(hf_model):
        return {}
    return {"lm_head.weight": "model.embed_tokens.weight"}


def _optim_options(full: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Flattened keys (state.<name>.exp_avg, param_groups.<name>.lr) do not depend on how parameters are grouped
    # on a rank, which differs between pipeline stages.
    return StateDictOptions(flatten_optimizer_state_dict=True, full_state_dict=full, cpu_offload=full)


def _rename_optim(state: dict, old: str, new: str) -> dict:
    out = {}
    for key, value in state.items():
        for section in _OPTIM_SECTIONS:
            prefix = f"{section}.{old}."
            if key.startswith(prefix):
                key = f"{section}.{new}.{key[len(prefix):]}"
                break
        out[key] = value
    return out


def _pack_groups(state: dict) -> dict:
    """``param_groups.<name>.<k>`` (a dozen tiny values per parameter) -> ``param_groups.<name>`` = [[k, v], ...]:
    one stored item per parameter instead of one per hyper-parameter; still keyed by name, so layout-free."""
    out, packed = {}, {}
    for key, value in state.items():
        if key.startswith("param_groups.") and not isinstance(value, torch.Tensor):
            name, _, k = key[len("param_groups."):].rpartition(".")
            packed.setdefault(name, []).append([k, value])
        else:
            out[key] = value
    out.update({f"param_groups.{name}": pairs for name, pairs in packed.items()})
    return out


def _unpack_groups(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if key.startswith("param_groups.") and isinstance(value, list):
            out.update({f"{key}.{k}": v for k, v in value})
        else:
            out[key] = value
    return out


def _drop_optim(state: dict, name: str) -> dict:
    prefixes = tuple(f"{s}.{name}." for s in _OPTIM_SECTIONS)
    return {k: v for k, v in state.items() if not k.startswith(prefixes)}


@dataclass
class NamedState:
    """The canonical (tied weights once) state of one model + optimizer on this rank, ready for DCP.

    ``flat`` maps DCP keys (``model.<name>``, ``optim.state.<name>.exp_avg``, ...) to this rank's tensors;
    ``restore()`` puts what DCP loaded into ``flat`` back into the model and the optimizer.
    """

    view: nn.Module
    optimizer: torch.optim.Optimizer | None
    flat: dict = field(default_factory=dict)
    # (section, target key, source key, target's own tensor or None): a tied target whose source is also on
    # this rank; None = the very same tensor (one process), else a separate copy filled from the source.
    aliases: list = field(default_factory=list)
    renamed: list = field(default_factory=list)  # (target, source): the only copy here, read as the source

    def restore(self) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        model_sd = {k[len(MODEL) + 1:]: v for k, v in self.flat.items() if k.startswith(MODEL + ".")}
        optim_sd = _unpack_groups({k[len(OPTIM) + 1:]: v for k, v in self.flat.items() if k.startswith(OPTIM + ".")})
        for target, source in self.renamed:
            model_sd[target] = model_sd.pop(source)
            optim_sd = _rename_optim(optim_sd, source, target)
        with torch.no_grad():
            for section, target, source, own in self.aliases:
                sd = model_sd if section == MODEL else optim_sd
                value = sd[source]
                if isinstance(own, torch.Tensor):
                    own.copy_(value)
                    value = own
                sd[target] = value
        set_model_state_dict(self.view, model_sd)
        if self.optimizer is None:
            return
        # A parameter group without parameters (the Trainer's no-decay group when only LoRA matrices train) has no
        # name to key its hyper-parameters by in the flattened form, and torch's unflattening indexes its first
        # parameter. It steps nothing, so it is set aside during the load and put back at its place.
        optimizers = self.optimizer if isinstance(self.optimizer, (tuple, list)) else (self.optimizer,)
        empty = [[(i, g) for i, g in enumerate(o.param_groups) if not g["params"]] for o in optimizers]
        for o in optimizers:
            o.param_groups = [g for g in o.param_groups if g["params"]]
        try:
            set_optimizer_state_dict(self.view, self.optimizer, optim_sd, options=_optim_options())
        finally:
            for o, groups in zip(optimizers, empty):
                for i, group in groups:
                    o.param_groups.insert(i, group)


def _unwrap_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer -> torch optimizer


def named_state(model: nn.Module, optimizer=None, *, for_load: bool = False) -> NamedState:
    """This rank's canonical HF-named state (sharded tensors: DTensors where the layout shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    view, hf = hf_modules(model)
    optimizer = _unwrap_optimizer(optimizer) if optimizer is not None else None
    model_sd = dict(get_model_state_dict(view))
    optim_sd = dict(get_optimizer_state_dict(view, optimizer, options=_optim_options())) if optimizer else {}
    named = NamedState(view, optimizer)
    for target, source in tied_keys(hf).items():
        if target not in model_sd:
            continue
        if source not in model_sd and for_load:  # the only copy here (last pipeline stage): read the source's entry
            named.renamed.append((target, source))
            model_sd[source] = model_sd.pop(target)
            optim_sd = _rename_optim(optim_sd, target, source)
            continue
        # Saving: the rank holding the source writes it. Loading with both here: fill the target from the source.
        own = model_sd.pop(target)
        if for_load:
            named.aliases.append((MODEL, target, source, None if own is model_sd[source] else own))
            for key, value in optim_sd.items():
                for section in _OPTIM_SECTIONS:
                    if key.startswith(f"{section}.{target}."):
                        rest = key[len(section) + len(target) + 2:]
                        named.aliases.append((OPTIM, key, f"{section}.{source}.{rest}", value))
        optim_sd = _drop_optim(optim_sd, target)
    named.flat = {f"{MODEL}.{k}": v for k, v in model_sd.items()}
    named.flat.update({f"{OPTIM}.{k}": v for k, v in _pack_groups(optim_sd).items()})
    return named


def global_shape(value) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None
