"""Start N local ranks of a Python script with torchrun; a wall-clock limit and SIGTERM/SIGINT end them all.

One machine uses torchrun's static rendezvous on a free local port. Several machines ("nodes": one launch per
node, each starting its local ranks) meet through torchrun's c10d rendezvous at ``rdzv_endpoint``, which the
node whose address it names hosts; with ``max_restarts`` a failed or replaced node is waited for and every node
starts its ranks again (``Nodes``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from .proctree import alive, descendants, kill_all


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _stop(proc: subprocess.Popen, grace: float = 25) -> None:
    """End torchrun, every rank and every dataloader worker, within ``grace`` seconds plus a moment.

    Torchrun's agent, sent SIGTERM, forwards it to its ranks (each leads its own session, so signalling torchrun's
    process group misses them) and waits for them; ranks with ``save_on_signal`` use that time for a preemption
    checkpoint. Whatever is left when torchrun is gone or ``grace`` runs out is SIGKILLed: every process seen in the
    tree since the signal, including dataloader workers whose rank already died (they are re-parented to init and
    no longer found from torchrun).
    """
    seen = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= descendants(proc.pid)
        time.sleep(0.2)
    seen |= descendants(proc.pid)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    left = {pid for pid in seen if alive(pid)}
    for pid in list(left):
        left |= descendants(pid)
    kill_all(left)
    proc.wait()


class _Terminated(SystemExit):
    """SIGTERM to the launching process: unwinds through launch(), which stops the ranks, then exits 128+15."""


@contextlib.contextmanager
def _sigterm_unwinds():
    """Make SIGTERM raise in the main thread, so the ranks are stopped instead of left running as orphans (the
    default action ends this process at once). Elsewhere (a thread) the caller's handling is left as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Nodes:
    """Where the ranks of a multi-node launch meet: ``nnodes`` launches, one per node, with the same endpoint and id.

    ``endpoint``: ``HOST:PORT`` of torchrun's c10d rendezvous, served by the node whose address is HOST (for
    example the first node of a SLURM allocation). ``run_id``: the same on every node of one job, different between
    jobs sharing an endpoint. ``conf``: torchrun's ``--rdzv-conf`` (e.g. ``keep_alive_interval=1`` notices a dead
    node sooner than the default 15 s)."""

    def __init__(self, nnodes: int, endpoint: str, run_id: str = "nd_parallel", conf: str | None = None):
        if nnodes < 2:
            raise ValueError(f"nnodes={nnodes}: a multi-node launch has at least 2 nodes; leave it out for one")
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"rdzv_endpoint={endpoint!r}: write HOST:PORT, e.g. node001:29400 (the address of the "
                             "node that serves the rendezvous, the same on every node)")
        self.nnodes, self.endpoint, self.run_id, self.conf = nnodes, endpoint, run_id, conf

    def torchrun_args(self) -> list[str]:
        args = [f"--nnodes={self.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}",
                f"--rdzv-id={self.run_id}"]
        return args + ([f"--rdzv-conf={self.conf}"] if self.conf else [])

    # torch 2.13's c10d rendezvous hands every attempt the same shared TCPStore, with no per-attempt key prefix, and a
    # replacement node's agent counts its attempts from 0 while the survivors count on: the ranks of a restarted
    # attempt would read the dead attempt's addresses and could not even agree on a prefix. Opting out of the shared
    # store gives every attempt a fresh store served by its rank 0 (torch's RendezvousStoreInfo.build).
    ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def launch(script: str, nprocs: int, args: list[str] = (), *, timeout: float = 600, env: dict | None = None,
           capture: bool = False, stop_grace: float = 25, max_restarts: int = 0,
           nodes: Nodes | None = None) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nprocs`` local ranks (gloo on CPU: one thread per rank); raise on failure or timeout.

    ``script``: a file path, or a dotted module name (run as ``python -m``, so its package is imported as a package
    and its folder does not shadow top-level modules).

    SIGTERM or SIGINT (Ctrl-C) to this process, or the timeout, stops every rank and dataloader worker within
    ``stop_grace`` seconds (``_stop``) before the exception propagates. ``max_restarts``: torchrun's elastic agent
    starts every rank again after one fails, up to that many times (the ranks then resume from a checkpoint).
    ``nodes``: this is one of several nodes (``Nodes``); ``nprocs`` is then this node's share of the ranks."""
    where = nodes.torchrun_args() if nodes else ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    as_module = ["--module"] if not script.endswith(".py") and "/" not in script else []
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
           f"--max-restarts={max_restarts}", *where, *as_module, script, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    full_env.update(nodes.ENV if nodes else {})
    if not _has_cuda():
        full_env["ACCELERATE_USE_CPU"] = "true"  # Accelerator() on a CPU-only machine then uses gloo ranks
    full_env.update(env or {})
    kwargs = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) if capture else {}
    with _sigterm_unwinds():
        proc = subprocess.Popen(cmd, env=full_env, start_new_session=True, **kwargs)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc, stop_grace)
            out, _ = proc.communicate()
            raise TimeoutError(f"{nprocs} ranks of {script} did not finish within {timeout:.0f}s\n{out or ''}")
        except BaseException:  # Ctrl-C or SIGTERM: the ranks run in their own session, so those signals miss them
            _stop(proc, stop_grace)
            raise
    if proc.returncode != 0:
        raise RuntimeError(f"{nprocs} ranks of {script} failed with exit code {proc.returncode}\n{out or ''}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)

