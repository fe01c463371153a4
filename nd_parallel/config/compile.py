"""torch.compile's options: compile each decoder layer, and with which backend."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import ConfigError

# The backends a user means: inductor (the real one: fused kernels; on CPU its C++ backend), and the two torch
# ships for checking a model under dynamo without code generation. Any other registered dynamo backend is accepted
# too (checked when the model is laid out, where torch._dynamo is imported anyway).
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(kw_only=True)
class CompileOptions:
    """Compiling each decoder layer with torch.compile (after TP, around activation checkpointing, before FSDP)."""

    compile: bool = False
    """Compile each decoder layer's forward with torch.compile. Default False. Axolotl's key: torch_compile."""
    compile_backend: str = "inductor"
    """The torch.compile backend: "inductor" (default; on CPU it needs a C++ compiler), "aot_eager", "eager"."""

    def _check_compile(self) -> None:
        if not isinstance(self.compile, bool):
            raise ConfigError(f"compile={self.compile!r} is not a bool; use compile=True or False")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ConfigError(f"compile_backend={self.compile_backend!r} is not a backend name; use one of "
                              f"{', '.join(COMPILE_BACKENDS)}")
        if not self.compile:
            return
        if getattr(self, "activation_checkpointing", None) == "selective":
            raise ConfigError(
                "compile=True with activation_checkpointing='selective': selective checkpointing decides per aten op "
                "what to keep, and a compiled layer runs fused kernels it cannot see; use activation_checkpointing="
                "'full' (the compiled layer is recomputed whole) or compile=False")
        if getattr(self, "ep_size", 1) > 1:
            raise ConfigError(
                "compile=True with ep_size > 1 is not supported yet: the experts' all-to-all dispatch has not been "
                "run inside a compiled layer; use compile=False with expert parallelism")
        if getattr(self, "pp_size", 1) > 1 and getattr(self, "pp_backend", "torch") == "deepspeed":
            raise ConfigError(
                "compile=True with pp_backend='deepspeed': DeepSpeed's engine builds and runs its own layer modules; "
                "use pp_backend='torch' (its stages' layers are compiled) or compile=False")
