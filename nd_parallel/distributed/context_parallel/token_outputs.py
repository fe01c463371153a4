"""Per-token outputs of a sequence shard put back into the whole sequence, with their gradients (for losses that
are not token means: DPO sums each sequence's log-probs, then mixes sequences nonlinearly; ORPO does the same with
the whole logits, ``gathered_logits``).

TRL's fused LM head (``add_fused_lm_head``, TRL 1.16) returns per-token fields (log-probs, entropy, ...) instead of
logits. Under CP each rank computes them for its own tokens; a loss built from per-sequence sums needs every token.
``gathered_token_outputs`` all-gathers each field back into sequence order. Every cp rank then computes the same
loss from the same whole tensors, and its backward hands each rank the gradient of its own positions only (the
others' positions are other ranks' tokens): summed over the cp ranks by the data-parallel gradient reduction, that
is the one-process gradient, as with the token-mean loss's shares.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .sharding import padded_length, token_index, unshard

TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def gather_sequence(local: torch.Tensor, runtime, seq_len: int) -> torch.Tensor:
    """Every rank's shard of an output (B, S_local, ...) put back into the full sequence (no gradient)."""
    pieces = [torch.empty_like(local) for _ in range(runtime.size)]
    dist.all_gather(pieces, local.detach().contiguous(), group=runtime.group)
    return unshard(pieces, seq_len, runtime.load_balance)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, runtime, seq_len):
        ctx.runtime, ctx.seq_len = runtime, seq_len
        return gather_sequence(local, runtime, seq_len)

    @staticmethod
    def backward(ctx, grad):
        r = ctx.runtime
        padded = padded_length(ctx.seq_len, r.size, r.load_balance)
        grad = F.pad(grad, (0, 0) * (grad.dim() - 2) + (0, padded - ctx.seq_len))
        return grad[:, token_index(r.rank, r.size, padded, r.load_balance, grad.device)], None, None


def gathered_logits(local: torch.Tensor, runtime, seq_len: int) -> torch.Tensor:
    """The logits of the whole sequence [B, S, V], differentiable where ``local`` records a gradient (TRL's
    ORPOTrainer: its loss mixes every token's logits into per-sequence means, on every cp rank)."""
    return _GatherSequence.apply(local, runtime, seq_len) if local.requires_grad else gather_sequence(
        local, runtime, seq_len)


def gathered_token_outputs(output, runtime, seq_len: int, drop_last: bool):
    """``output`` with each per-token field of the whole sequence [B, S] (differentiable); ``drop_last``: [B, S-1],
    the shape an unshifted ``labels`` call returns (the last position predicts nothing)."""
    for name in TOKEN_FIELDS:
        local = getattr(output, name, None)
        if local is None:
            continue
        whole = gathered_logits(local, runtime, seq_len)
        setattr(output, name, whole[:, :-1] if drop_last else whole)
    return output
