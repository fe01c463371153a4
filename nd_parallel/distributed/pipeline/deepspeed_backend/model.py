"""What the training loop sees of the DeepSpeed backend: a HF-shaped model, its loss, its tied weights.

The counterpart of ``torch_backend.PipelineModel``: ``model(**batch)`` runs a whole micro-batched training
step through DeepSpeed's engine and returns the global-token-mean loss on every rank. Kept apart from the
engine glue because this is the interface the plugin relies on, whichever backend runs underneath.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..split import StageSpec
from ..step_inputs import check_step_inputs, global_label_tokens
from ..torch_backend import PipelineLoss
from .layers import LayerInputs


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
        named = self._side_inputs(attention_mask, position_ids)
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

    def _side_inputs(self, attention_mask, position_ids) -> dict[str, torch.Tensor]:
        """The side tensors that travel with the activation, named for ``LayerInputs`` (set on it here)."""
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise NotImplementedError(f"pp_backend='deepspeed' takes a [batch, seq] attention_mask of 0/1 "
                                          f"(right padding), got shape {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.long()  # a float tuple element would be expected to carry a gradient
        named = {k: v for k, v in (("attention_mask", attention_mask), ("position_ids", position_ids))
                 if v is not None}
        self.inputs.fields = tuple(named)
        return named

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
