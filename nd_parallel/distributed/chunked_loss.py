"""The causal-LM loss without the full logits: cross-entropy over chunks of tokens, each chunk's head run once.

A Hugging Face causal LM computes ``logits = head(hidden)`` for the whole sequence, upcasts them to fp32 and
takes the cross-entropy: at a 128k vocabulary these [tokens, vocab] buffers are the largest tensors of a step.
Here the forward runs the decoder as the model does (its own forward, asked for the last position's logits
only), then ``_ChunkedCrossEntropy`` walks the tokens ``chunk`` at a time: the chunk's logits, their fp32
log-softmax, the loss sum and, at once, the gradients of that sum with respect to the chunk's hidden states and
the head's parameters. Those gradients are kept (the size of the hidden states and of the head's weight); the
chunk's logits are freed before the next chunk, so one chunk's logits are alive at a time, and backward only
scales the kept gradients. The FLOPs equal the unchunked loss's (one head matmul forward, two backward) — no
recomputation — which keeps the step time at today's.

Why by hand: torch has no fused linear + cross-entropy; Liger's and Apple's cut-cross-entropy kernels take a
plain weight matrix (plus at most a soft-cap), so a tied head under LoRA, Granite's ``logits_scaling``, Cohere's
``logit_scale`` or any other step a model's forward takes between its decoder and its loss would be silently
wrong; torchtune's chunked loss chunks logits already computed. The head here is *the model's own forward* run
on a chunk of hidden states with its decoder stubbed out (``_HeadProbe``), so every post-processing step a model
family writes is applied by the family's own code, and the first chunked call checks the probe against the logits
the real forward produced for the last position; a model whose head the probe does not reproduce falls back to
its own loss (one info line).

Most heads are one linear map: the first chunked call also checks that (linear_loss.py), and those heads take a
fast path written in torch ops that keeps one chunk's fp32 buffer and one fp32 head gradient instead of autograd's
per-chunk buffers and a second copy of the head's gradient. The generic path stays for every other head and for the
vocabulary-parallel one under TP. Either way backward scales the kept gradients in place and hands them to autograd.

Semantics are transformers' ``ForCausalLMLoss``: labels shifted left by one (or ``shift_labels`` as given, as
context parallelism does), ``ignore_index`` -100, the sum divided by ``num_items_in_batch`` when given (the
global token count ``loss.GlobalTokenLoss`` passes) and the mean over the label tokens otherwise.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutputWithPast

from nd_parallel.config.loss import loss_chunk_for
from nd_parallel.models.hf import decoder_slot, head_parameters

from .eaft import is_default_causal_lm_loss
from .linear_loss import LinearHead, linear_cross_entropy, linear_head
from .loss import IGNORE_INDEX, own_loss_unshifted
from .vocab_parallel import local_value, loss_context, sharded_logits, vocab_parallel_heads

logger = logging.getLogger(__name__)
_LOSS_KWARGS = ("labels", "num_items_in_batch", "shift_labels", "ignore_index")


class _StubOutput(BaseModelOutputWithPast):
    """The stub's output: the hidden states, and None for any other field a family's forward reads from its own
    output class (MoE forwards read ``outputs.router_logits`` even when they do not compute the router loss)."""

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return None


class _Stub(nn.Module):
    """Stands in for the decoder while the head runs: returns the given hidden states as the last hidden state."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        return _StubOutput(last_hidden_state=self.hidden)


