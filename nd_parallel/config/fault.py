"""Fault options: how a run reacts to a hung collective, a preemption signal, and non-finite steps."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .checks import ConfigError, ConfigTypeError, _check_bool, _is_int, _kind


@dataclass(kw_only=True)
class FaultOptions:
    """What a run does when a rank hangs, the job is preempted, or a step's loss or gradients are not finite."""

    hang_timeout: float | None = None
    """Seconds a rank may wait in one collective before the run is declared hung: every rank then prints which ranks
    are missing and where it stands, and exits non-zero (nd_parallel/fault/watchdog.py). Default None = the backend's
    own timeout (600 on CUDA, 1800 on CPU); 0 = off; otherwise >= 5. Set it above the longest legitimate wait."""
    save_on_signal: bool = False
    """Catch SIGTERM/SIGINT so the loop can write a preemption checkpoint after the current optimizer step
    (``plugin.preemption_requested()``). Default False (the signals end the process at once)."""
    skip_nonfinite_steps: int = 0
    """Optimizer steps with a NaN/Inf loss or gradient norm that are skipped (not applied) before the run stops.
    Default 0 = stop at the first, naming the step, rank and parameter; >= 0."""

    def _check_fault(self) -> None:
        """hang_timeout and save_on_signal; skip_nonfinite_steps has its own step (see ParallelismConfig)."""
        timeout = self.hang_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)):
            raise ConfigTypeError(f"hang_timeout={timeout!r} is {_kind(timeout)}; give seconds such as "
                                  "hang_timeout=600, 0 to turn hang detection off, or None for the backend default")
        if timeout is not None and not (timeout == 0 or 5 <= timeout < math.inf):
            raise ConfigError(f"hang_timeout={timeout} must be 0 (off) or at least 5 seconds (the heartbeat needs a "
                              "few beats to tell a stopped rank from a slow one); for example hang_timeout=600")
        _check_bool("save_on_signal", self.save_on_signal)

    def _check_nonfinite(self) -> None:
        skip = self.skip_nonfinite_steps
        if not _is_int(skip) or skip < 0:
            raise ConfigError(f"skip_nonfinite_steps={skip!r} must be a whole number >= 0: 0 stops at the first "
                              "non-finite loss or gradient norm, N skips up to N such steps")
