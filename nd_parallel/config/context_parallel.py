"""Context parallelism's options: the attention backend and the causal load balance."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import _check_bool, _check_choice

CP_BACKENDS = ("ring", "ulysses", "torch")


@dataclass(kw_only=True)
class ContextParallelOptions:
    """How attention runs over a sequence split across the context-parallel ranks."""

    cp_backend: str = "ring"
    """Context-parallel attention: "ring" (default), "ulysses" (all-to-all), "torch" (CUDA only)."""
    cp_load_balance: bool = True
    """Reorder sequence chunks so causal attention costs the same on every CP rank. Default True."""

    def _check_context_parallel(self) -> None:
        _check_choice("cp_backend", self.cp_backend, CP_BACKENDS)
        _check_bool("cp_load_balance", self.cp_load_balance)
