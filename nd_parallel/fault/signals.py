"""``save_on_signal``: turn SIGTERM / SIGINT (SLURM, Kubernetes and ``timeout`` send SIGTERM before they kill) into a
request the training loop honours after the current optimizer step, so it can write a preemption checkpoint.

The handler only sets a flag: saving from inside a signal handler would run collectives at an arbitrary point of
the step. Ranks get the signal at slightly different moments (one may be a step ahead), so the flag is agreed on by
one all_reduce(MAX) after each optimizer step: every rank then stops after the same step. The loop asks
``plugin.preemption_requested()`` after ``optimizer.step()``; the Trainer callback does it in ``on_step_end``.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch
import torch.distributed as dist

logger = logging.getLogger("nd_parallel")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionFlag:
    """Installed in the main thread of every rank when save_on_signal is on."""

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def install(self) -> "PreemptionFlag":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("save_on_signal installs signal handlers, which Python allows from the main thread "
                               "only; create the Accelerator and call plugin.attach in the main thread")
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # a second signal: the user insists, stop now the way it would have
            self.uninstall()
            signal.raise_signal(signum)
            return
        self.received = signum
        logger.warning("received %s: a checkpoint will be written after the current optimizer step "
                       "(save_on_signal); send it again to stop at once", signal.Signals(signum).name)

    def agreed(self, device: torch.device, distributed: bool) -> bool:
        """True on every rank when any rank got a signal (one all_reduce of one number per call)."""
        flag = torch.tensor([1 if self.received is not None else 0], device=device)
        if distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class _ShieldedInit:
    """worker_init_fn of a dataloader worker under save_on_signal: ignore SIGTERM/SIGINT, then the user's init.

    Torchrun signals each rank's whole process group, which holds its dataloader workers, and torch's worker handler
    dies on a SIGTERM not sent by its rank: the rank would lose its data in the middle of the step it must finish
    before the preemption checkpoint. The workers still end: the rank shuts them down when it exits, they watch for
    its death, and the launcher SIGKILLs whatever is left (fault/launch.py)."""

    def __init__(self, init=None):
        self.init = init

    def __call__(self, worker_id: int) -> None:
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if self.init is not None:
            self.init(worker_id)


def shield_workers(loader) -> None:
    """Make ``loader``'s workers (started later, at iteration) keep serving while the rank finishes its step."""
    loader = getattr(loader, "base_dataloader", loader)  # Accelerate's DataLoaderShard wraps the one that iterates
    if getattr(loader, "num_workers", 0) > 0 and not isinstance(loader.worker_init_fn, _ShieldedInit):
        loader.worker_init_fn = _ShieldedInit(loader.worker_init_fn)
