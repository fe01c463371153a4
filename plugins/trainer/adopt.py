"""Run an unchanged ``transformers.Trainer`` under a layout: what ``nd_parallel.plugins.trainer`` calls.

The Trainer (5.16 - 5.24) creates its Accelerator inside ``__init__`` and prepares the model, optimizer and
dataloaders only in ``train()`` / the first ``evaluate()``, all through that Accelerator. So attaching the plugin
to it between the two (``adopt``) routes prepare, backward, clipping and state dicts through nd_parallel. Four
Trainer habits still have to be turned, on this one Trainer instance:

- **Loss normalisation.** With ``average_tokens_across_devices`` the Trainer all-gathers its token count over
  *every* process and multiplies the loss by ``num_processes // tp_size``: under PP/CP (ranks sharing a batch)
  that counts tokens twice, and our gradients are summed, not averaged. With it off, the Trainer passes this
  rank's own count over the accumulated micro-batches, which is exactly the caller-given count loss.py adds over
  the dp ranks: the loss is then the global-token mean of the whole accumulated batch, on every rank.
- **Gradient norm.** Its "mixed mesh" norm (for FSDP2xTP2 grads on two meshes) neither sums pipeline stages nor
  skips a tied copy; ``accelerator.clip_grad_norm_`` (ours) does both.
- **Checkpoints.** Outside its FSDP/DeepSpeed branches the Trainer saves ``save_pretrained`` weights and a rank-0
  ``torch.save`` of the optimizer, i.e. one rank's shards. Its model / optimizer / RNG save and load steps go to
  ``accelerator.save_state`` / ``load_state`` (sharded DCP, loadable under another layout) in
  ``<checkpoint>/nd_parallel``; ``trainer_state.json``, rotation and the data position stay the Trainer's.
- **save_model.** ``accelerator.save_model``: the full HF model, or the adapter of a PEFT model. With
  ``save_only_model`` a checkpoint is that alone (no sharded state): it loads with from_pretrained and is refused
  as a resume point (``_check_resumable``), before any collective. ``load_best_model_at_end`` reads the best
  checkpoint's model back from its sharded state (``_load_best_model``).
- **Evaluation model.** The evaluation loop runs ``_wrap_model(self.model)``, and ``self.model`` stays the model
  given to the Trainer. Where prepare returned another module (the pipeline's ``PipelineModel``: the stages were
  split off the HF model, which keeps stale weights) it would evaluate that stale unsplit model; it gets the
  prepared one (``model_wrapped``), whose ``eval()`` + ``no_grad`` forward runs the forward-only schedule.

TRL's SFTTrainer computes its loss and metrics itself: sft.py turns them (check_sft_args before any collective,
adopt_sft after the habits above); its DPOTrainer a mean over pairs: dpo.py (check_dpo_args, adopt_dpo); its
KTOTrainer a mean over examples: kto.py; its ORPOTrainer a token mean plus a pair mean: orpo.py; its RewardTrainer a
mean over pairs: reward.py.

TrainingArguments(bf16=True) reaches nd_parallel as the Accelerator's ``mixed_precision`` (FSDP2 policy, fp32
master weights); gradient_checkpointing=True calls the model's checkpointing switch in ``train()`` before prepare,
where the plugin turns HF's off and applies its own "full" mode.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import types

from nd_parallel.accelerate.accelerate_config import refuse_different_sizes

from .cpo import adopt_cpo, check_cpo_args, is_cpo_trainer
from .dpo import adopt_dpo, check_dpo_args, is_dpo_trainer, turn_off_chunked_loss
from .kto import adopt_kto, check_kto_args, is_kto_trainer
from .orpo import adopt_orpo, check_orpo_args, is_orpo_trainer
from .reward import adopt_reward, check_reward_args, is_reward_trainer
from .sft import adopt_sft, check_sft_args, is_sft_trainer

logger = logging.getLogger("nd_parallel")

STATE_DIR = "nd_parallel"  # inside the Trainer's checkpoint-<step> folder


def check_trainer_args(args, accelerator, config) -> None:
    """TrainingArguments that would make Accelerate parallelize on its own, refused before any collective."""
    fights = []
    if getattr(args, "fsdp", None):
        fights.append((f"fsdp={args.fsdp!r}", "drop fsdp= (dp_shard_size shards the model)"))
    if getattr(args, "deepspeed", None):
        fights.append((f"deepspeed={args.deepspeed!r}", "drop deepspeed= (nd_parallel shards the model; for "
                       "DeepSpeed's pipeline use ParallelismConfig(pp_backend='deepspeed'))"))
    if (getattr(args, "tp_size", 1) or 1) > 1:
        fights.append((f"tp_size={args.tp_size}", "drop it and pass ParallelismConfig(tp_size=...)"))
    if getattr(args, "save_only_model", False) and getattr(args, "load_best_model_at_end", False):
        fights.append(("save_only_model=True with load_best_model_at_end=True", "the best checkpoint's model is read "
                       "back from its sharded state, which model-only checkpoints do not have (the Trainer refuses "
                       "this pair under FSDP too); drop one of them"))
    if fights:
        what, fix = fights[0]
        raise ValueError(f"TrainingArguments {what} fights the nd_parallel layout ({config.describe()}); {fix}")
    if config.pp_size > 1 and config.pp_backend == "deepspeed" and str(getattr(args, "eval_strategy", "no")) not in (
            "no", "IntervalStrategy.NO"):
        raise NotImplementedError(_DS_EVAL)


# Evaluation under pp_backend='torch' runs its forward-only schedule (PipelineModel.supports_eval); DeepSpeed's
# engine would refuse at the first evaluate(), after training has started: refused here, before any collective.
_DS_EVAL = ("TrainingArguments(eval_strategy=...) with pp_backend='deepspeed': its pipeline engine runs training "
            "steps only, so Trainer.evaluate() cannot run; use pp_backend='torch' (forward-only schedule: eval loss "
            "and logits) or eval_strategy='no'")


def _is_trl_sft(trainer) -> bool:
    return any(cls.__name__ == "SFTTrainer" and cls.__module__.startswith("trl.") for cls in type(trainer).__mro__)


def keep_logits_for_trl(trainer, config) -> None:
    """TRL's SFTTrainer reads ``outputs.logits`` in training (token accuracy, entropy), which the chunked loss does
    not return: its default ("auto") is turned off here; a chunk size the user set is kept (their metrics then skip)."""
    if _is_trl_sft(trainer) and config.loss_chunk_size == "auto":
        config.loss_chunk_size = 0
        logger.info("chunked loss off under TRL's SFTTrainer (it reads the training logits); set "
                    "ParallelismConfig(loss_chunk_size=N) to chunk anyway")


def adopt(trainer, plugin, accelerator=None):
    """Attach ``plugin`` to the Trainer's Accelerator and turn the Trainer habits listed in the module docstring.

    Where the Accelerator already has nd_parallel (``TrainingArguments(parallelism_config=ours)`` attaches it in
    ``Accelerator()``), that plugin is kept and ``plugin`` must name the same layout. Returns the plugin in use."""
    accelerator = accelerator if accelerator is not None else trainer.accelerator
    if getattr(trainer, "nd_parallel", None) is not None:
        refuse_different_sizes(trainer.nd_parallel.config, plugin.config, "the layout in use",
                               "NDParallelCallback's ParallelismConfig")
        return trainer.nd_parallel
    check_trainer_args(trainer.args, accelerator, plugin.config)
    if is_sft_trainer(trainer):
        check_sft_args(trainer, plugin.config)  # before any collective
    if is_dpo_trainer(trainer):
        check_dpo_args(trainer, plugin.config)
    if is_kto_trainer(trainer):
        check_kto_args(trainer, plugin.config)
    if is_orpo_trainer(trainer):
        check_orpo_args(trainer, plugin.config)
    if is_cpo_trainer(trainer):
        check_cpo_args(trainer, plugin.config)
    if is_reward_trainer(trainer):
        check_reward_args(trainer, plugin.config)
    attached = getattr(accelerator, "nd_parallel", None)
    if attached is not None:
        refuse_different_sizes(attached.config, plugin.config, "TrainingArguments(parallelism_config=...)",
                               "NDParallelCallback's ParallelismConfig")
        plugin = attached
    else:  # the Trainer and TRL apply Accelerate's tp/cp arithmetic to a visible config: see attach(expose=...)
        plugin.attach(accelerator, expose=False)
    keep_logits_for_trl(trainer, plugin.config)
    turn_off_chunked_loss(trainer, plugin.config)
    _turn_habits(trainer, plugin)
    if is_sft_trainer(trainer):
        adopt_sft(trainer, plugin)
    if is_dpo_trainer(trainer):
        adopt_dpo(trainer, plugin)
    if is_kto_trainer(trainer):
        adopt_kto(trainer, plugin)
    if is_orpo_trainer(trainer):
        adopt_orpo(trainer, plugin)
    if is_cpo_trainer(trainer):
        adopt_cpo(trainer, plugin)
    if is_reward_trainer(trainer):
        adopt_reward(trainer, plugin)
    return plugin


def adopt_constructing_trainer(accelerator, plugin) -> None:
    """``Accelerator(parallelism_config=ours)`` created inside ``Trainer.__init__`` (TrainingArguments'
    parallelism_config): adopt that Trainer now, so a script that only changed its import needs no callback."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if frame.f_code.co_name == "create_accelerator_and_postprocess" and _is_trainer(owner):
                adopt(owner, plugin, accelerator)
                return
            frame = frame.f_back
    finally:
        del frame


