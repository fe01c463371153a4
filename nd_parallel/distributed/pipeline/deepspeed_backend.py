"""Pipeline parallelism on DeepSpeed's pipeline engine for an unmodified HF causal LM.

The model is converted into a ``deepspeed.pipe.PipelineModule`` automatically: one pipeline layer for
the embeddings, one per decoder layer, one for the head (final norm + lm_head). Every layer wraps the
model's own modules (no copies), and what a decoder layer needs besides the hidden states (attention
masks, rotary embeddings, positions) is computed by the model's own forward, run once per stage and
micro-batch on a skeleton whose decoder layers only record their arguments. Stage boundaries come from
``split.split_stages``, so both backends cut a model the same way. A tied embedding / lm_head pair
uses DeepSpeed's ``TiedLayerSpec``: its ReduceTiedGrads instruction sums the two copies' gradients.

The user's optimizer does the update, from the unchanged Accelerate loop: DeepSpeed gets an optimizer
that never steps, and its schedule's OptimizerStep instruction is replaced (see ``_skip_optimizer_step``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from nd_parallel.distributed.mesh import backend_for
from nd_parallel.models.hf import ModelParts, model_parts, shares_embedding

from .split import StageSpec, split_stages
from .stage import build_skeleton
from .step_inputs import check_step_inputs, global_label_tokens
from .torch_backend import PipelineLoss

logger = logging.getLogger(__name__)

TIED_KEY = "tied_embeddings"


def require_deepspeed():
    """Import deepspeed, or say how to get it (checked before any collective)."""
    try:
        import deepspeed
        from deepspeed.pipe import PipelineModule  # noqa: F401  (fails on a broken install too)
    except ImportError as err:
        raise ImportError(
            f"pp_backend='deepspeed' needs the deepspeed package, which cannot be imported ({err}); install it "
            "with `pip install 'nd_parallel[deepspeed]'` (or `pip install deepspeed`), or use pp_backend='torch'"
        ) from err
    return deepspeed


# ----------------------------------------------------------------------------------- pipeline layers
# DeepSpeed hands each layer what the previous one returned: a tensor, or a tuple of tensors whose first
# element is the activation. Floating-point tuple elements must carry a gradient back (the receiving stage
# marks them requires_grad and sends their .grad), so the side inputs (attention mask, position ids)
# travel as integer tensors, unchanged from layer to layer.

def _split(x) -> tuple[torch.Tensor, tuple]:
    return (x[0], tuple(x[1:])) if isinstance(x, tuple) else (x, ())


def _join(hidden: torch.Tensor, side: tuple):
    return (hidden, *side) if side else hidden


class _Source:
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

    def __init__(self, source: _Source, parts: ModelParts, inputs: LayerInputs):
        super().__init__()
        self.pre = nn.ModuleList(source.model.get_submodule(f) for f in parts.pre)
        self.inputs = inputs  # not a module: shared by the stage's layers

    def forward(self, x):
        input_ids, side = _split(x)
        return _join(self.inputs.embed(input_ids, side), side)


class DecoderLayer(nn.Module):
    """One HF decoder layer, given the arguments the model's forward would give it."""

    def __init__(self, source: _Source, parts: ModelParts, index: int, inputs: LayerInputs, first_in_stage: bool):
        super().__init__()
        self.layer = source.model.get_submodule(f"{parts.layers_fqn}.{index}")
        self.index, self.inputs, self.first_in_stage = index, inputs, first_in_stage

    def forward(self, x):
        hidden, side = _split(x)
        # Activation checkpointing is off (see _ds_config): every forward of a stage is one micro-batch,
        # first layer to last, so its first layer can compute what the others reuse.
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

    def __init__(self, source: _Source, parts: ModelParts):
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


def plan_layers(source: _Source, parts: ModelParts, counts: list[int], inputs: LayerInputs) -> list[LayerPlan]:
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


