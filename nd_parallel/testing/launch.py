"""Launch helpers for tests and benchmarks: a script launched as its own ranks, and launches shared by many rows."""

from __future__ import annotations

from nd_parallel.fault.launch import launch


def launch_for_result(script: str, nprocs: int, args: list[str] = (), **kwargs):
    """Run ``script`` on ``nprocs`` ranks with ``--worker --result FILE`` appended, and return the JSON rank 0
    wrote to FILE. The shape every benchmark shares: the parent launches itself as the ranks."""
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="nd_parallel_result_") as tmp:
        result = Path(tmp) / "result.json"
        launch(script, nprocs, [*args, "--worker", "--result", str(result)], **kwargs)
        return json.loads(result.read_text())


class LaunchOnce:
    """Per-key results of expensive launches (one launch serves many test rows). A failed launch is remembered
    and re-raised for every later row, so a broken launch costs its time once, not once per row."""

    def __init__(self):
        self._done: dict = {}

    def get(self, key, start):
        """``start()``'s result for ``key``, computed on first use."""
        if key not in self._done:
            try:
                self._done[key] = start()
            except (RuntimeError, TimeoutError) as err:
                self._done[key] = err
        if isinstance(self._done[key], BaseException):
            raise self._done[key]
        return self._done[key]