class _HeadProbe:
    """hidden [b, c, h] -> logits [b, c, V] by the model's own forward, with its decoder replaced by ``_Stub``."""

    def __init__(self, model: nn.Module, forward: Callable, slot: str):
        self.model, self.forward, self.slot = model, forward, slot
        params = inspect.signature(forward).parameters
        # MoE forwards compute a router loss from the decoder's router logits, which the stub does not have.
        self.extra = {"output_router_logits": False} if "output_router_logits" in params else {}
        self.heads: list[nn.Module] | None = None  # vocabulary-parallel heads, found at the first call (after TP)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Under TP with a vocabulary-split head (vocab_parallel.py) the logits are a DTensor sharded on the
        vocabulary: this rank's [b, c, V/tp], never gathered."""
        if self.heads is None:
            self.heads = vocab_parallel_heads(self.model)
        modules = self.model._modules
        decoder = modules[self.slot]
        modules[self.slot] = _Stub(hidden)  # not setattr: no hook, no FSDP state sees the swap
        try:
            with sharded_logits(self.heads):
                return self.forward(use_cache=False, **self.extra).logits
        finally:
            modules[self.slot] = decoder


def _unlabelled_gradients(head: Callable, flat: torch.Tensor, params: tuple) -> list[torch.Tensor | None]:
    """The head's gradients where no token has a label (padding only; the tail of a dataset): zeros for every
    parameter the head uses, None for the others.

    The model's own loss builds the logits whatever the labels, so autograd gives the head's weight a zero
    gradient there; skipping every chunk would give it none. Under FSDP that is a different set of gradients on
    this rank than on its peers, and the root group's reduce-scatter then differs in size between ranks (a gloo
    "mismatch between collectives", a hang or wrong sums on NCCL). Which parameters the head uses is found by
    running it, as the chunks do, on one token whose label is ignored (loss 0, gradients exactly 0)."""
    if flat.shape[0] == 0:
        return [None] * len(params)
    ignored = torch.full((1,), IGNORE_INDEX, dtype=torch.long, device=flat.device)
    with torch.enable_grad():
        _, grads = _chunk_loss(head, flat[:1].detach(), ignored, list(params))
    return [None if g is None else torch.zeros_like(g, dtype=torch.float32) for g in grads]


