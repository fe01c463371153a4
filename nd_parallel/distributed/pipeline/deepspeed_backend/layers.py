"""The layers of the ``PipelineModule``: the model's own modules wrapped into DeepSpeed's layer-by-layer form.

One pipeline layer for the embeddings, one per decoder layer, one for the head (final norm + lm_head). Every
layer wraps the model's own modules (no copies). Separate from the engine glue because none of it needs
DeepSpeed to run: chained in one process, the layers must reproduce the model's forward and backward, and
that is tested without DeepSpeed installed.

DeepSpeed hands each layer what the previous one returned: a tensor, or a tuple of tensors whose first
element is the activation. Floating-point tuple elements must carry a gradient back (the receiving stage
marks them requires_grad and sends their .grad), so the side inputs (attention mask, position ids) travel
as integer tensors, unchanged from layer to layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from nd_parallel.models.hf import ModelParts, model_parts, shares_embedding

from ..split import StageSpec
from ..stage import build_skeleton

TIED_KEY = "tied_embeddings"


def _split(x) -> tuple[torch.Tensor, tuple]:
    return (x[0], tuple(x[1:])) if isinstance(x, tuple) else (x, ())


def _join(hidden: torch.Tensor, side: tuple):
    return (hidden, *side) if side else hidden


class Source:
    """The model the layer specs are built from; released after building so the specs keep nothing alive."""

    def __init__(self, model: nn.Module):
        self.model = model


class LayerInputs:
    """What the model's own forward hands each decoder layer (masks, rotary embeddings, positions).

    Runs the base model's forward on a skeleton whose decoder layers are recorders, so transformers builds
    the padding-aware causal mask (per attention type), the position embeddings and anything else a family
    needs, exactly as in one process. A stage computes them once per micro-batch, in its first layer, and its
    other layers reuse them (DeepSpeed runs a stage's layers back to back for one micro-batch at a time).
    """

    def __init__(self, model: nn.Module, parts: ModelParts, with_embeddings: bool):
        # index 0 keeps the embeddings (pre) and drops the head (post); index 1 of 3 drops both.
        spec = StageSpec(index=0 if with_embeddings else 1, layers=[])
        self.skeleton = build_skeleton(model, parts, spec, num_stages=3)
        self.base = self.skeleton.get_submodule(parts.layers_fqn.rpartition(".")[0])
        for index, layer in enumerate(self.skeleton.get_submodule(parts.layers_fqn)):
            layer.register_forward_pre_hook(functools.partial(self._record, index), with_kwargs=True)
        self.fields: tuple[str, ...] = ()  # names of the side tensors this step: attention_mask, position_ids
        self.calls: dict[int, tuple[tuple, dict]] = {}

    def _record(self, index, module, args, kwargs):
        self.calls[index] = (tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "hidden_states"})

    def _run(self, side: tuple, **inputs) -> torch.Tensor:
        self.calls = {}
        named = dict(zip(self.fields, side))
        return self.base(**inputs, **named, use_cache=False).last_hidden_state

    def embed(self, input_ids: torch.Tensor, side: tuple) -> torch.Tensor:
        """First stage: the input of decoder layer 0 (embeddings, scaled as the model does), with grad."""
        return self._run(side, input_ids=input_ids)

    def compute(self, hidden: torch.Tensor, side: tuple) -> None:
        """Later stages: only shapes matter to masks and positions, so zeros stand in for the activation."""
        with torch.no_grad():
            self._run(side, inputs_embeds=torch.zeros_like(hidden))


def _outer_post(parts: ModelParts) -> list[str]:
    """Modules after the layers that belong to the CausalLM itself (lm_head), not to the base model (norm)."""
    base_prefix = parts.layers_fqn.rpartition(".")[0] + "."
    return [f for f in parts.post if not f.startswith(base_prefix)]


def _param_path(modules: list[nn.Module], prefix: str, param: nn.Parameter) -> str | None:
    """Where ``param`` sits inside a layer that registers ``modules`` as ``prefix`` (a ModuleList)."""
    for i, module in enumerate(modules):
        for name, p in module.named_parameters():
            if p is param:
                return f"{prefix}.{i}.{name}"
    return None


class EmbeddingLayer(nn.Module):
    """Pipeline layer 0: the modules before the decoder layers, run by the model's own forward."""

    def __init__(self, source: Source, parts: ModelParts, inputs: LayerInputs):
        super().__init__()
        self.pre = nn.ModuleList(source.model.get_submodule(f) for f in parts.pre)
        self.inputs = inputs  # not a module: shared by the stage's layers

    def forward(self, x):
        input_ids, side = _split(x)
        return _join(self.inputs.embed(input_ids, side), side)


class DecoderLayer(nn.Module):
    """One HF decoder layer, given the arguments the model's forward would give it."""

    def __init__(self, source: Source, parts: ModelParts, index: int, inputs: LayerInputs, first_in_stage: bool):
        super().__init__()
        self.layer = source.model.get_submodule(f"{parts.layers_fqn}.{index}")
        self.index, self.inputs, self.first_in_stage = index, inputs, first_in_stage

    def forward(self, x):
        hidden, side = _split(x)
        # Activation checkpointing is off (the engine's DeepSpeed config): every forward of a stage is one
        # micro-batch, first layer to last, so its first layer can compute what the others reuse.
        if self.first_in_stage:
            self.inputs.compute(hidden, side)
        args, kwargs = self.inputs.calls[self.index]
        out = self.layer(hidden, *args, **kwargs)
        return _join(out[0] if isinstance(out, tuple) else out, side)


class _GivenHidden(nn.Module):
    """Stands in for the base model inside the head: returns the hidden states it is given."""

    def forward(self, *args, inputs_embeds=None, **kwargs):
        return BaseModelOutputWithPast(last_hidden_state=inputs_embeds)


class HeadLayer(nn.Module):
    """The last pipeline layer: the base model's trailing modules (final norm), then the CausalLM's own forward
    (lm_head, and any logit scaling or soft-capping the family applies) on a stand-in base model."""

    def __init__(self, source: Source, parts: ModelParts):
        super().__init__()
        base_fqn = parts.layers_fqn.rpartition(".")[0]
        outer = _outer_post(parts)
        # HF base models end with `hidden = self.norm(hidden)`: their modules after the layers run in order.
        self.trailing = nn.ModuleList(source.model.get_submodule(f) for f in parts.post if f not in outer)
        self.outer = nn.ModuleList(source.model.get_submodule(f) for f in outer)
        skeleton = build_skeleton(source.model, parts, StageSpec(index=1, layers=[]), num_stages=2)
        parent_fqn, _, name = base_fqn.rpartition(".")
        # The path to the layers is a private copy in the skeleton, so this does not touch the model.
        setattr(skeleton.get_submodule(parent_fqn) if parent_fqn else skeleton, name, _GivenHidden())
        self.__dict__["_skeleton"] = skeleton  # not a submodule: its parameters are self.outer's
        self._causal_lm_forward = type(skeleton).forward.__get__(skeleton)

    def forward(self, x):
        hidden, _ = _split(x)
        for module in self.trailing:
            hidden = module(hidden)
        return self._causal_lm_forward(inputs_embeds=hidden, use_cache=False).logits


def _tied_paths(model: nn.Module, parts: ModelParts) -> tuple[str | None, str | None]:
    """Where a tied embedding / lm_head weight sits in the embedding and in the head layer (None: untied)."""
    if not shares_embedding(model):
        return None, None
    shared = model.get_input_embeddings().weight
    paths = (_param_path([model.get_submodule(f) for f in parts.pre], "pre", shared),
             _param_path([model.get_submodule(f) for f in _outer_post(parts)], "outer", shared))
    if None in paths:
        raise NotImplementedError(
            f"{type(model).__name__} ties its input and output embeddings, but they are not among the modules "
            f"before ({list(parts.pre)}) and after ({list(parts.post)}) the layers; use pp_backend='torch'")
    return paths


def check_model(model: nn.Module) -> None:
    """What the DeepSpeed conversion needs beyond the shared split checks (no process group needed)."""
    parts = model_parts(model)
    if "." not in parts.layers_fqn:
        raise NotImplementedError(f"{type(model).__name__} holds its decoder layers directly, without a base "
                                  "model; pp_backend='deepspeed' needs the usual CausalLM(base model, lm_head) shape")
    _tied_paths(model, parts)


@dataclass
class LayerPlan:
    """One pipeline layer: the class and arguments that build it, and the path of a tied weight inside it."""

    cls: type
    args: tuple
    tied_attr: str | None = None

    def build(self) -> nn.Module:
        return self.cls(*self.args)


def plan_layers(source: Source, parts: ModelParts, counts: list[int], inputs: LayerInputs) -> list[LayerPlan]:
    """[embeddings, decoder layers..., head]; ``counts`` (layers per stage) says which layer starts a stage."""
    firsts = {sum(counts[:s]) for s in range(1, len(counts)) if counts[s]}  # first layer of stages > 0
    decoders = [LayerPlan(DecoderLayer, (source, parts, i, inputs, i in firsts)) for i in range(parts.num_layers)]
    embed, head = LayerPlan(EmbeddingLayer, (source, parts, inputs)), LayerPlan(HeadLayer, (source, parts))
    embed.tied_attr, head.tied_attr = _tied_paths(source.model, parts)
    return [embed, *decoders, head]


def layer_specs(plans: list[LayerPlan]) -> list:
    """DeepSpeed layer specs (built only on the stage that owns them).

    A tied pair becomes two TiedLayerSpecs with one key: each of the two stages builds its own layer and names
    the shared weight inside it (``tied_weight_attr``); DeepSpeed broadcasts that weight between the stages once
    and sums its gradient over them after every batch (ReduceTiedGrads), as for one shared parameter.
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    return [TiedLayerSpec(TIED_KEY, p.cls, *p.args, tied_weight_attr=[p.tied_attr]) if p.tied_attr
            else LayerSpec(p.cls, *p.args) for p in plans]


def layer_boundaries(counts: list[int], num_layers: int) -> list[int]:
    """DeepSpeed's ``parts`` for [embeddings, layers..., head]: stage s runs pipeline layers [b[s], b[s+1])."""
    return [0] + [1 + sum(counts[:s]) for s in range(1, len(counts))] + [num_layers + 2]
