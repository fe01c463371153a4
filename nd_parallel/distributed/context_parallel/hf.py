"""Context parallelism for an unmodified HF causal LM.

Two hooks make it work without touching the model's code:

- the attention: our ring / Ulysses kernels are registered in transformers' ``AttentionInterface`` under
  ``ATTENTION_NAME`` and the model is switched to it, so every attention layer of every model that dispatches
  through the interface (``_supports_attention_backend``) runs CP. transformers builds no mask for an
  implementation it does not know, so nothing of size S x S is ever made; the kernels mask from the global
  token positions instead.
- the batch: a forward pre-hook cuts the full batch into this rank's share of the sequence (sharding.py).
  The per-token key metadata (padding, packed documents) of the *whole* sequence rides along as two extra
  keyword tensors, ``nd_cp_valid`` / ``nd_cp_doc``, which transformers passes down to the attention function;
  being batch-first tensors they are also split correctly into pipeline micro-batches.

The process group and backend are not tensors: they live in a context variable set for the duration of the
forward (the kernels keep what their backward needs).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from nd_parallel.models.attention_calls import attention_keywords, computed_attention_masks
from nd_parallel.models.hf import find_layer_stack, sequence_mixers, text_config

from ..classification import head_kind
from .pooled_head import PooledHead
from .sharding import ShardedBatch, isolates_documents, shard_batch, token_index
from .token_outputs import gather_sequence, gathered_logits, gathered_token_outputs

logger = logging.getLogger("nd_parallel")

ATTENTION_NAME = "nd_parallel_cp"
META_KEYS = ("nd_cp_valid", "nd_cp_doc")


@dataclass
class CPRuntime:
    """What the attention function needs besides tensors: the cp group and how the sequence was cut."""

    group: object
    size: int
    rank: int
    backend: str
    load_balance: bool
    mesh: object = None  # the cp DeviceMesh (cp_backend="torch" hands it to torch's context_parallel)

    def metas(self, valid: torch.Tensor, doc: torch.Tensor | None):
        """Every cp rank's key metadata, cut from the full-sequence tensors every rank holds."""
        from .attention import KVMeta

        padded = valid.shape[1]
        out = []
        for r in range(self.size):
            index = token_index(r, self.size, padded, self.load_balance, valid.device)
            out.append(KVMeta(index=index, valid=valid[:, index], doc=None if doc is None else doc[:, index]))
        return out


_ACTIVE: contextvars.ContextVar[CPRuntime | None] = contextvars.ContextVar("nd_parallel_cp", default=None)


