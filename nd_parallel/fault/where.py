"""Where a rank's main thread stands: the collective it waits in and the mesh dimension, read from its stack.

Written for the hang report (watchdog.py). Rather than wrapping every collective (FSDP2, DTensor and the pipeline
schedules call torch.distributed themselves), the watchdog thread looks at the main thread's Python stack: the
innermost frame inside ``torch.distributed`` names the collective, and the first ``ProcessGroup`` / ``DeviceMesh``
/ group name found in the locals of that frame or its callers names the group, which ``group_names`` maps to our
mesh dimension ("dp_shard", "tp", ...). The innermost frame of ``nd_parallel`` (or the user's script) says who
called it. Nothing is recorded on the hot path, so a healthy run pays nothing for it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch.distributed as dist

_TORCH_DIST = os.path.join("torch", "distributed") + os.sep
_SKIP_FUNCS = {"wrapper", "_wrapper", "inner", "__call__", "_time_logger", "_exception_logger"}  # decorators
_GROUP_LOCALS = ("group", "pg", "process_group", "_group", "group_name", "mesh", "device_mesh")
_THIS_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = os.path.dirname(os.__file__) + os.sep


@dataclass(frozen=True)
class Position:
    """A snapshot of one thread. ``collective`` is empty when the thread is outside torch.distributed."""

    collective: str = ""
    dim: str = ""
    ranks: tuple[int, ...] = ()  # global ranks of the group it waits on (empty: unknown)
    caller: str = ""  # innermost frame of our code or the user's script: "grad_norm.py:52 total_norm"
    key: tuple = ()  # identity of the blocking frame: the same key on two snapshots = still in the same call

    def describe(self) -> str:
        if not self.collective:
            return f"outside any collective, in {self.caller or 'unknown code'}"
        over = f" over {self.dim}" if self.dim else ""
        return f"in {self.collective}{over} (called from {self.caller or 'unknown code'})"


def group_names(mesh) -> dict[str, str]:
    """Process-group name -> mesh dimension(s) for every dim and flattened view of a ParallelMesh.

    Several dims can share one group (the flattened "dp" over a mesh whose only dim > 1 is dp_shard): the mesh
    dimension's own name is kept (dims come before flattened views). Dims of size 1 never block anyone: left out.
    """
    from nd_parallel.distributed.mesh import DIM_NAMES, FLAT_VIEWS

    names: dict[str, str] = {}
    for dim in (*DIM_NAMES, *FLAT_VIEWS):
        sub = mesh[dim]
        if sub.size() == 1:
            continue
        names.setdefault(sub.get_group().group_name, dim)
    names.setdefault(dist.group.WORLD.group_name, "world")
    return names


def _group_of(frame, names: dict[str, str]) -> tuple[str, tuple[int, ...]] | None:
    for local in _GROUP_LOCALS:
        value = frame.f_locals.get(local)
        if value is None:
            continue
        try:
            if isinstance(value, dist.ProcessGroup):
                return names.get(value.group_name, value.group_name), tuple(dist.get_process_group_ranks(value))
            if isinstance(value, str) and value in names:  # functional collectives pass the group by name
                return names[value], ()
            if hasattr(value, "mesh_dim_names") and hasattr(value, "get_group") and value.ndim == 1:
                group = value.get_group()
                return names.get(group.group_name, value.mesh_dim_names[0]), tuple(dist.get_process_group_ranks(group))
        except Exception:  # a frame half-way through building a group: keep looking further out
            continue
    return None


def _short(frame) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}"


def position_of(thread_id: int, names: dict[str, str]) -> Position:
    """Where the thread ``thread_id`` stands now (from the watchdog thread; the main thread keeps running)."""
    frame = sys._current_frames().get(thread_id)
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    collective, key, group, caller = "", (), None, ""
    for f in stack:  # innermost first
        filename = f.f_code.co_filename
        in_torch_dist = _TORCH_DIST in filename
        if in_torch_dist and not collective and f.f_code.co_name not in _SKIP_FUNCS:
            collective, key = f.f_code.co_name, (id(f), f.f_lasti)
        if collective and group is None:
            group = _group_of(f, names)
        ours_or_users = not (in_torch_dist or "site-packages" in filename or filename.startswith(_STDLIB)
                             or filename.startswith("<") or filename.startswith(_THIS_PACKAGE + "fault" + os.sep))
        if ours_or_users and not caller:
            caller = _short(f)
        if collective and group is not None and caller:
            break
    if not collective:  # busy elsewhere: the key is the innermost frame, to tell a loop from progress
        key = (id(stack[0]), stack[0].f_lineno) if stack else ()
    dim, ranks = group if group is not None else ("", ())
    return Position(collective, dim, ranks, caller, key)
