"""Rank program for test_sp_comm.py: one training step of a tiny Llama under TP2, its collectives counted.

Usage (under torchrun, 2 ranks): sp_comm_worker.py OUT_DIR SPEC_JSON
SPEC_JSON: {"model": dir, "samples": {make_samples kwargs}}

Variants prepared from the same checkpoint and batch: ``sp`` (sequence parallelism), ``no_sp`` (plain TP),
``sp_mixed`` (each MLP's up_proj reads a copy of the gathered input: a use that is not a colwise linear's own, so
the MLP regions must fall back to all-reducing their input gradients) and ``sp_fallback`` (every colwise linear of
a region reads a copy: every region falls back, which is the backward SP had before the reduce-scatter; the
``* 1.0`` changes no number and no collective). For each, rank 0 saves
the collectives the forward and the backward ran (op name -> count and bytes sent into them, from a dispatch mode
that sees the functional collectives DTensor issues) and every parameter's full gradient.
"""

import json
import sys
from collections import Counter

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.distributed import sequence_parallel
from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import _collate

_COLLECTIVES = ("_c10d_functional", "c10d_functional", "c10d")


class Collectives(TorchDispatchMode):
    """Counts the collectives dispatched under it and the bytes of their input tensors, by op name."""

    def __init__(self):
        super().__init__()
        self.count, self.bytes = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in _COLLECTIVES and not func.__name__.startswith(("wait", "_wrap")):
            name = func.__name__.split(".")[0]
            self.count[name] += 1
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            self.bytes[name] += first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0
        return func(*args, **(kwargs or {}))


VARIANTS = {"sp": (True, ()), "no_sp": (False, ()), "sp_mixed": (True, ("mlp.up_proj",)),
            "sp_fallback": (True, ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))}


def _read_a_copy(model, suffixes) -> None:
    """The linears named ``*.<suffix>`` read ``x * 1.0`` instead of the gathered ``x`` itself: their input gradient
    then reaches the gather replicated (torch's colwise style all-reduces it)."""
    for name, module in model.named_modules():
        if suffixes and name.endswith(suffixes):
            module.register_forward_pre_hook(lambda mod, args: (args[0] * 1.0, *args[1:]), prepend=True)


def step(model_dir: str, samples, sp: bool, copies: tuple[str, ...]) -> dict:
    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator()
    plugin = NDParallelPlugin(ParallelismConfig(tp_size=2, sequence_parallel=sp, loss_chunk_size=0)).attach(accelerator)
    model = plugin.from_pretrained(model_dir)
    _read_a_copy(model, copies)
    model = accelerator.prepare(model)
    batch = {k: v.to(accelerator.device) for k, v in _collate(samples).items()}
    with Collectives() as fwd:
        out = model(**batch)
    with Collectives() as bwd:
        accelerator.backward(out.loss)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for n, p in model.named_parameters()}
    return {"applied": sequence_parallel.applied(model), "loss": out.loss.item(), "grads": grads,
            "forward": dict(fwd.count), "backward": dict(bwd.count), "forward_bytes": dict(fwd.bytes),
            "backward_bytes": dict(bwd.bytes), "tokens": int(batch["input_ids"].numel())}


def main(out_dir: str, spec_path: str) -> None:
    spec = json.load(open(spec_path))
    samples = make_samples(**spec["samples"])
    results = {name: step(spec["model"], samples, sp, copies) for name, (sp, copies) in VARIANTS.items()}
    if dist.get_rank() == 0:
        torch.save(results, f"{out_dir}/comm.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