def _chunk_loss(head: Callable, piece: torch.Tensor, target: torch.Tensor, wanted: list) -> tuple:
    """One chunk through the head: the sum of its cross-entropies and that sum's gradients w.r.t. ``wanted``."""
    logits = head(piece.unsqueeze(0))  # [1, c, V], or this tp rank's [1, c, V/tp] (vocab_parallel.py)
    with loss_context(logits):  # vocabulary-parallel: forward and backward under loss_parallel
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target, ignore_index=IGNORE_INDEX,
                               reduction="sum")
        grads = torch.autograd.grad(loss, wanted, allow_unused=True) if wanted else ()
    return loss, grads


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward: sum of the chunks' cross-entropies / denominator, with the gradients computed chunk by chunk.
    Backward: those gradients times the incoming gradient. ``params`` are the head's trainable tensors (as the
    model holds them during forward: FSDP's unsharded parameters, TP's DTensors), inputs so that their gradients
    reach them, and FSDP's hooks, through autograd as usual. ``head`` is the probe (any head) or a ``LinearHead``
    (linear_loss.py: one linear map, computed in place)."""

    @staticmethod
    def forward(ctx, head, chunk, denom, hidden, targets, *params):
        flat = hidden.detach().reshape(-1, hidden.shape[-1])  # [b*s, h]
        targets = targets.reshape(-1)
        grad_hidden = torch.zeros_like(flat) if hidden.requires_grad else None
        if isinstance(head, LinearHead):
            total, grad_params = _linear_chunks(head, chunk, flat, targets, grad_hidden, params)
        else:
            total, grad_params = _probe_chunks(head, chunk, flat, targets, grad_hidden, params)
        ctx.denom = denom
        ctx.dtypes = [hidden.dtype, *[p.dtype for p in params]]
        # Kept on ctx, not save_for_backward: the last backward hands these buffers over (see backward).
        ctx.grads = [None if grad_hidden is None else grad_hidden.view_as(hidden), *grad_params]
        return total / denom

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("backward through the chunked loss a second time: the first backward freed its "
                               "gradients; pass retain_graph=True to the first one")
        scale = grad_out / ctx.denom
        # A backward that frees the graph (the usual one) is the last use of the kept gradients: scale them in place
        # and hand them over, so autograd's AccumulateGrad adds them to (or takes them as) .grad without a second
        # V·h copy. One that keeps the graph (retain_graph=True, pipelining's split zero-bubble backward) copies.
        keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)()
        grads, out = ctx.grads, []
        if not keep:
            ctx.grads = None
        for g, dtype in zip(grads, ctx.dtypes):
            out.append(None if g is None else (g * scale if keep else g.mul_(scale)).to(dtype))
        del grads
        return (None, None, None, out[0], None, *out[1:])


def _probe_chunks(head, chunk, flat, targets, grad_hidden, params) -> tuple[torch.Tensor, list]:
    """Any head: the probe on each chunk, the chunk's gradients by autograd, the parameters' summed in fp32."""
    grad_params: list[torch.Tensor | None] = [None] * len(params)
    total = torch.zeros((), dtype=torch.float32, device=flat.device)
    with torch.enable_grad():
        for start in range(0, flat.shape[0], chunk):
            target = targets[start:start + chunk]
            if not bool((target != IGNORE_INDEX).any()):
                continue  # no label token: no loss, no gradient (same on every tp rank: they share tokens)
            piece = flat[start:start + chunk].detach().requires_grad_(grad_hidden is not None)
            wanted = [piece, *params] if grad_hidden is not None else list(params)
            loss, grads = _chunk_loss(head, piece, target, wanted)
            if grad_hidden is not None:
                grad_hidden[start:start + chunk] = grads[0]
                grads = grads[1:]
            _accumulate(grad_params, grads)
            total += local_value(loss.detach())
            del loss, grads  # this chunk's head gradient must not live into the next chunk's autograd.grad
    if params and not bool((targets != IGNORE_INDEX).any()):  # every chunk skipped: zeros, as the model's own loss
        grad_params = _unlabelled_gradients(head, flat, params)
    return total, grad_params


def _accumulate(grad_params: list, grads) -> None:
    """Adds one chunk's head gradients to the fp32 running sums (cast once at the end). A function, not a loop in
    ``_probe_chunks``: a loop variable there kept the chunk's gradient alive through the next chunk's autograd.grad,
    one head gradient more at the loss's peak (issue 21)."""
    for i, g in enumerate(grads):
        if g is not None:
            grad_params[i] = g.float() if grad_params[i] is None else grad_params[i].add_(g)


def _linear_chunks(head: LinearHead, chunk, flat, targets, grad_hidden, params) -> tuple[torch.Tensor, list]:
    """A linear head (linear_loss.py): the head's gradients accumulated in place in one fp32 buffer each."""
    weight, bias = head.weight, head.bias
    grad_params = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
    by_id = {id(p): g for p, g in zip(params, grad_params)}
    total = linear_cross_entropy(flat, targets, chunk, head, grad_hidden, by_id.get(id(weight)),
                                 None if bias is None else by_id.get(id(bias)))
    return total, grad_params


