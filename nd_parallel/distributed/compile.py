"""torch.compile per decoder layer (``ParallelismConfig(compile=True)``), torchtitan's regional compilation.

Where in the order (parallelize.py, step 7): after TP, so the compiled code sees the DTensor weights and TP's
collectives (DTensor and functional collectives trace under dynamo); before activation checkpointing, so
checkpointing wraps the compiled forward and recomputation re-runs the compiled kernels (full checkpointing only:
``config/compile.py`` refuses selective); before FSDP, whose all-gather hooks run in ``__call__`` and so stay
outside the compiled region. Under PP every stage compiles the layers it owns.

Only the layer's ``forward`` is replaced, on the instance (as activation checkpointing does): the module keeps its
class and its name, so parameter names stay the HF names (``torch.compile(module)`` would wrap it in an
``OptimizedModule`` and prefix every name with ``_orig_mod.``).

Tensor parallelism: a TP collective run eagerly before the layer (the vocab-parallel embedding's all-reduce, the
previous stage's or an eager layer's row-parallel output) hands the layer an ``AsyncCollectiveTensor``: the
``to_local()`` of a DTensor whose redistribution is still in flight. torch 2.13 does not support that subclass as
a compiled graph's input (torch PR #118671: "support for AsyncCollectiveTensors as graph boundaries is not great
today"): the gradient the compiled backward returns for it reaches DTensor's ``Redistribute.backward`` as a plain
tensor, so a TP2 run dies there (``'Tensor' object has no attribute '_local_tensor'``) and FSDP2 x TP2 trains on
wrong gradients (norms ~20% off one process, no error). ``CompiledForward`` therefore waits for such inputs before
the region (``_Waited``: the value, with the gradient passed through unchanged); the wait is one the first op
would have done anyway, so nothing overlaps less than in eager.

Known limit (torch 2.13, transformers 5.24): with ``config.use_cache=True`` (most checkpoints' default) a training
forward hands every layer the KV cache, whose per-layer state is guarded, so dynamo recompiles the layer code once
per layer and, past ``torch._dynamo.config.recompile_limit`` (8), runs the remaining layers eagerly, with a warning
and the same numbers. Set ``model.config.use_cache = False`` for training with compile (benchmarks/gpu_one.py does).

Context parallelism: our ring / Ulysses kernels exchange blocks with point-to-point sends, which dynamo does not
trace; they are kept out of the region (``keep_out``), so a layer compiles into the parts before and after its
attention.
"""

from __future__ import annotations

import functools
import logging
import shutil

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._pytree import tree_map_only

from nd_parallel.models.hf import decoder_layers

logger = logging.getLogger(__name__)


def keep_out(fn):
    """``fn`` runs eagerly even when called from a compiled region (a graph break around it)."""
    return torch._dynamo.disable(fn, recursive=True)


def check_backend(backend: str, device_type: str) -> None:
    """Before any collective: the backend exists, and inductor on CPU has a C++ compiler to build its kernels."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"compile_backend={backend!r} is not a torch.compile backend; use one of {sorted(known)}")
    if backend == "inductor" and device_type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise ValueError("compile=True with compile_backend='inductor' on CPU needs a C++ compiler (g++ or clang++) "
                         "for inductor's kernels; install one, or use compile_backend='aot_eager' or compile=False")


class _Waited(torch.autograd.Function):
    """An ``AsyncCollectiveTensor``'s value as a plain tensor (waits for its collective); the gradient passes
    through. Written as a Function because ``AsyncCollectiveTensor.wait()`` returns a tensor outside autograd, and
    any aten op on it (``clone``) would copy the activation."""

    @staticmethod
    def forward(ctx, x):
        return x.trigger_wait()

    @staticmethod
    def backward(ctx, grad):
        return grad


def waited(tree):
    """``tree`` (args or kwargs) with every in-flight TP collective's output waited for (module docstring: TP)."""
    return tree_map_only(AsyncCollectiveTensor, _Waited.apply, tree)


class CompiledForward:
    """Stands in for a layer's ``forward``: the compiled original (``__wrapped__``, set by update_wrapper), fed
    plain tensors where TP hands it an ``AsyncCollectiveTensor``."""

    def __init__(self, forward, backend: str):
        self.compiled = torch.compile(forward, backend=backend)
        functools.update_wrapper(self, forward)

    def __call__(self, *args, **kwargs):
        return self.compiled(*waited(args), **waited(kwargs))


def apply_compile(part: nn.Module, backend: str) -> int:
    """Compile every decoder layer ``part`` owns, in place; returns how many."""
    layers = [layer for layer in decoder_layers(part) if not isinstance(layer.forward, CompiledForward)]
    for layer in layers:
        layer.forward = CompiledForward(layer.forward, backend)
    if layers:
        logger.info("compiled %d decoder layers with torch.compile (backend %s; the first steps compile)",
                    len(layers), backend)
    return len(layers)