@contextlib.contextmanager
def active(runtime: CPRuntime):
    token = _ACTIVE.set(runtime)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def cp_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                         softcap=None, nd_cp_valid=None, nd_cp_doc=None, s_aux=None, **kwargs):
    """transformers attention-function signature; q/k/v are (B, H, S_local, D), returns (B, S_local, H, D)."""
    runtime = _ACTIVE.get()
    if runtime is None or nd_cp_valid is None:
        raise RuntimeError(
            f"{type(module).__name__} runs the context-parallel attention outside a context-parallel forward "
            "(the model did not pass nd_parallel's sequence metadata down to its attention layers); call the model "
            "prepared by accelerator.prepare, and with cp_size=1 for models that do not forward attention kwargs"
        )
    if dropout:
        raise NotImplementedError(
            f"attention dropout {dropout} under context parallelism: the kernels are exact and dropout-free; set the "
            "model's attention_dropout to 0"
        )
    if attention_mask is not None:
        raise RuntimeError("the context-parallel attention got a mask from transformers; masks are built from the "
                           "global token positions instead, so this model is not supported under cp_size > 1")
    if query.device.type == "meta":  # shape inference (pipeline stages): no data, so no communication
        return torch.empty_like(query).transpose(1, 2).contiguous(), None
    from .attention import ring_attention, ulysses_attention

    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    sinks = s_aux.to_local() if isinstance(s_aux, DTensor) else s_aux  # TP: this rank's heads' sinks
    if runtime.backend == "torch":
        if sinks is not None:
            raise NotImplementedError(f"{type(module).__name__} has attention sinks (s_aux), which torch's context "
                                      "parallel SDPA cannot add to its softmax; use cp_backend='ring' or 'ulysses'")
        out = torch_cp_attention(runtime, query, key, value, scale=scale, causal=causal)
        return out.transpose(1, 2).contiguous(), None
    kernel = ulysses_attention if runtime.backend == "ulysses" else ring_attention
    # The kernels communicate (P2P / all-to-all) from inside their autograd Functions. Selective activation
    # checkpointing observes ops through a dispatch mode and replays some of them from a cache while re-running
    # others; splitting a ring's sends and receives that way desynchronises the ranks (a hang). So the kernels run
    # with dispatch modes off: SAC sees none of their ops, and a recomputation re-runs the whole kernel,
    # communication included, on every cp rank alike (activation_checkpoint.py).
    with _no_dispatch_modes():
        out = kernel(query, key, value, runtime.group, runtime.metas(nd_cp_valid, nd_cp_doc), scale=scale,
                     causal=causal, sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def _no_dispatch_modes():
    """Dispatch modes off while selective checkpointing's are on the stack (other modes, e.g. memory trackers,
    keep seeing the kernels' ops)."""
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

    if not any(type(m).__module__ == "torch.utils.checkpoint" for m in _get_current_dispatch_mode_stack()):
        return contextlib.nullcontext()
    return _disable_current_modes()


def torch_cp_attention(runtime: CPRuntime, query, key, value, *, scale: float, causal: bool):
    """cp_backend="torch": torch's own ring (torch.distributed.tensor.experimental.context_parallel) on CUDA.

    Its SDPA dispatcher runs the flash / efficient / cuDNN kernels block by block and assumes the same
    head-and-tail chunk layout as sharding.py when load balancing is on. It supports causal attention without
    a mask only: right padding is fine (a padded key is only ever seen by later, padded queries), the rest is
    refused up front (check_model, check_torch_batch). Not exercised on this project's CPU CI.
    """
    # torch's public ``context_parallel(mesh, buffers=[])`` reads ``buffers[0]`` in torch 2.13 (IndexError) and
    # derives load balancing from the buffers; our batch is already sharded, so only its SDPA dispatcher is entered,
    # in the monkey-patch mode ``context_parallel`` selects.
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    if not causal:
        raise NotImplementedError("cp_backend='torch' supports causal attention only; use cp_backend='ring'")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # torch's CP SDPA takes equal head counts
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    old = cp._cp_options.enable_load_balance
    cp._dispatch_mode = cp._DispatchMode.MONKEY_PATCH
    cp._cp_options.enable_load_balance = runtime.load_balance
    cp._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=runtime.mesh)
    try:
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
    finally:
        cp._disable_context_parallel_dispatcher_impl()
        cp._cp_options.enable_load_balance = old


def check_torch_batch(sharded: ShardedBatch) -> None:
    """cp_backend="torch" has no mask: refuse padding that is not at the end of a row, and packed rows."""
    if sharded.doc is not None:
        raise NotImplementedError("cp_backend='torch' cannot mask packed documents apart; use cp_backend='ring'")
    valid = sharded.valid.int()
    if (valid[:, 1:] > valid[:, :-1]).any():
        raise NotImplementedError("cp_backend='torch' supports right padding only (a 0 of the attention_mask before "
                                  "a 1 was found); use cp_backend='ring', which masks any padding")


def register_attention() -> None:
    from transformers import AttentionInterface

    from ..compile import keep_out

    # Under compile=True the ring's point-to-point exchange stays out of the compiled region (compile.py).
    AttentionInterface.register(ATTENTION_NAME, keep_out(cp_attention_forward))


