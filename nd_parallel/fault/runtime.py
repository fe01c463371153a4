"""What an integration calls at each point of a run; the mechanisms live beside it (watchdog, agreement,
nonfinite, signals).

One ``FaultTolerance`` per attached plugin. It is given the run's state as a ``TrainState`` (through a callable,
since models and optimizers are prepared after it starts), never the plugin or the Accelerator. It owns the
watchdog thread, the non-finite guard, the preemption flag and the order in which a process ends: the watchdog
stops, a pending async checkpoint finishes, then the process groups are destroyed (atexit). Leaving the process
groups to interpreter teardown is what let a rank abort with "terminate called without an active exception":
their communication threads were still joinable when C++ static destructors ran.
"""

from __future__ import annotations

import atexit
import logging
import types
from collections.abc import Callable

import torch
import torch.distributed as dist

from nd_parallel.checkpoint.train_state import TrainState

from . import agreement
from .nonfinite import NonFiniteGuard, check_state_finite
from .signals import PreemptionFlag
from .watchdog import Watchdog, resolve_timeout, set_backstop_timeouts
from .where import group_names

logger = logging.getLogger("nd_parallel")


class FaultTolerance:
    def __init__(self, config, device: torch.device, distributed: bool, state: Callable[[], TrainState]):
        """``state()``: the run's TrainState as it is when asked (prepared models and optimizers)."""
        self.state = state
        self.device = device
        self.distributed = distributed
        self.config = config
        self.hang_timeout = resolve_timeout(config.hang_timeout, self.device.type)
        self.step = 0  # optimizer steps taken (skipped ones included), the step every report names
        self.watchdog: Watchdog | None = None
        self.guard = NonFiniteGuard(config.skip_nonfinite_steps, self._named_grads, self.distributed)
        self._norm_checked = False
        for earlier in _live:  # a process attaches several plugins (one per layout in the parity worker): one watchdog
            earlier.stop_watchdog()
        self.preemption = PreemptionFlag().install() if config.save_on_signal else None
        if not _live:
            atexit.register(_close_all)
        _live[:] = [self]  # only the latest: holding every plugin would keep their models alive
        if self.distributed and self.hang_timeout > 0:
            try:
                self.watchdog = Watchdog(self.hang_timeout, {dist.group.WORLD.group_name: "world"}).start()
            except Exception as err:  # a store without a second connection (e.g. file://): train without it
                logger.warning("hang detection is off: the process group's store cannot open a second connection "
                               "(%s); launch with torchrun (a TCP store) to have it", err)

    # ----------------------------------------------------------------------------------------- prepare
    def on_mesh(self, mesh) -> None:
        """The mesh exists: name its groups in hang reports, and give them the backstop timeout."""
        if self.watchdog is None:
            return
        self.watchdog.names = group_names(mesh)
        groups = {mesh[d].get_group() for d in (*mesh.world.mesh_dim_names, "dp", "dp_cp", "dp_shard_cp")}
        set_backstop_timeouts([dist.group.WORLD, *groups], self.hang_timeout, self.device.type)

    def on_dataloader(self, loader) -> None:
        if self.preemption is not None:
            from .signals import shield_workers

            shield_workers(loader)

    def check_agreement(self, objects) -> None:
        if self.distributed:
            agreement.check(agreement.fields_of(self.config, objects))

    def on_optimizer(self, optimizer, on_skip: Callable[[], None] | None = None) -> None:
        """Count steps, check loss and norm before the step, and drop a step the guard marked as skipped
        (``on_skip()`` then tells whoever else steps with the optimizer, e.g. fp16's loss scaler)."""
        original = optimizer.step

        def step(opt, *args, **kwargs):  # a bound method, as LR schedulers built later expect (.__func__)
            if not optimizer.gradient_state.sync_gradients:  # accumulating: Accelerate does not step either
                return original(*args, **kwargs)
            if not self._norm_checked:  # no clip_grad_norm_ this step: the loss alone
                self.guard.check(self.step, None)
            self._norm_checked = False
            self.step += 1
            if self.watchdog is not None:
                self.watchdog.step = self.step
            if self.guard.skip_next_step:
                self.guard.skip_next_step = False
                optimizer._is_overflow = True  # AcceleratedScheduler then skips its step too
                if on_skip is not None:
                    on_skip()
                return None
            optimizer._is_overflow = False
            return original(*args, **kwargs)

        optimizer.step = types.MethodType(step, optimizer)

    def resumed_at(self, step: int) -> None:
        """A checkpoint was loaded: reports name the run's step, not the count since this process started."""
        self.step = step
        if self.watchdog is not None:
            self.watchdog.step = step

    # -------------------------------------------------------------------------------------------- step
    def observe_loss(self, loss) -> None:
        if isinstance(loss, torch.Tensor):
            self.guard.observe_loss(loss)

    def observe_norm(self, norm) -> None:
        self.guard.check(self.step, norm)
        self._norm_checked = True

    def preemption_requested(self) -> bool:
        """After an optimizer step: did any rank get SIGTERM/SIGINT (save_on_signal)? The same answer everywhere."""
        if self.preemption is None:
            return False
        return self.preemption.agreed(self.device, self.distributed)

    def before_save(self) -> None:
        """No checkpoint with a NaN/Inf: check this rank's model and optimizer state (one collective)."""
        now = self.state()
        named = [(n, p) for model in now.models for n, p in model.named_parameters()]
        names = {id(p): n for n, p in named}
        for i, inner in enumerate(now.torch_optimizers()):
            for p, state in inner.state.items():
                named += [(f"optimizer {i} {k} of {names.get(id(p), '?')}", v) for k, v in state.items()
                          if isinstance(v, torch.Tensor) and v.ndim > 0]
        check_state_finite(named, self.distributed, self.step)

    def _named_grads(self):
        return [(n, p.grad) for model in self.state().models for n, p in model.named_parameters()
                if p.grad is not None]

    # -------------------------------------------------------------------------------------------- exit
    def stop_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.preemption is not None:
            self.preemption.uninstall()
            self.preemption = None