# ------------------------------------------------------------------------------ DeepSpeed plumbing
@functools.cache
def _presplit_module_class():
    from deepspeed.pipe import PipelineModule

    class PresplitPipelineModule(PipelineModule):
        """A PipelineModule whose stage boundaries are given (our split) instead of computed by DeepSpeed.

        DeepSpeed's partition methods ("uniform", "parameters", "type:regex") balance by counts or weights;
        none reproduces an explicit ``pp_balance`` or the uniform split's rule of giving extra layers to the
        middle stages, so the one method that applies the boundaries is replaced.
        """

        def __init__(self, layers, boundaries: list[int], **kwargs):
            self.given_boundaries = list(boundaries)  # read by _partition_layers during super().__init__
            super().__init__(layers, **kwargs)

        def _partition_layers(self, method=None):
            self.parts = list(self.given_boundaries)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return PresplitPipelineModule


class _NeverSteps(torch.optim.Optimizer):
    """The optimizer handed to DeepSpeed, which requires one to run backward; the user's optimizer steps."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})

    def step(self, closure=None):
        raise RuntimeError("the DeepSpeed pipeline backend's placeholder optimizer must never step")


def _skip_optimizer_step(engine, **kwargs):
    """Replaces DeepSpeed's OptimizerStep instruction, the last of its TrainSchedule.

    The schedule ends with ReduceTiedGrads, ReduceGrads, OptimizerStep. We keep the first two and drop the
    step, because the user's optimizer (re-pointed by the plugin) steps in the Accelerate loop after clipping.
    Handing DeepSpeed a no-op optimizer and keeping its step would not do: DeepSpeed's step also zeroes the
    gradients (``_take_model_step``) before the loop could clip and apply them. Only the step count is kept.
    """
    engine.global_steps += 1


def _check_topology(topo, mesh) -> None:
    """DeepSpeed's (pipe, data) rank grid must be our mesh's (pp, dp_replicate) grid, rank for rank."""
    grid = mesh.world.mesh.reshape(mesh.size("pp"), mesh.size("dp_replicate"))
    for pp in range(grid.shape[0]):
        for dp in range(grid.shape[1]):
            coord = topo.get_coord(int(grid[pp, dp]))
            if (coord.pipe, coord.data) != (pp, dp):
                raise RuntimeError(f"DeepSpeed places rank {int(grid[pp, dp])} at (pipe={coord.pipe}, data="
                                   f"{coord.data}), the mesh at (pp={pp}, dp={dp}); the rank layouts differ")


class MicroBatchLoss:
    """DeepSpeed's loss_fn: HF's causal-LM loss summed over tokens / the global token count N_global.

    DeepSpeed backpropagates ``loss / gradient_accumulation_steps`` from the last stage; the returned share
    passes a gradient ``gas`` times larger back, so the gradients are exactly those of the global-token mean
    (exact for power-of-two micro-batch counts, otherwise within one float32 rounding of it). Its data-parallel
    reduction is a sum (``gradient_allreduce_op="sum"``): each rank's loss is already its share of the mean.
    """

    def __init__(self, model: nn.Module, gas: int):
        self.hf_loss = PipelineLoss(model)
        self.gas = gas
        self.shares: list[torch.Tensor] = []

    def start(self, total_tokens: torch.Tensor) -> None:
        self.hf_loss.total_tokens = total_tokens
        self.shares = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        share = self.hf_loss(logits, labels)
        self.shares.append(share.detach())
        return _ScaleGrad.apply(share, float(self.gas))


class _ScaleGrad(torch.autograd.Function):
    """Forward: the value unchanged. Backward: the gradient times ``factor``."""

    @staticmethod
    def forward(ctx, value, factor):
        ctx.factor = factor
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class TiedViaDeepSpeed:
    """The plugin's view of a tied pair: ``duplicate`` is left out of the gradient norm; the gradients are
    already summed by DeepSpeed's ReduceTiedGrads inside the schedule, so ``sync_grads`` has nothing to do."""

    def __init__(self, duplicate: nn.Parameter | None):
        self.duplicate = duplicate

    def sync_grads(self) -> None:
        return None