# ----------------------------------------------------------------------------------------------- checks
def check_model(model: nn.Module, config, device_type: str) -> None:
    """Everything CP needs from a model, checked before any collective."""
    name = type(model).__name__
    if config.cp_backend == "torch" and device_type != "cuda":
        raise NotImplementedError(
            f"cp_backend='torch' uses torch.distributed.tensor.experimental.context_parallel, which runs on CUDA only "
            f"(this run is on {device_type}: torch has no sharding rule for the CPU attention kernel); use "
            "cp_backend='ring' (default) or 'ulysses', which run everywhere"
        )
    if config.cp_backend == "torch":
        if any("s_aux" in keywords for keywords in _attention_inputs(model).values()):
            raise NotImplementedError(
                f"{name} has attention sinks (s_aux), which cp_backend='torch' (plain causal SDPA) cannot add to its "
                "softmax; use cp_backend='ring' or 'ulysses'")
        text = text_config(model)
        if getattr(text, "attn_logit_softcapping", None) or getattr(text, "sliding_window", None):
            raise NotImplementedError(
                f"{name} uses soft-capping or sliding-window attention, which cp_backend='torch' (plain causal SDPA) "
                "cannot express; use cp_backend='ring'"
            )
    check_sequence_mixing(model)  # first: a hybrid's own attention code is not the reason to give
    if not getattr(model, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"{name} computes attention in its own code instead of dispatching through transformers' "
            "AttentionInterface, so context parallelism cannot replace it; use cp_size=1 for this model"
        )
    if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values()):
        raise NotImplementedError(
            f"{name}.forward takes no **kwargs, so it cannot hand its loss the pre-shifted labels context parallelism "
            "needs (shift_labels); use cp_size=1 for this model"
        )
    text = text_config(model)
    dropout = getattr(text, "attention_dropout", 0.0) or 0.0
    if dropout:
        raise NotImplementedError(
            f"{name} has attention_dropout={dropout}: the context-parallel attention is exact and has no dropout; "
            "load the model with attention_dropout=0.0"
        )
    impl = getattr(text, "_attn_implementation", None)
    if impl not in (None, "eager", "sdpa", ATTENTION_NAME):
        logger.warning("cp_size=%d replaces %s's attention implementation %r by the context-parallel one",
                       config.cp_size, name, impl)
    if config.cp_backend == "ulysses":
        from .attention import check_ulysses_heads

        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        if heads % config.tp_size or kv_heads % config.tp_size:
            return  # tensor_parallel.check_divisibility reports this one
        check_ulysses_heads(heads // config.tp_size, kv_heads // config.tp_size, config.cp_size)


# What the kernels honour of the keywords an attention layer passes to the attention function: the mask
# (refused: masks come from global positions), dropout (refused unless 0), scaling, the causal flag, sliding
# windows, soft-capping, attention sinks (s_aux), and position_ids / output_attentions (no effect on the math).
HANDLED_KEYWORDS = frozenset({"attention_mask", "dropout", "scaling", "is_causal", "sliding_window", "softcap",
                              "s_aux", "position_ids", "output_attentions", "query", "key", "value"})


def check_sequence_mixing(model: nn.Module) -> None:
    """Refuse, naming the module, a model whose layers mix tokens where the context-parallel attention does not
    see it: a convolution or scan along the sequence (models.hf.sequence_mixers), or an attention call carrying
    an input the kernels do not apply (an additive position bias, sparse-attention indices, ...). Splitting the
    sequence would silently change either."""
    name = type(model).__name__
    mixers = sequence_mixers(model)
    if mixers:
        more = f" (and {len(mixers) - 1} more)" if len(mixers) > 1 else ""
        raise NotImplementedError(
            f"{name} mixes tokens along the sequence outside attention: {mixers[0]}{more}. Context parallelism "
            "splits the sequence over the cp ranks and would cut that mixing at every shard boundary, so it is "
            "refused for this model; use cp_size=1 (tp_size / pp_size / dp_shard_size split it instead)")
    found = find_layer_stack(model)
    for kind in {type(m) for m in (found[1].modules() if found else ())}:
        masks = computed_attention_masks(kind)
        if masks:
            raise NotImplementedError(
                f"{kind.__name__} computes its own attention mask ({masks[0]}) and passes it to its attention "
                "function; the context-parallel kernels build masks from the global token positions and cannot "
                f"split one computed from this rank's tokens; use cp_size=1 for {name}")
    for kind, keywords in _attention_inputs(model).items():
        unknown = sorted(keywords - HANDLED_KEYWORDS)
        if unknown:
            raise NotImplementedError(
                f"{kind} passes {unknown} to its attention function, which the context-parallel "
                f"kernels do not apply (they implement masks, windows, soft-capping and sinks); use cp_size=1 for "
                f"{name}")


def _attention_inputs(model: nn.Module) -> dict[str, frozenset[str]]:
    """Class name -> the keywords it passes to the attention function, for every module of the layer stack."""
    found = find_layer_stack(model)
    modules = [] if found is None else found[1].modules()
    return {type(m).__name__: keywords for m in modules if (keywords := attention_keywords(type(m)))}


def use_cp_attention(model: nn.Module) -> None:
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)


