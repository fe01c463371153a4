"""Fault tolerance: hang detection (watchdog.py, where.py), agreement at prepare (agreement.py), non-finite values
(nonfinite.py), preemption on signals (signals.py), the process tree the launcher ends (proctree.py), and the order
a process ends in (runtime.py).

``runtime.FaultTolerance`` is what the plugin calls; the other modules hold the mechanisms. Nothing is imported
here eagerly: the launcher imports proctree.py and must stay free of torch.
"""

__all__ = ["AgreementError", "NonFiniteError"]


def __getattr__(name):
    if name == "AgreementError":
        from .agreement import AgreementError

        return AgreementError
    if name == "NonFiniteError":
        from .nonfinite import NonFiniteError

        return NonFiniteError
    raise AttributeError(f"module 'nd_parallel.fault' has no attribute {name!r}")