def _is_trainer(obj) -> bool:
    return any(cls.__module__.startswith("transformers.") and cls.__name__ == "Trainer" for cls in type(obj).__mro__)


def _turn_habits(trainer, plugin) -> None:
    # A model transformers sharded at load (tp_plan=) is gathered back at prepare (distributed/transformers_tp.py)
    # and then laid out and checkpointed by nd_parallel like any other: the Trainer must not treat it as owning its
    # placement (5.24 would skip prepare's wrapping and refuse save_steps without save_only_model).
    if getattr(trainer.model, "_is_distributed_loading_by_transformers", False):
        trainer.model._is_distributed_loading_by_transformers = False
    trainer.is_distributed_loading_by_transformers = False
    trainer.args.average_tokens_across_devices = False
    trainer._mixed_mesh_grads = False  # 5.24: cached answer of _has_mixed_mesh_grads; older versions ignore it
    trainer._has_mixed_mesh_grads = lambda model: False
    trainer._nd_parallel_wrap_model = trainer._wrap_model
    for name, fn in (("save_model", _save_model), ("_wrap_model", _wrap_model),
                     ("_save_optimizer_and_scheduler", _save_state), ("_load_optimizer_and_scheduler", _load_state),
                     ("_save_rng_state", _nothing), ("_load_rng_state", _nothing),
                     ("_load_from_checkpoint", _check_resumable), ("_load_best_model", _load_best_model)):
        setattr(trainer, name, types.MethodType(fn, trainer))
    # Ranks that share a batch: the Trainer divides its token count by tp * cp * sp when Accelerate's config shows
    # them, and TRL its token metric by tp. nd_parallel's loss counts each batch once already (loss.py) and its
    # gathers span the dp ranks only, so for that arithmetic they are 1; the batch size it logs is the true dp's.
    for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
        setattr(trainer, name, lambda: 1)
    trainer.get_total_train_batch_size = lambda args: (trainer._train_batch_size * args.gradient_accumulation_steps
                                                       * plugin.config.dp_size)
    # nd_parallel's CP cuts the batch inside the prepared model: no Accelerate CP buffers, no causal-mask check.
    trainer._prepare_context_parallel_inputs = lambda model, inputs: (contextlib.nullcontext, inputs)
    trainer.nd_parallel = plugin
    if plugin.config.save_on_signal:  # a checkpoint after the step in which SIGTERM/SIGINT came (fault/)
        from .preemption import PreemptionCallback

        if getattr(trainer, "callback_handler", None) is None:
            raise NotImplementedError("save_on_signal with TrainingArguments(parallelism_config=...): pass the "
                                      "layout as callbacks=[NDParallelCallback(config)] instead")
        trainer.add_callback(PreemptionCallback(plugin))