# The latest FaultTolerance of this process, so that exit finds it: one exit per process, whatever the number of
# plugins attached (an earlier one's watchdog is stopped when the next attaches).
_live: list[FaultTolerance] = []


def _close_all() -> None:
    """Orderly end of the process (atexit): watchdogs, the async save in flight, then the process groups."""
    from nd_parallel.checkpoint.asynchronous import reset_group, wait_pending

    for fault in _live:
        fault.stop_watchdog()
    try:
        wait_pending()
    except Exception as err:  # already reported where it was raised; exit must go on to tear down in order
        logger.error("the checkpoint written in the background failed: %s", err)
    if dist.is_initialized():
        together = _ExitTogether()
        try:
            dist.destroy_process_group()
        except Exception as err:  # already torn down by someone else: nothing left to do
            logger.debug("destroy_process_group at exit: %s", err)
        together.wait()
    reset_group()


class _ExitTogether:
    """Rank 0 leaves last. Where each attempt's store is served by rank 0's process (several nodes, launch.Nodes),
    a rank 0 that exits first takes the store with it while its peers are still tearing their groups down; their
    teardown then fails and the gloo threads left behind abort the process at exit ("terminate called without an
    active exception"; seen at the end of the two-node chaos run). So every rank counts itself out in the store
    after destroying its groups, and rank 0, holding the store alive, waits (at most 10 s) for all of them."""

    KEY = "nd_parallel/exited"

    def __init__(self):
        from torch.distributed.distributed_c10d import _get_default_store

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        try:
            self.store = _get_default_store() if self.world > 1 else None  # a reference keeps it alive
        except Exception:  # no default store (an in-memory group): nothing to wait for
            self.store = None

    def wait(self, timeout: float = 10.0) -> None:
        import time

        if self.store is None:
            return
        try:
            count = self.store.add(self.KEY, 1)
            deadline = time.monotonic() + timeout
            while self.rank == 0 and count < self.world and time.monotonic() < deadline:
                time.sleep(0.02)
                count = self.store.add(self.KEY, 0)
        except Exception as err:  # the store's host is gone already: nothing to hold open
            logger.debug("exit count in the store: %s", err)
