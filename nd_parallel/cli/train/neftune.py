"""Axolotl's ``neftune_noise_alpha`` (NEFTune, arXiv 2310.05914; ``noisy_embedding_alpha`` is its older name) in
`nd-parallel train`: in training, uniform noise in [-alpha / sqrt(L x d), +alpha / sqrt(L x d)] is added to the input
embeddings, L the micro-batch's (padded) length and d the hidden size, as transformers' neftune_post_forward_hook does.

Written by hand: transformers draws the noise from torch's global generator, whose stream depends on how many rows
each rank holds. Here each row's noise comes from a generator keyed by (seed, step, the row's tokens), so one process
and every data-parallel layout (and each pipeline stage's micro-batches) add the same noise to the same row. L is the
padded length, as in transformers: rows padded to sequence_len (sample_packing, pad_to_sequence_len) get the same
scale wherever they land; otherwise the scale follows each micro-batch's padding, in one process too.
"""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback


class KeyedNEFTune(TrainerCallback):
    """The noise hook on ``model``'s input embeddings; the step it keys by, from ``on_step_begin``."""

    def __init__(self, model, alpha: float, seed: int):
        self.alpha, self.seed, self.step = float(alpha), seed, 0
        model.get_input_embeddings().register_forward_hook(self.hook)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step
        return control

    def hook(self, module, args, output):
        if not module.training or not args or not torch.is_tensor(args[0]):
            return output
        from nd_parallel.plugins.trainer.relora import keyed_generator, tokens_key

        ids = args[0]
        rows, length, width = output.shape
        bound = self.alpha / math.sqrt(length * width)
        noise = torch.stack([torch.rand(length, width, generator=keyed_generator(
            self.seed, self.step, tokens_key(ids[i]))) for i in range(rows)])
        return output + ((noise * 2 - 1) * bound).to(output.device, output.dtype)