# ------------------------------------------------------------------------------------------ the batch
def pad_token_id(model: nn.Module) -> int:
    text = text_config(model)
    pad = getattr(text, "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < text.vocab_size else 0


def shard_inputs(inputs: dict, runtime: CPRuntime, pad_id: int, isolate_documents: bool) -> ShardedBatch:
    """This rank's share of a batch, with the key metadata added as model keyword arguments."""
    sharded = shard_batch(inputs, runtime.rank, runtime.size, runtime.load_balance, pad_id, isolate_documents)
    if runtime.backend == "torch":
        check_torch_batch(sharded)
    sharded.kwargs["nd_cp_valid"] = sharded.valid
    if sharded.doc is not None:
        sharded.kwargs["nd_cp_doc"] = sharded.doc
    return sharded


class SequenceSharding:
    """Forward hooks on a prepared (non-pipelined) model: shard the batch in, run under the CP runtime.

    With labels the output is this rank's loss share (loss.py turns it into the global mean). Without labels, or
    under ``torch.no_grad()``, the logits are gathered back into the full sequence, so evaluation code sees what
    one process returns.
    """

    def __init__(self, model: nn.Module, runtime: CPRuntime):
        self.runtime = runtime
        self.pad_id = pad_token_id(model)
        self.model_config = model.config
        self.signature = inspect.signature(model.forward)
        self.positions_of = _positions_from_ids(model)
        self._state: list = []
        self.per_token_outputs = False  # gather TRL's per-token outputs / logits with gradients (token_outputs.py)
        self.handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._post, with_kwargs=True, always_call=True),
        ]
        # Refused up front: generate() would prefill through the hooks and fail at the first one-token step.
        self.model = model
        model.generate = _generate_refused
        # a reward model's head pools a token one rank holds (pooled_head.py); its pre-hook runs before the cut
        self.pooled = PooledHead(model, runtime) if head_kind(model) == "sequence" else None

    def _pre(self, module, args, kwargs):
        if any(k in kwargs for k in META_KEYS):
            return None  # already sharded (a nested call)
        inputs = dict(self.signature.bind_partial(*args, **kwargs).arguments)
        for p in self.signature.parameters.values():  # flatten **kwargs back into keyword arguments
            if p.kind is p.VAR_KEYWORD:
                inputs.update(inputs.pop(p.name, {}))
        if any(inputs.get(k) is not None for k in ("past_key_values", "cache")):  # renamed "cache" in 5.2x
            raise NotImplementedError("a KV cache (past_key_values) under context parallelism: generation is not "
                                      "sequence-parallel; generate with an unprepared model")
        if inputs.get("position_ids") is None and inputs.get("input_ids") is not None and self.positions_of:
            inputs["position_ids"] = self.positions_of(inputs["input_ids"])  # of the whole rows, before the cut
        isolate = isolates_documents(self.model_config, inputs.pop("use_cache", None))
        inputs["use_cache"] = False  # a KV cache of a sequence shard is of no use
        shifted = inputs.get("shift_labels") is not None  # else a per-token output is one shorter (unshifted labels)
        sharded = shard_inputs({k: v for k, v in inputs.items() if v is not None}, self.runtime, self.pad_id, isolate)
        token = _ACTIVE.set(self.runtime)
        self._state.append((token, sharded.seq_len, "labels" in sharded.kwargs, shifted))
        return (), sharded.kwargs

    def _post(self, module, args, kwargs, output):
        if not self._state:
            return None
        token, seq_len, has_labels, shifted = self._state.pop()
        _ACTIVE.reset(token)
        if self.pooled is not None:  # one row of logits per sequence, already those of the whole sequence
            return None
        if self.per_token_outputs and getattr(output, "label_mask", None) is not None:  # TRL's fused LM head
            return gathered_token_outputs(output, self.runtime, seq_len, drop_last=not shifted)
        # Training with labels needs only the loss; evaluation returns the logits one process would.
        if (has_labels and torch.is_grad_enabled()) or getattr(output, "logits", None) is None:
            return None
        # TRL's ORPOTrainer builds its loss from the whole logits of a training forward: gathered with gradients
        output.logits = (gathered_logits if self.per_token_outputs else gather_sequence)(output.logits, self.runtime,
                                                                                          seq_len)
        return output

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        if self.pooled is not None:
            self.pooled.remove()
        self.model.__dict__.pop("generate", None)


def _positions_from_ids(model: nn.Module):
    """The model's own default position ids where it derives them from the token ids (RoBERTa-style embeddings:
    padding_idx + 1 + the count of non-pad tokens so far), else None (positions 0..S-1, what shard_batch assumes).
    A rank computing them from its shard alone would restart the count, so they are computed on the whole rows."""
    for module in model.modules():
        make = getattr(module, "create_position_ids_from_input_ids", None)
        pad = getattr(module, "padding_idx", None)
        if callable(make) and isinstance(pad, int):
            return lambda ids: make(ids, pad)
    return None


def _generate_refused(*args, **kwargs):
    raise NotImplementedError("generate() under context parallelism: generation is not sequence-parallel (each "
                              "decoding step adds one token, which cannot be split over the cp ranks); save the model "
                              "(accelerator.save_model) and generate with it unprepared, or use a layout without cp")


def runtime_for(mesh, config) -> CPRuntime:
    return CPRuntime(group=mesh["cp"].get_group(), size=config.cp_size, rank=mesh.local_rank("cp"),
                     backend=config.cp_backend, load_balance=config.cp_load_balance, mesh=mesh["cp"])