def chunked_cross_entropy(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                          shift_labels: torch.Tensor, chunk: int, params: list[torch.Tensor],
                          num_items_in_batch=None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on ``head(hidden)`` without ever holding more than ``chunk`` tokens'
    logits. ``shift_labels`` [b, s] are the already-shifted targets; ``params`` the head's tensors that need a
    gradient."""
    if num_items_in_batch is None:
        denom = (shift_labels != IGNORE_INDEX).sum().to(torch.float32)  # HF's mean: 0 tokens gives nan, as there
    else:
        denom = torch.as_tensor(num_items_in_batch, device=hidden.device).to(torch.float32)
    trainable = [p for p in params if p.requires_grad]
    return _ChunkedCrossEntropy.apply(head, chunk, denom, hidden, shift_labels.to(hidden.device), *trainable)


def shifted_targets(labels: torch.Tensor, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """HF's shift: tokens < n predict n, the last position predicts nothing (unless shifted already)."""
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _reproduces(probe: _HeadProbe, hidden: torch.Tensor, logits: torch.Tensor | None) -> bool:
    """Whether the probe gives the logits the real forward gave for the last position (checked once). The two run
    the same code on the same inputs, so they agree on any values (NaN too) unless the forward does something else."""
    if logits is None or hidden is None:
        return False
    try:
        with torch.no_grad():
            mine = probe(hidden[:, -1:].detach())
    except Exception as err:  # a forward that needs its real inputs after the decoder: not reproducible here
        logger.info("chunked loss: the head of %s cannot run alone (%s)", type(probe.model).__name__, err)
        return False
    if hasattr(mine, "full_tensor"):  # DTensor logits (a vocabulary-sharded head): compare the whole
        mine, logits = mine.full_tensor(), logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return mine.shape == logits.shape and bool(torch.allclose(mine.float(), logits.detach().float(),
                                                              rtol=1e-5, atol=1e-6, equal_nan=True))


class ChunkedHead:
    """The decoder's output and the chunked loss of one causal LM (or one pipeline stage's copy of it).

    ``run(forward_kwargs)`` calls the model's own forward asking for the last position's logits only and returns
    ``(output, hidden)``; the first call checks that the head can be run on chunks (``enabled``).
    ``loss(hidden, targets, num_items)`` is the chunked cross-entropy through the model's head: on linear_loss.py's
    fast path where the first call found the head to be one linear map (``linear``), else through the probe.
    ``chunk`` is the setting (``loss_chunk_size``: tokens, or "auto"); each loss call resolves it against the tokens
    it is given (``chunk_for``): this rank's b·s, after CP's split, one micro-batch under PP.
    """

    fast_linear = True  # False: every head takes the probe's path (benchmarks compare the two)

    def __init__(self, model: nn.Module, forward: Callable, chunk: int | str):
        self.model, self.forward, self.chunk = model, forward, chunk
        self.linear: LinearHead | None = None
        self.fast_linear = type(self).fast_linear  # as it was when the model was prepared
        self.slot = decoder_slot(model)
        self.enabled = self.slot is not None and "logits_to_keep" in inspect.signature(forward).parameters
        # A model whose forward computes its own cross-entropy on unshifted labels (cpmant) means another loss than
        # the shifted one computed here: it keeps its own.
        unshifted = self.enabled and own_loss_unshifted(model)
        # A loss function set on the model (EAFT's entropy weights, or a user's) is another loss than the plain
        # cross-entropy computed here: it gets the full logits.
        custom = self.enabled and not is_default_causal_lm_loss(model)
        self.enabled = self.enabled and not unshifted and not custom
        self.checked = not self.enabled
        if not self.enabled:
            why = "its forward computes its own loss on unshifted labels" if unshifted else \
                "its loss_function is not transformers' ForCausalLMLoss" if custom else \
                "no decoder slot or no logits_to_keep"
            logger.info("chunked loss off for %s: %s; it uses its own loss", type(model).__name__, why)
            return
        self.probe = _HeadProbe(model, forward, self.slot)
        self._hidden: torch.Tensor | None = None
        self._capture = False
        self.handle = model._modules[self.slot].register_forward_hook(self._keep)

    def _keep(self, module, args, output):
        if self._capture:
            self._hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state

    def run(self, **kwargs):
        self._capture = True
        if self.probe.heads is None:
            self.probe.heads = vocab_parallel_heads(self.model)
        try:
            with sharded_logits(self.probe.heads):  # the last position's logits, not gathered either
                out = self.forward(**kwargs, logits_to_keep=1)
        finally:
            self._capture = False
        hidden, self._hidden = self._hidden, None
        if not self.checked:
            self.enabled, self.checked = _reproduces(self.probe, hidden, out.logits), True
            if self.enabled and self.fast_linear:
                self.linear = linear_head(self.model, self.probe, hidden, head_parameters(self.model),
                                          bool(self.probe.heads))
            tokens = 0 if hidden is None else hidden.numel() // hidden.shape[-1]
            logger.info("chunked loss %s for %s (%d tokens per chunk of %d%s%s)", "on" if self.enabled else
                        "off: its head is not reproduced exactly", type(self.model).__name__,
                        self.chunk_for(tokens), tokens, ", auto" if self.chunk == "auto" else "",
                        ", linear head" if self.linear is not None else "")
        return out, hidden

    def chunk_for(self, tokens: int) -> int:
        """Tokens per chunk for a loss over ``tokens`` tokens (config/loss.py's ``loss_chunk_for``)."""
        return loss_chunk_for(self.chunk, tokens)

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        params = head_parameters(self.model)
        head = self.probe
        if self.linear is not None and self.linear.usable(hidden):
            own = (self.linear.weight, self.linear.bias)
            if all(any(p is o for o in own) for p in params if p.requires_grad):
                head = self.linear
        chunk = self.chunk_for(hidden.numel() // hidden.shape[-1])  # the rows chunked_cross_entropy walks
        return chunked_cross_entropy(head, hidden, targets, chunk, params, num_items_in_batch)

    def remove(self) -> None:
        if hasattr(self, "handle"):
            self.handle.remove()


class ChunkedLoss:
    """Installed on a HF causal LM (as an instance ``forward``): in a forward with labels that records gradients,
    the loss is computed by ``chunked_cross_entropy`` and ``outputs.logits`` is None; every other call (under
    ``torch.no_grad()`` as evaluation and ``generate`` run, no labels, a caller asking for ``logits_to_keep``) is
    the model's own forward.

    Install it after ``GlobalTokenLoss``, whose hooks read the model's own signature and pass the global token
    count in as ``num_items_in_batch``.
    """

    def __init__(self, model: nn.Module, chunk: int | str):
        self.model = model
        self.original = model.forward  # the bound forward of the model's class
        self.signature = inspect.signature(self.original)
        # inspect.signature(model.forward) keeps answering with the model's own parameters (the Trainer picks the
        # dataset columns it keeps from them; loss.GlobalTokenLoss looks for num_items_in_batch).
        self.__signature__ = self.signature
        self.head = ChunkedHead(model, self.original, chunk)
        if self.head.enabled:
            model.forward = self

    def remove(self) -> None:
        self.head.remove()
        self.model.__dict__.pop("forward", None)

    def _chunks(self, call: dict) -> bool:
        # A forward that records gradients, not ``model.training``: transformers' from_pretrained returns a model in
        # eval mode and an Accelerate loop need not call train(); evaluation is model.eval() + torch.no_grad().
        return (self.head.enabled and call.get("labels") is not None and torch.is_grad_enabled()
                and not call.get("logits_to_keep") and call.get("return_dict") is not False)

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind_partial(*args, **kwargs).arguments
        extra = bound.pop("kwargs", {}) if "kwargs" in self.signature.parameters else {}
        call = {**bound, **extra}
        if not self._chunks(call):
            return self.original(*args, **kwargs)
        loss_kwargs = {k: call.pop(k) for k in _LOSS_KWARGS if k in call}
        out, hidden = self.head.run(**call)
        if not self.head.enabled:  # once: the head is not reproduced, so this call runs the model's own forward again
            del out, hidden
            return self.original(*args, **kwargs)
        targets = shifted_targets(loss_kwargs["labels"], loss_kwargs.get("shift_labels"))
        loss = self.head.loss(hidden, targets, loss_kwargs.get("num_items_in_batch"))
        aux = getattr(out, "aux_loss", None)
        if aux is not None:  # MoE: transformers adds the router loss where labels are given
            loss = loss + getattr(self.model, "router_aux_loss_coef", 0.0) * aux.to(loss.device)
        out.loss, out.logits = loss, None
        return out