# ------------------------------------------------------------------------------------ the model
class DeepSpeedPipelineModel(nn.Module):
    """This rank's DeepSpeed pipeline stage behind the ``model(**batch)`` interface of a HF causal LM.

    ``stages`` holds a skeleton of the HF model with only this stage's modules (the same module objects the
    DeepSpeed layers run), so parameter and state-dict names are the HF names.
    """

    def __init__(self, engine, skeleton: nn.Module, spec: StageSpec, mesh, inputs: LayerInputs,
                 loss: MicroBatchLoss, microbatches: int, device: torch.device, config, tied):
        super().__init__()
        self.stages = nn.ModuleList([skeleton])
        self.specs = [spec]
        self.__dict__["engine"] = engine  # not a submodule: its parameters are the stage's, listed once
        self.mesh, self.inputs, self.loss = mesh, inputs, loss
        self.microbatches, self.device, self.config, self.tied = microbatches, device, config, tied
        self._shape_key = None

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for stage in self.stages:
            yield from stage.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def _micro_batches(self, input_ids, side: list[torch.Tensor], labels):
        """DeepSpeed's data protocol: (inputs for the first stage, labels for the last), per micro-batch."""
        chunks = [t.chunk(self.microbatches) for t in (input_ids, *side, labels)]
        for ids, *rest, lab in zip(*chunks):
            yield ((ids, *rest) if rest else ids), lab

    def forward(self, input_ids=None, labels=None, attention_mask=None, position_ids=None, num_items_in_batch=None,
                **unused):
        if not (self.training and torch.is_grad_enabled()):
            raise NotImplementedError(
                "evaluation (model.eval() / torch.no_grad()) under pp_backend='deepspeed' is not offered: its engine "
                "runs training steps only here; use pp_backend='torch', whose forward-only schedule returns the loss "
                "and the logits")
        check_step_inputs(input_ids, labels, unused, self.microbatches)
        self._check_no_accumulation()
        self.loss.start(global_label_tokens(labels, self.mesh, num_items_in_batch))
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise NotImplementedError(f"pp_backend='deepspeed' takes a [batch, seq] attention_mask of 0/1 "
                                          f"(right padding), got shape {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.long()  # a float tuple element would be expected to carry a gradient
        named = {k: v for k, v in (("attention_mask", attention_mask), ("position_ids", position_ids))
                 if v is not None}
        self.inputs.fields = tuple(named)
        # DeepSpeed sizes its send/receive buffers on the first batch; a new shape needs new ones. The ranks
        # of one pipeline see the same samples, so they reset together.
        key = (tuple(input_ids.shape), tuple(named))
        if key != self._shape_key:
            self.engine.reset_activation_shape()
            self._shape_key = key
        try:
            self.engine.train_batch(data_iter=self._micro_batches(input_ids, list(named.values()), labels))
        finally:
            self.inputs.calls = {}  # the masks of the last micro-batch are not needed until the next step
        return CausalLMOutputWithPast(loss=self._global_loss())

    def _check_no_accumulation(self) -> None:
        """DeepSpeed's ReduceTiedGrads all-reduces a tied weight's *whole* gradient in every train_batch, so a
        second forward before zero_grad would add the first call's tied gradient twice. Every rank of the
        pipeline runs the same loop, so all of them raise here together (no rank is left waiting)."""
        if self.tied is None:
            return
        if any(p.grad is not None and bool(p.grad.any()) for p in self.stages[0].parameters()):
            raise NotImplementedError(
                "gradient accumulation over several forward calls with pp_backend='deepspeed' and tied embeddings "
                "would count the tied gradient twice (DeepSpeed all-reduces the accumulated tied gradient in every "
                "call); call optimizer.zero_grad() after every forward, accumulate inside one call with "
                "pp_microbatches, or use pp_backend='torch'"
            )

    def _global_loss(self) -> torch.Tensor:
        """Sum of the micro-batch shares over dp ranks, then sent from the last stage to every pp rank."""
        shares = self.loss.shares
        value = torch.stack(shares).sum() if shares else torch.zeros((), device=self.device)
        value = value.to(self.device, torch.float32)
        dist.all_reduce(value, group=self.mesh["dp_cp"].get_group())
        dist.broadcast(value, group=self.mesh["pp"].get_group(), group_src=self.mesh.size("pp") - 1)
        value._nd_parallel_backward_done = True  # accelerator.backward(loss) becomes a no-op
        return value


def _ds_config(microbatches: int, dp: int) -> dict:
    return {
        # Only DeepSpeed's throughput log reads the micro-batch size; ours may be any size, so 1 stands in.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": microbatches,
        "train_batch_size": microbatches * dp,
        "gradient_allreduce_op": "sum",  # see MicroBatchLoss
        "zero_optimization": {"stage": 0},
        "pipeline": {"activation_checkpoint_interval": 0},  # DecoderLayer relies on it
    }


def _check_device(device: torch.device) -> None:
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != device.type:
        raise RuntimeError(
            f"DeepSpeed chose its '{name}' accelerator but the model runs on {device.type}; set "
            f"DS_ACCELERATOR={device.type} in the environment the ranks are launched with")


def _check_same_parameters(pipe: nn.Module, skeleton: nn.Module) -> None:
    ds_ids, hf_ids = {id(p) for p in pipe.parameters()}, {id(p) for p in skeleton.parameters()}
    if ds_ids != hf_ids:
        extra = [n for n, p in pipe.named_parameters() if id(p) not in hf_ids]
        missing = [n for n, p in skeleton.named_parameters() if id(p) not in ds_ids]
        raise RuntimeError(f"the DeepSpeed stage and its HF view hold different parameters: only DeepSpeed "
                           f"{extra[:5]}, only HF {missing[:5]}")


def _skip_shm_kernel_build(device: torch.device) -> None:
    """On CPU, DeepSpeed's comm backend JIT-compiles a shared-memory all-reduce kernel (minutes on a small
    machine) that only its inference all-reduce path uses; pipeline training never calls it. Marking the op
    unavailable makes DeepSpeed skip the build and use torch.distributed, exactly as when it cannot compile."""
    if device.type != "cpu":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def build_deepspeed_pipeline(model: nn.Module, mesh, config, device: torch.device) -> DeepSpeedPipelineModel:
    """Convert ``model`` into this rank's stage of a DeepSpeed PipelineModule and wrap it for the loop."""
    deepspeed = require_deepspeed()
    from . import layer_counts  # the package imports this module lazily; importing at the top would cycle

    inner = {d: mesh.size(d) for d in ("dp_shard", "cp", "tp") if mesh.size(d) > 1}
    if inner:
        raise NotImplementedError(f"pp_backend='deepspeed' supports pipeline x dp_replicate only, got {inner}; "
                                  "use pp_backend='torch' for sharding, tensor or context parallelism")
    _check_device(device)
    check_model(model)
    parts = model_parts(model)
    pp, dp, microbatches = config.pp_size, mesh.size("dp_replicate"), config.microbatches
    specs = split_stages(parts, pp, layer_counts(config, parts.num_layers, model, mesh))
    counts = [len(s.layers) for s in specs]
    pp_rank = mesh.local_rank("pp")
    _skip_shm_kernel_build(device)
    deepspeed.init_distributed(dist_backend=backend_for(device.type), dist_init_required=False)

    from deepspeed.runtime.pipe.schedule import OptimizerStep
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    topology = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    _check_topology(topology, mesh)
    source = _Source(model)
    inputs = LayerInputs(model, parts, with_embeddings=pp_rank == 0)
    loss = MicroBatchLoss(model, microbatches)
    tied = shares_embedding(model)
    with torch.no_grad():  # DeepSpeed broadcasts the tied weight between its stages in place
        pipe = _presplit_module_class()(
            layer_specs(plan_layers(source, parts, counts, inputs)), layer_boundaries(counts, parts.num_layers),
            topology=topology, loss_fn=loss, activation_checkpoint_interval=0)
    skeleton = build_skeleton(model, parts, specs[pp_rank], pp)  # HF names for the same module objects
    source.model = None
    _check_same_parameters(pipe, skeleton)
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=_NeverSteps(pipe.parameters()),
                                      config=_ds_config(microbatches, dp), dist_init_required=False)
    engine._INSTRUCTION_MAP = {**type(engine)._INSTRUCTION_MAP, OptimizerStep: _skip_optimizer_step}
    duplicate = skeleton.get_output_embeddings().weight if tied and pp_rank == pp - 1 else None
    logger.info("applied PP over %d ranks with DeepSpeed's pipeline engine (x dp %d): layers per stage %s, "
                "%d micro-batches%s", pp, dp, counts, microbatches, ", tied embeddings" if tied else "")
    return DeepSpeedPipelineModel(engine, skeleton, specs[pp_rank], mesh, inputs, loss, microbatches, device,
                                  model.config, TiedViaDeepSpeed(duplicate) if tied else None)
