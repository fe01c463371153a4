"""A process and all its descendants, found with psutil when installed, else from /proc (Linux).

The launcher (fault/launch.py) uses it to end every rank and dataloader worker, and the shutdown test to prove none is
left. A descendant whose parent died is re-parented to init and is no longer found from the root: callers keep the
pids they saw earlier (``known``) and check those too.
"""

from __future__ import annotations

import os
import signal


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) state ppid"
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(root: int) -> set[int]:
    """Every live descendant of ``root`` (not ``root`` itself)."""
    try:
        import psutil

        try:
            return {p.pid for p in psutil.Process(root).children(recursive=True)}
        except psutil.NoSuchProcess:
            return set()
    except ImportError:
        children, found, todo = _children_map(), set(), [root]
        while todo:
            for child in children.get(todo.pop(), []):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        return found


def alive(pid: int) -> bool:
    """Running or stopped; a zombie (exited, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except OSError:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    return stat[stat.rindex(")") + 2] not in "ZX"


def kill_all(pids, sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``). A rank calls it first thing,
    so that killing torchrun's agent, as a failing node or an OOM killer does, never leaves its ranks training as
    orphans; the agent's survivors on other nodes then see a node failure. A no-op elsewhere."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no libc symbol: keep the default (orphans are still ended by launch())
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