def _nothing(trainer, *args, **kwargs) -> None:
    """Model weights and RNG states are part of the sharded checkpoint (_save_state / _load_state)."""


def _check_resumable(trainer, checkpoint: str, model=None) -> None:
    """In place of the Trainer's model load (the weights are in the sharded state, read by _load_state): called
    at the start of train(), before prepare's collectives, so a checkpoint that cannot resume stops the run there."""
    check_resumable(checkpoint)


def check_resumable(checkpoint: str) -> None:
    """Refuse a Trainer checkpoint folder without nd_parallel's sharded state, naming why (model-only or foreign)."""
    if os.path.isdir(os.path.join(checkpoint, STATE_DIR)):
        return
    model_files = ("config.json", "model.safetensors", "model.safetensors.index.json", "adapter_config.json")
    if any(os.path.isfile(os.path.join(checkpoint, name)) for name in model_files):
        raise ValueError(f"resume_from_checkpoint={checkpoint!r} holds the model only (saved with save_only_model: "
                         "no optimizer, scheduler or RNG state), and such a checkpoint cannot be resumed (as the "
                         "Trainer documents); start a new run from its weights instead: from_pretrained on that "
                         "folder (nd-parallel train: base_model, or lora_model_dir for an adapter)")
    raise FileNotFoundError(f"{checkpoint} has no {STATE_DIR}/ folder: it was not saved by a Trainer with "
                            "NDParallelCallback; resume from a checkpoint written under nd_parallel")


