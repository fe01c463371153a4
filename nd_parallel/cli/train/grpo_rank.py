"""The ranks' side of `rl: grpo | gdpo | ebft` (grpo.py has the config stage and the data): TRL's GRPOTrainer with
keyed sampling (``KeyedSampling``) and nd_parallel's 1/dp loss shares, built on each rank once the model exists."""

from __future__ import annotations

import zlib

from . import grpo_async
from .grpo import ARGS, generation_settings, is_transform, load_function, reads_generation_kwargs


class KeyedSampling:
    """A logits processor that samples each row's next token itself: Gumbel-max over the distribution that
    transformers' sampling would draw from (the same warpers, built from the generation config), with noise from a
    generator keyed by (seed, round, the row's global index, the completion position). It returns -inf everywhere but
    the chosen token, so whatever sampling follows picks that token. Written by hand: transformers' sampling draws
    from torch's global generator, whose stream depends on how many rows a rank holds."""

    def __init__(self, generation_config, seed: int, round_: int, first_row: int):
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        g = generation_config
        self.warpers = LogitsProcessorList(
            ([TemperatureLogitsWarper(g.temperature)] if g.temperature not in (None, 1.0) else [])
            + ([TopKLogitsWarper(g.top_k)] if g.top_k else [])
            + ([TopPLogitsWarper(g.top_p)] if g.top_p is not None and g.top_p < 1.0 else [])
            + ([MinPLogitsWarper(g.min_p)] if g.min_p is not None else []))
        self.key, self.first_row, self.start = (seed, round_), first_row, None

    def noise(self, row: int, position: int, vocab: int):
        import torch

        from nd_parallel.plugins.trainer.relora import keyed_generator

        where = zlib.crc32(f"{self.first_row + row}:{position}".encode())
        uniform = torch.rand(vocab, generator=keyed_generator(*self.key, where), dtype=torch.float64)
        return -torch.log(-torch.log(uniform.clamp(min=1e-300)))

    def __call__(self, input_ids, scores):
        import torch

        if self.start is None:  # the first call sees the (left-padded) prompts alone
            self.start = input_ids.shape[1]
        position = input_ids.shape[1] - self.start
        logp = torch.log_softmax(self.warpers(input_ids, scores).double(), dim=-1)
        noise = torch.stack([self.noise(b, position, scores.shape[-1]) for b in range(scores.shape[0])])
        chosen = (logp + noise.to(logp.device)).argmax(dim=-1)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, chosen[:, None], 0.0)


def trainer(t, trainer_args: dict, **parts):
    """TRL's GRPOTrainer for ``t`` (rl: grpo / gdpo / ebft) with keyed sampling (KeyedSampling); for ebft its one
    reward is ebft.FeatureMatchingReward."""
    import torch.distributed as dist
    import trl

    from nd_parallel.plugins.trainer.dpo import global_mean_share

    from . import ebft

    if ebft.strided({"rl": t.rl, "ebft": t.ebft}):  # not TRL: transformers' Trainer with the strided loss
        from . import ebft_strided

        return ebft_strided.trainer(t, trainer_args, **parts)

    block = dict(t.trl or {})
    kwargs = {k: v for k, v in block.items() if k in ARGS and v is not None}
    if reads_generation_kwargs(t.rl, block):  # Axolotl's EBFT / async configs take these (vLLM's, translated)
        settings, stop, _ = generation_settings(block.get("generation_kwargs"))
        kwargs.update({"chat_template_kwargs": block.get("chat_template_kwargs"), "generation_kwargs": settings})
        ends = parts["model"].generation_config.eos_token_id
        ends = [] if ends is None else [ends] if isinstance(ends, int) else list(ends)
        parts["model"].generation_config.eos_token_id = ends + [i for i in stop if i not in ends] or None
    if t.rl == "gdpo":
        kwargs.setdefault("multi_objective_aggregation", "normalize_then_sum")
    beta = block["beta"] if block.get("beta") is not None else t.rl_beta  # Axolotl: trl.beta, else rl_beta
    args = trl.GRPOConfig(**{**trainer_args, "gradient_checkpointing": False, "beta": 0.0 if beta is None else
                             float(beta), **kwargs})
    if t.rl == "ebft":
        from . import ebft

        reward = ebft.FeatureMatchingReward(t.ebft, ebft.frozen_copy(t, parts["model"]))
        funcs = [reward]
    else:
        funcs = [name if not is_transform(name) else load_function(name, t.import_dirs)
                 for name in block["reward_funcs"]]

    class KeyedGRPOTrainer(trl.GRPOTrainer):
        rounds = 0
        stale = None  # trl.async_prefetch: the weights generation runs with (grpo_async.py)

        def _generate_and_score_completions(self, inputs):  # with trl.async_prefetch: an earlier step's policy
            return grpo_async.generate_and_score(self, super()._generate_and_score_completions, inputs)

        def _generate_single_turn(self, prompt_ids, *args, **kw):
            counts = [len(prompt_ids)]
            if dist.is_initialized():  # the global generation batch is the ranks' batches in rank order
                counts = [None] * dist.get_world_size()
                dist.all_gather_object(counts, len(prompt_ids))
            rank = dist.get_rank() if dist.is_initialized() else 0
            sampler = KeyedSampling(self.generation_config, self.args.seed, self.rounds, sum(counts[:rank]))
            self.rounds += 1
            model = self.accelerator.unwrap_model(self.model_wrapped)
            plain = model.generate
            model.generate = lambda *a, **k: plain(*a, logits_processor=[sampler], **k)
            try:
                return super()._generate_single_turn(prompt_ids, *args, **kw)
            finally:
                del model.generate  # the class's method again

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            # TRL scales each rank's loss for DDP's mean over the ranks; nd_parallel sums the dp gradients: each
            # rank's loss enters as 1/dp of the mean (its value the ranks' mean, what TRL logs)
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return global_mean_share(self, loss, 1)

    trainer = KeyedGRPOTrainer(reward_funcs=funcs, args=args, **parts)
    if block.get("async_prefetch"):
        trainer.stale = grpo_async.StaleWeights(trainer, block.get("prefetch_depth") or 1)
        trainer.add_callback(trainer.stale)
    if t.rl == "ebft":
        reward.trainer = trainer
        if reward.frozen is not None:
            reward.frozen.to(trainer.accelerator.device)
    return trainer
