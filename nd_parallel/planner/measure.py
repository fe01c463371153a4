"""Measure what the memory model predicts: the peak of live tensor storages on this rank (allocator level, not RSS).

Used by the unit tests (a single-process known case) and benchmarks/bench_planner.py (every layout).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages on this rank: the ones alive at entry (`initial`) plus every storage an
    op returns, each counted once until it is freed (weakref) or resized (FSDP2 frees unsharded parameters with
    `storage.resize_(0)`). The allocator-level count MemTracker keeps, without its module hooks (which refuse a
    module called once per pipeline micro-batch)."""

    def __init__(self, initial, breakdown: bool = False):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        # breakdown: which op made each live storage ("initial", or "<op> fwd|bwd"), and the live set at the peak
        # (``at_peak``: label -> bytes): how the planner's terms were checked against a measured peak. Slow.
        self.breakdown = breakdown
        self.made_by: dict[int, str] = {}
        self.at_peak: dict[str, int] = {}
        self._op = "initial"
        for t in initial:
            self._track(t)

    def _track(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        if hasattr(t, "_local_tensor"):  # DTensor: this rank's piece
            t = t._local_tensor
        if t.is_meta or t.layout != torch.strided:
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self.live:
            return
        self.live[key] = st.nbytes()
        self.current += self.live[key]
        if self.breakdown:
            self.made_by[key] = self._op
        self._new_peak()
        weakref.finalize(st, self._free, key)

    def _new_peak(self) -> None:
        if self.current <= self.peak:
            return
        self.peak = self.current
        if self.breakdown:
            self.at_peak = {}
            for key, nbytes in self.live.items():
                label = self.made_by.get(key, "initial")
                self.at_peak[label] = self.at_peak.get(label, 0) + nbytes

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)
        self.made_by.pop(key, None)

    def __enter__(self):
        original = self._resize = torch.UntypedStorage.resize_
        mode = self

        def resize_(st, size):
            key = id(st)
            original(st, size)
            if key in mode.live:
                mode.current += st.nbytes() - mode.live[key]
                mode.live[key] = st.nbytes()
                mode._new_peak()
            elif size:
                mode._op = "resize_ (an FSDP all-gather output)"
                mode._track(torch.empty(0).set_(st))
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        phase = "bwd" if self.breakdown and torch._C._current_graph_task_id() != -1 else "fwd"
        for t in tree_flatten(out)[0]:
            if self.breakdown and isinstance(t, torch.Tensor):
                self._op = f"{func.__name__} {phase} {list(getattr(t, '_local_tensor', t).shape)} {t.dtype}"
            self._track(t)
        return out


def state_tensors(model, opt) -> list:
    """What is alive between steps: parameters, buffers, gradients, optimizer state."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def saved_tensor_bytes(run, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``run()`` runs, storages of the tensors in
    ``exclude`` (parameters, a given input) left out: what the planner's per-layer activation terms count."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(saved.values())
