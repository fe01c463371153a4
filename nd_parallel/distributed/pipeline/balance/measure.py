"""What every unit of a model costs on this rank: forward+backward time and memory (no process group).

Separate from the collectives that combine measurements over ranks, so that it runs (and is tested) in a
single process, and separate from the partition math, which needs only numbers. The units are the
embedding (every ``pre`` module), one per decoder layer, and the head (every ``post`` module plus the loss).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from nd_parallel.models.hf import ModelParts, model_parts, text_config

DEFAULT_PROFILE_SEQ = 512


@dataclass(frozen=True)
class UnitCost:
    """What one unit costs on this rank for the profiled sample."""

    name: str  # "embed", "layer.3", "head"
    seconds: float  # median forward+backward time
    param_bytes: int
    activation_bytes: int  # tensors saved for backward (parameters excluded)


def _sync(device: torch.device) -> None:
    if device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, dict) else out
    return next(v for v in values if isinstance(v, torch.Tensor))


def _detach(value, needs_grad: bool):
    if isinstance(value, torch.Tensor):
        value = value.detach().clone()
        return value.requires_grad_(needs_grad and value.is_floating_point())
    if isinstance(value, tuple):
        return tuple(_detach(v, False) for v in value)
    return value


def _capture_inputs(model: nn.Module, fqns: list[str], batch: dict) -> tuple[dict, torch.Tensor]:
    """One no-grad forward of ``model``: the (args, kwargs) each module in ``fqns`` was called with, and the logits."""
    inputs: dict[str, tuple[tuple, dict]] = {}

    def hook(name):  # a module called twice keeps its first call
        return lambda module, args, kwargs: inputs.setdefault(name, (args, kwargs)) and None

    handles = [model.get_submodule(f).register_forward_pre_hook(hook(f), with_kwargs=True) for f in fqns]
    try:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                           use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return inputs, logits


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses (DTensor) without a plain storage
        return None


def _saved_bytes(run, param_ptrs: set[int]) -> int:
    """Bytes of the tensors autograd saves for backward while ``run`` executes, parameters left out."""
    seen = set(param_ptrs)
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        storage = _storage(t)
        if storage is not None and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total


def time_rounds(fns: list, device: torch.device, repeats: int, warmup: int) -> list[float]:
    """Median time of each function, measured in rounds (every function once per round).

    Interleaving spreads a slow spell of the machine (another process, a frequency change) over every
    function alike instead of charging it to whichever one was being measured; the ratios are what matter.
    """
    times: list[list[float]] = [[] for _ in fns]
    for k in range(warmup + repeats):
        for fn, row in zip(fns, times):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if k >= warmup:
                row.append(time.perf_counter() - t0)
    return [statistics.median(row) for row in times]


def _module_runner(module: nn.Module, args: tuple, kwargs: dict, param_ptrs: set[int]):
    """fwd+bwd of ``module`` on fresh copies of its captured inputs; returns (run, measure_activation)."""
    args0, kwargs0 = args, kwargs

    def forward():
        # The activation flowing between units is the first positional input (or hidden_states).
        a = tuple(_detach(v, i == 0) for i, v in enumerate(args0))
        k = {n: _detach(v, n == "hidden_states" and not args0) for n, v in kwargs0.items()}
        return _first_tensor(module(*a, **k))

    def run():
        out = forward()
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        return out.detach()

    return run, lambda: _saved_bytes(forward, param_ptrs)


def _loss_runner(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor):
    vocab = text_config(model).vocab_size

    def run():
        x = logits.detach().requires_grad_(True)
        model.loss_function(x, labels, vocab).backward()

    return run


def unit_modules(model: nn.Module, parts: ModelParts) -> list[tuple[str, list[str]]]:
    """Units in execution order: ("embed", pre modules), ("layer.i", [layer i]), ("head", post modules)."""
    layers = [(f"layer.{i}", [f"{parts.layers_fqn}.{i}"]) for i in range(parts.num_layers)]
    return [("embed", list(parts.pre)), *layers, ("head", list(parts.post))]


def _unit_runners(model: nn.Module, units: list, inputs: dict, logits: torch.Tensor, labels: torch.Tensor,
                  param_ptrs: set[int]) -> tuple[list, list[int], list[tuple[str, int, int]]]:
    """One fwd+bwd runner per module (+ the loss, for the head), the index of the unit each one belongs to,
    and per unit (name, parameter bytes, activation bytes)."""
    runs, owner, results = [], [], []
    for index, (name, names) in enumerate(units):
        act, pbytes, seen = 0, 0, set()
        for fqn in names:
            module = model.get_submodule(fqn)
            run, activation = _module_runner(module, *inputs[fqn], param_ptrs)
            runs.append(run)
            owner.append(index)
            act += activation()
            for p in module.parameters():
                if id(p) not in seen:  # a parameter two modules of one unit share counts once
                    seen.add(id(p))
                    pbytes += p.numel() * p.element_size()
        if name == "head":
            runs.append(_loss_runner(model, logits, labels))
            owner.append(index)
        results.append((name, pbytes, act))
    return runs, owner, results


def profile_layers(model: nn.Module, sample_batch: dict, *, parts: ModelParts | None = None, repeats: int = 5,
                   warmup: int = 1) -> list[UnitCost]:
    """Forward+backward time (median of ``repeats``) and memory of every unit of ``model`` on this rank.

    One forward captures the input of every module; each module then runs alone on a fresh copy of its
    input, forward and backward (weight gradients included), and the head unit adds the model's own loss.
    Gradients the model held before are put back, so profiling leaves no trace on training.
    """
    parts = parts or model_parts(model)
    units = unit_modules(model, parts)
    device = next(model.parameters()).device
    if device.type == "meta":
        raise ValueError("pp_balance='profile' measures the model, but its weights are on the meta device; "
                         "materialize them first, or pass pp_balance as a list of layers per stage")
    batch = {k: v.to(device) for k, v in sample_batch.items()}
    inputs, logits = _capture_inputs(model, [f for _, names in units for f in names], batch)
    params = {id(p): p for p in model.parameters()}
    saved_grads = {k: p.grad for k, p in params.items()}
    param_ptrs = {st.data_ptr() for st in map(_storage, params.values()) if st is not None}
    try:
        runs, owner, results = _unit_runners(model, units, inputs, logits, batch["labels"], param_ptrs)
        seconds = [0.0] * len(units)
        for index, t in zip(owner, time_rounds(runs, device, repeats, warmup)):
            seconds[index] += t
    finally:
        for k, p in params.items():
            p.grad = saved_grads[k]
    return [UnitCost(name, t, pbytes, act) for (name, pbytes, act), t in zip(results, seconds)]


def sample_batch(model: nn.Module, shape: tuple[int, int] | None = None, seed: int = 0) -> dict:
    """Deterministic random tokens (identical on every rank) of ``shape`` = (batch, sequence)."""
    cfg = text_config(model)
    if shape is None:
        shape = (1, min(getattr(cfg, "max_position_embeddings", DEFAULT_PROFILE_SEQ), DEFAULT_PROFILE_SEQ))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, cfg.vocab_size, tuple(shape), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}
