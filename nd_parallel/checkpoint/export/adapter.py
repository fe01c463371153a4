"""``accelerator.save_model`` on a PEFT model: the adapter alone, or the base model with the adapter merged in.

- Adapter: what ``PeftModel.save_pretrained`` writes for the active adapter, ``adapter_model.safetensors`` (keys
  as PEFT names them: ``base_model.model.<HF name>.lora_A.weight``, adapter name dropped) and
  ``adapter_config.json``, so ``PeftModel.from_pretrained(base, dir)`` loads it in one process. Which tensors
  belong to the adapter, and under which key, is asked of PEFT's own ``get_peft_model_state_dict`` (on
  placeholders: the decision depends on names only), so bias / modules_to_save rules stay PEFT's.
- Merged: ``W + scaling * B @ A`` for every LoRA-wrapped Linear, under the HF names (``.base_layer`` dropped,
  no ``lora_*``), written one tensor at a time like ``save_model`` of a full model: ``from_pretrained`` loads it.

Every rank takes part (tensors are gathered from their shards one at a time); the main process writes.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from nd_parallel.models.peft import PEFT_PREFIX, peft_wrapper

from ..names import MODEL, hf_modules, named_state
from ..train_state import TrainState
from .gather import entries, gather_one_by_one
from .writer import Entry, ShardedWriter, natural_key, shard_size, write_model_config

logger = logging.getLogger("nd_parallel")

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _local_and_order(state: TrainState, model):
    local = {k[len(MODEL) + 1:]: v for k, v in named_state(model).flat.items()}
    order, holders = entries(local, state.distributed)  # a collective: every rank learns every name
    return local, order, holders


def _adapter_keys(wrapper, names: list[str], adapter: str) -> dict[str, str]:
    """HF name -> key in adapter_model.safetensors, for the tensors PEFT saves of ``adapter``."""
    from peft import get_peft_model_state_dict

    placeholders = {PEFT_PREFIX + n: torch.empty(0) for n in names}
    source = {id(t): n for n, t in zip(names, placeholders.values())}
    kept = get_peft_model_state_dict(wrapper, state_dict=placeholders, adapter_name=adapter,
                                     save_embedding_layers=False)
    return {source[id(t)]: key for key, t in kept.items() if id(t) in source}


def save_adapter(state: TrainState, model, out_dir: Path) -> Path:
    from safetensors.torch import save_file

    wrapper = peft_wrapper(model)
    adapter = wrapper.active_adapter
    local, order, holders = _local_and_order(state, model)
    keys = _adapter_keys(wrapper, [e.name for e in order], adapter)
    wanted = [e for e in order if e.name in keys]
    if not wanted:
        raise ValueError(f"adapter '{adapter}' has no tensor in {type(wrapper).__name__}; nothing to save")
    tensors = {}
    for name, tensor in gather_one_by_one(state, local, wanted, holders):
        tensors[keys[name]] = tensor.detach().cpu().contiguous()
    if state.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = copy.deepcopy(wrapper.peft_config[adapter])
        config.inference_mode = True  # as PeftModel.save_pretrained writes it
        if config.base_model_name_or_path is None:
            config.base_model_name_or_path = getattr(hf_modules(model)[1].config, "name_or_path", None)
        config.save_pretrained(str(out_dir))
        logger.info("saved adapter '%s' to %s (%d tensors)", adapter, out_dir, len(tensors))
    state.barrier()
    return out_dir


def _merge_jobs(wrapper, order: list[Entry]) -> list[tuple[Entry, list[str], object]]:
    """(output entry, input names, LoRA layer or None) in output order; refuses what a merge cannot express."""
    from peft.tuners.lora import LoraLayer

    modules = dict(wrapper.get_base_model().named_modules())
    by_name = {e.name: e for e in order}
    jobs = []
    for e in order:
        if ".lora_" in e.name:
            continue
        if ".modules_to_save." in e.name or ".original_module." in e.name:
            raise NotImplementedError(f"'{e.name}' belongs to modules_to_save, which the merged export does not "
                                      "handle; save the adapter (merge_adapter=False) and merge it with PEFT")
        if ".base_layer." not in e.name:
            jobs.append((e, [e.name], None))
            continue
        module_name, leaf = e.name.rsplit(".base_layer.", 1)
        layer = modules.get(module_name)
        if not isinstance(layer, LoraLayer) or getattr(layer, "lora_variant", None) or any(
                getattr(layer, "use_dora", {}).values()) or any(getattr(layer, "lora_bias", {}).values()):
            raise NotImplementedError(f"'{module_name}' is not a plain LoRA Linear (DoRA, lora_bias or another "
                                      "variant): the merged export covers plain LoRA; save the adapter instead")
        inputs = [e.name]
        if leaf == "weight":
            for adapter in layer.active_adapters:  # an embedding's LoRA factors are parameters (no ".weight")
                a, b = ((f"lora_embedding_A.{adapter}", f"lora_embedding_B.{adapter}") if adapter in
                        layer.lora_embedding_A else (f"lora_A.{adapter}.weight", f"lora_B.{adapter}.weight"))
                inputs += [by_name[f"{module_name}.{a}"].name, by_name[f"{module_name}.{b}"].name]
        jobs.append((Entry(f"{module_name}.{leaf}", e.shape, e.dtype), inputs, layer))
    return sorted(jobs, key=lambda job: natural_key(job[0].name))


def save_merged(state: TrainState, model, out_dir: Path, max_shard_size) -> Path:
    """The base model with the active adapters folded in, as HF safetensors; one output tensor at a time."""
    wrapper = peft_wrapper(model)
    main = state.is_main_process
    local, order, holders = _local_and_order(state, model)
    jobs = _merge_jobs(wrapper, order)
    by_name = {e.name: e for e in order}
    writer = None
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        writer = ShardedWriter(out_dir, [job[0] for job in jobs], shard_size(max_shard_size))
    for out, inputs, layer in jobs:
        got = dict(gather_one_by_one(state, local, [by_name[n] for n in inputs], holders))
        if not main:
            continue
        value = got[inputs[0]]
        if len(inputs) > 1:  # W + scaling * B @ A per active adapter, as LoRA's get_delta_weight
            delta = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
            for adapter, a_name, b_name in zip(layer.active_adapters, inputs[1::2], inputs[2::2]):
                step = (got[b_name].float() @ got[a_name].float()) * layer.scaling[adapter]
                # an embedding's B @ A is [dim, vocab] (peft's Embedding.get_delta_weight transposes it)
                transpose = adapter in layer.lora_embedding_A or getattr(layer, "fan_in_fan_out", False)
                delta += step.T if transpose else step
            value = (value.float() + delta).to(value.dtype)
        writer.write(out.name, value)
    if main:
        files = writer.close()
        write_model_config(hf_modules(model)[1], out_dir)
        logger.info("saved the merged model to %s (%d tensors in %d files)", out_dir, len(jobs), len(files))
    state.barrier()
    return out_dir