def _register_scheduler(trainer) -> None:
    # The Trainer steps its scheduler itself, without accelerator.prepare: register it so the checkpoint has it.
    sched = getattr(trainer, "lr_scheduler", None)
    accelerator = trainer.accelerator
    if sched is not None and all(o is not sched for o in accelerator._custom_objects):
        accelerator.register_for_checkpointing(sched)


def _save_state(trainer, output_dir: str) -> None:
    _register_scheduler(trainer)
    trainer.accelerator.save_state(os.path.join(output_dir, STATE_DIR))


def _load_state(trainer, checkpoint: str | None) -> None:
    if checkpoint is None:
        return
    check_resumable(checkpoint)
    path = os.path.join(checkpoint, STATE_DIR)
    _register_scheduler(trainer)
    accelerator = trainer.accelerator
    # The Trainer puts its dataloader back itself (epochs trained + skip_first_batches); ours must not skip too.
    loaders, accelerator._dataloaders = accelerator._dataloaders, []
    try:
        accelerator.load_state(path)
    finally:
        accelerator._dataloaders = loaders


def _load_best_model(trainer) -> None:
    """load_best_model_at_end: the best checkpoint's model weights from its sharded state, under this layout (the
    Trainer's own reload reads model.safetensors or FSDP1 files, which these checkpoints do not have)."""
    from nd_parallel.checkpoint import load_model_state

    best = trainer.state.best_model_checkpoint
    logger.info("loading the best model from %s (score: %s)", best, trainer.state.best_metric)
    load_model_state(trainer.nd_parallel.train_state(), os.path.join(best, STATE_DIR))


def _wrap_model(trainer, model, training: bool = True, dataloader=None):
    wrapped = trainer.model_wrapped
    if not training and model is trainer.model and wrapped is not model and wrapped is not None:
        return wrapped  # see "Evaluation model" in the module docstring
    return trainer._nd_parallel_wrap_model(model, training=training, dataloader=dataloader)


def _save_model(trainer, output_dir: str | None = None, _internal_call: bool = False) -> None:
    output_dir = output_dir or trainer.args.output_dir
    model = trainer.model_wrapped
    from nd_parallel.models.peft import peft_wrapper

    if _internal_call and peft_wrapper(model) is None and not trainer.args.save_only_model:
        return  # a checkpoint: the full weights are in its sharded state already
    # save_only_model: the Trainer saves no optimizer/scheduler/RNG state (_save_state is not called), so the
    # checkpoint is the model alone, written whole (gathered from the shards) as from_pretrained reads it
    trainer.accelerator.save_model(model, output_dir)
    if trainer.accelerator.is_main_process and trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(output_dir)

