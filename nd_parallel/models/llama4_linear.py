"""Llama 4's MoE experts as one ``nn.Linear`` per expert and projection (Axolotl's ``llama4_linearized_experts``).

transformers stores a Llama 4 layer's routed experts fused: ``gate_up_proj`` [E, H, 2I] (gate, then up, along the
last dim) and ``down_proj`` [E, I, H], multiplied with ``bmm``. Linearized, expert ``e`` has ``gate_projs[e]``,
``up_projs[e]`` ([I, H] weights) and ``down_projs[e]`` ([H, I]): the same function (per expert
``down(up(x) * act(gate(x)))`` on the tokens routed to it), but Linear layers that bitsandbytes quantizes
(``load_in_4bit``) and LoRA adapts (``experts.gate_projs.[0-9]+``).

Two checkpoint forms load: one already linearized (Axolotl publishes such checkpoints, keys
``experts.gate_projs.<e>.weight``): the class is swapped while transformers builds the model
(``linearized_class``), so the Linears are created, quantized and loaded as any other; and a stock, fused one:
loaded as it is, then split module by module (``linearize_experts``, full precision only).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn


class LinearizedLlama4TextExperts(nn.Module):
    """``Llama4TextExperts`` with a Linear per expert and projection; the input is sorted by expert, as there."""

    def __init__(self, config):
        from transformers.activations import ACT2FN

        super().__init__()
        self._build(config.num_local_experts, config.hidden_size, config.intermediate_size, ACT2FN[config.hidden_act])

    @classmethod
    def like(cls, experts: nn.Module) -> LinearizedLlama4TextExperts:
        """An empty linearized twin of a fused ``Llama4TextExperts`` (its sizes and activation)."""
        twin = cls.__new__(cls)
        nn.Module.__init__(twin)
        twin._build(experts.num_experts, experts.hidden_size, experts.expert_dim, experts.act_fn)
        return twin

    def _build(self, num_experts: int, hidden_size: int, expert_dim: int, act_fn) -> None:
        self.num_experts, self.hidden_size, self.expert_dim, self.act_fn = num_experts, hidden_size, expert_dim, act_fn
        linear = lambda i, o: nn.ModuleList(nn.Linear(i, o, bias=False) for _ in range(num_experts))  # noqa: E731
        self.gate_projs = linear(hidden_size, expert_dim)
        self.up_projs = linear(hidden_size, expert_dim)
        self.down_projs = linear(expert_dim, hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        per_expert = hidden_states.view(self.num_experts, -1, self.hidden_size)
        out = [self.down_projs[e](self.up_projs[e](x) * self.act_fn(self.gate_projs[e](x)))
               for e, x in enumerate(per_expert)]
        return torch.stack(out).view(-1, self.hidden_size)


@torch.no_grad()
def linearize_experts(model: nn.Module) -> int:
    """Replace every fused ``Llama4TextExperts`` of ``model`` by its linearized equal, in place; how many."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    fused = [(name, m) for name, m in model.named_modules() if type(m) is Llama4TextExperts]
    for name, experts in fused:
        linear = LinearizedLlama4TextExperts.like(experts).to(experts.gate_up_proj.dtype)
        gate, up = experts.gate_up_proj.chunk(2, dim=-1)  # [E, H, I] each
        for e in range(experts.num_experts):
            linear.gate_projs[e].weight.copy_(gate[e].t())
            linear.up_projs[e].weight.copy_(up[e].t())
            linear.down_projs[e].weight.copy_(experts.down_proj[e].t())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, linear)
    return len(fused)


@contextlib.contextmanager
def linearized_class() -> Iterator[None]:
    """Inside, transformers builds Llama 4's experts as ``LinearizedLlama4TextExperts`` (Axolotl's patch)."""
    from transformers.models.llama4 import modeling_llama4

    original, init = modeling_llama4.Llama4TextExperts, modeling_llama4.Llama4PreTrainedModel._init_weights

    def _init_weights(self, module):  # the model's init reads gate_up_proj from any module of the swapped name
        if not isinstance(module, LinearizedLlama4TextExperts):  # its Linears are initialized as Linears
            init(self, module)

    modeling_llama4.Llama4TextExperts = LinearizedLlama4TextExperts
    modeling_llama4.Llama4PreTrainedModel._init_weights = _init_weights
    try:
        yield
    finally:
        modeling_llama4.Llama4TextExperts = original
        modeling_llama4.Llama4PreTrainedModel._init_weights = init


def checkpoint_experts(source: str | Path, revision: str | None = None) -> str | None:
    """How a checkpoint stores Llama 4's experts: "linearized", "fused", or None (no expert tensor found). A hub name
    (Axolotl's llama-4 examples name axolotl-quants/...-Linearized-... checkpoints) is read from the files
    transformers caches for it (the index, else the single safetensors file), which from_pretrained reads next."""
    from safetensors import safe_open

    files, index = sorted(Path(source).glob("*.safetensors")), Path(source) / "model.safetensors.index.json"
    if not Path(source).is_dir():
        from transformers.utils import cached_file

        def cached(name):
            return cached_file(str(source), name, revision=revision, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False)

        index = Path(cached("model.safetensors.index.json") or index)
        files = [] if index.is_file() else [Path(f) for f in [cached("model.safetensors")] if f]
    names: list[str] = []
    if index.is_file():
        names = list(json.loads(index.read_text())["weight_map"])
    for path in files if not names else []:
        with safe_open(str(path), framework="pt") as f:
            names += list(f.keys())
    if any(".experts.gate_projs." in n for n in names):
        return "linearized"
    if any(n.endswith(".experts.gate_up_proj") for n in names):
        return "fused"
    return None
