"""What every launched rank of `nd-parallel train` and `nd-parallel demo` runs (`python -m nd_parallel.cli.train.rank JOB.json`
under torchrun); the parent prepares the job (job.py: layout, YAML, tokenized data) before any rank starts.

- train: ``transformers.Trainer`` + ``NDParallelCallback`` (the layout) + ``peft`` (adapter) on the data that
  data/ prepared. Checkpoints, resuming, evaluation, the LR schedule and gradient accumulation are the
  Trainer's; callbacks.py adds the progress bar and ``output_dir/train_log.jsonl``.
- demo: the Accelerate loop of nd_parallel/testing/parity.py, compared by the parent with one process.

A job file holds one job, or ``{"jobs": [...]}``: several runs in one launch (the tests use it to amortise
start-up); rank 0 writes each job's results to ``job.results``.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import torch

from nd_parallel.accelerate.launcher_env import adopt_launcher_env

from ..report import local_state_bytes
from . import (
    adapter_options,
    attention_options,
    data_options,
    diffusion,
    embeddings,
    grpo,
    grpo_rank,
    lm_eval,
    load_options,
    norms,
    objective,
    param_groups,
    prequantized,
    restarts,
    sparsity,
    trainer_class,
)
from .config import TrainConfig
from .extras import attention_for, lora_kwargs, model_kwargs
from .job import DemoJob, Job, TrainJob, read_jobs
from .keys import ALTERNATE_SCHEDULERS


# ----------------------------------------------------------------------------------------------- train
def _model(t: TrainConfig, tokenizer):
    from accelerate.utils import set_seed

    from .reward import auto_class, lora_task

    set_seed(t.seed)  # the model and adapter init are the same on every rank and in one process
    extra = {} if t.trust_remote_code is None else {"trust_remote_code": t.trust_remote_code}
    if t.base_model_config:
        from transformers import AutoConfig

        extra["config"] = AutoConfig.from_pretrained(t.base_model_config, **extra)
    extra.update(objective.config_kwargs(t, t.base_model_config or t.base_model, extra))  # cls_model_config
    objective.config_overrides(extra, t.model_config)  # Axolotl's model_config: set on the config that loads
    extra.update(load_options.load_kwargs(t))  # model_kwargs: from_pretrained's extra arguments, first (as Axolotl)
    extra.update(model_kwargs(t))  # revision_of_model, experts_implementation (extras.py)
    auto = auto_class(t, extra)  # AutoModelForCausalLM, or a reward model's classification head (reward.py)
    if t.attn_implementation:  # resolved in the parent (equivalents.attention): a kernel only where it exists
        extra["attn_implementation"] = attention_for(t.base_model, t.attn_implementation, extra)
        if extra["attn_implementation"] != t.attn_implementation and os.environ.get("RANK", "0") == "0":
            print(f"[nd_parallel] attention: {t.base_model} has no SDPA path; using eager attention", flush=True)
    if t.load_in_4bit or t.load_in_8bit:  # quantized tensor by tensor as transformers reads it: never the whole model
        extra.update(_quantization(t))
    extra.update(prequantized.load_kwargs(t))  # Mxfp4Config(dequantize=True): MXFP4 experts read as fp32 weights
    with _experts_quantized(t) as quantized, objective.llama4_experts(t) as split_after:  # Llama 4's expert Linears
        model = (_from_config(t, extra) if t.reinit_weights  # the config's own init: no weight file is read
                 else auto.from_pretrained(t.base_model, dtype=torch.float32, **extra))  # fp32 master
    split_after(model)
    attention_options.install(model, t)  # scaling_softmax: SSMax-scaled queries in the model's own attention
    norms.tag(model, t)  # fp32_norms: the norm modules get fp32 FSDP2 groups of their own
    if quantized is not None and os.environ.get("RANK", "0") == "0":  # a dense model: none, as in Axolotl
        print(f"[nd_parallel] quantize_moe_experts: {len(quantized)} MoE expert tensors quantized to "
              f"{8 if t.load_in_8bit else 4}-bit as they loaded", flush=True)
    embeddings.resize(model, t, len(tokenizer))  # added tokens, resize_token_embeddings_to_32x, shrink_embeddings
    if t.liger:
        _apply_liger(model, t.liger)
    if t.qat:  # after loading and resizing, before the adapter and the layout (Axolotl's order; models/qat.py)
        _fake_quantize(model, t.qat)
    objective.install_loss(t, model)  # use_eaft: the model's loss function, kept by peft and every layout
    if t.adapter not in ("lora", "qlora"):
        if t.unfrozen_parameters:
            freeze_except(model, t.unfrozen_parameters)
        return freeze_mm_modules(model) if t.freeze_mm_modules else model
    from peft import LoraConfig, PeftModel, get_peft_model

    from nd_parallel.models.peft import expert_lora_without_dropout, linear_target_names

    # Axolotl's list of Linear names, not peft's "all-linear" (models/peft.py says how they differ on MoE models)
    targets = linear_target_names(model, t.lora_target_modules) if t.lora_target_linear else t.lora_target_modules
    from nd_parallel.models.loftq import cpu_loftq

    task, targets = lora_task(t, targets)
    with expert_lora_without_dropout() as undropped, cpu_loftq():  # LoftQ (peft: loftq_config) on CPU ranks too
        if t.lora_model_dir:
            model = PeftModel.from_pretrained(model, t.lora_model_dir, is_trainable=True)
        else:
            model = get_peft_model(model, LoraConfig(
                r=t.lora_r, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout, target_modules=targets,
                modules_to_save=t.lora_modules_to_save, task_type=task, **lora_kwargs(t),
                **objective.adapter_kwargs(t), **adapter_options.lora_config_kwargs(t)),
                **adapter_options.peft_model_kwargs(t))
    if undropped and os.environ.get("RANK", "0") == "0":  # Axolotl warns the same
        print(f"[nd_parallel] lora_dropout: {len(undropped)} LoRA layers on fused expert tensors "
              f"({', '.join(sorted(set(undropped)))}) train without dropout (peft cannot apply it there); the "
              "other LoRA layers use it", flush=True)
    return freeze_mm_modules(model) if t.freeze_mm_modules else model


def _adjust(trainer, t: TrainConfig, dp: int) -> None:
    """What Axolotl changes in the Trainer that TrainingArguments cannot say: its optimizer, schedules, data order."""
    from .sampling import use_length_groups
    from .schedules import use_alternate, use_constant_tail, use_jagged_restarts, use_muon, use_quadratic_warmup

    if t.optimizer == "muon":  # Axolotl's Muon + AdamW (distributed/muon.py), through the Trainer's create_optimizer
        use_muon(trainer, t)
    if param_groups.used(t):  # LoRA+, embedding_lr(_scale), lr_groups (param_groups.py)
        param_groups.use_param_groups(trainer, t)
    if t.lr_scheduler in ALTERNATE_SCHEDULERS:  # Axolotl's own rex / one_cycle (schedules.py)
        use_alternate(trainer, t)
    if t.lr_quadratic_warmup:  # Axolotl's cosine with quadratic warm-up (schedules.py)
        use_quadratic_warmup(trainer)
    if t.cosine_constant_lr_ratio:  # Axolotl's cosine to the floor, then constant (schedules.py); 0 is unset there
        use_constant_tail(trainer, t.cosine_constant_lr_ratio, t.cosine_min_lr_ratio)
    if t.jagged_restart_steps:  # Axolotl's jagged LR restarts, with or without relora (schedules.py)
        use_jagged_restarts(trainer, t)
    use_length_groups(trainer, t, dp)  # group_by_length (sampling.py)


def _extra_callbacks(t, trainer) -> list:
    """LISA / ReLoRA (restarts.py), do_causal_lm_eval's metrics (lm_eval.py), the LLM Compressor plugin's masks
    (sparsity.py), NEFTune's keyed noise (neftune.py): each an empty list unless its keys are set."""
    from .neftune import KeyedNEFTune

    noise = [KeyedNEFTune(trainer.model, t.neftune_noise_alpha, t.seed)] if t.neftune_noise_alpha else []
    return [*restarts.callbacks(t, trainer), *lm_eval.callbacks(t, trainer), *sparsity.callbacks(t, trainer), *noise]


def freeze_mm_modules(model):
    """Axolotl's freeze_mm_modules: the vision/audio encoders and projector (multimodal.MM_MODULES) stop training."""
    from .multimodal import MM_MODULES

    for name, param in model.named_parameters():
        if any(part in MM_MODULES for part in name.split(".")):
            param.requires_grad = False
    return model


def _from_config(t: TrainConfig, extra: dict):
    """Axolotl's reinit_weights: the checkpoint's config (base_model_config, model_config applied) built with the
    model's own _init_weights under the run's seed (set in _model before), the same weights on every rank and in one
    process, in fp32. No weight file is opened (nor the memory-efficient path's lazy checkpoint: there is none)."""
    from transformers import AutoConfig

    trust = {k: extra.pop(k) for k in ("trust_remote_code",) if k in extra}
    revision = {k: extra.pop(k) for k in ("revision",) if k in extra}
    config = extra.pop("config", None) or AutoConfig.from_pretrained(t.base_model, **trust, **revision)
    for key, value in (t.model_config or {}).items():  # from_pretrained would set these on the config
        setattr(config, key, extra.pop(key, value))
    kwargs = {k: extra[k] for k in ("attn_implementation", "experts_implementation") if k in extra}
    from .reward import auto_class

    return auto_class(t, {"config": config}).from_config(config, dtype=torch.float32, **trust, **kwargs)


def freeze_except(model, patterns: list[str]) -> None:
    """Axolotl's unfrozen_parameters: train the parameters whose name matches a pattern (re.match from the name's
    start, a "." is a literal dot unless followed by "+", as Axolotl reads them), freeze the others."""
    import re

    regexes = [re.compile(re.sub(r"\.(?!\+)", "\\.", p)) for p in patterns]
    for name, param in model.named_parameters():
        param.requires_grad = any(r.match(name) for r in regexes)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"unfrozen_parameters {patterns} match no parameter of {type(model).__name__}; parameter "
                         f"names look like {next(iter(dict(model.named_parameters())))!r}")


def _apply_liger(model, switches: dict) -> None:
    """The Liger plugin's kernels, on CUDA ranks with liger-kernel installed (the parent said so in its notes)."""
    import importlib.util

    if not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None:
        return  # Triton kernels: CPU ranks train without them (the same math)
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    names = {"liger_rope": "rope", "liger_rms_norm": "rms_norm", "liger_glu_activation": "swiglu",
             "liger_swiglu": "swiglu", "liger_layer_norm": "layer_norm", "liger_cross_entropy": "cross_entropy",
             "liger_fused_linear_cross_entropy": "fused_linear_cross_entropy"}
    _apply_liger_kernel_to_instance(model=model, **{names[k]: bool(v) for k, v in switches.items() if k in names})


def _quantization(t: TrainConfig) -> dict:
    """from_pretrained's arguments for Axolotl's load_in_4bit: NF4, double quantization, compute in the training
    dtype (Axolotl's defaults), overridden by bnb_config_kwargs; on this rank's device."""
    from transformers import BitsAndBytesConfig

    settings = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                "bnb_4bit_compute_dtype": "bfloat16" if t.bf16 is True else "float32", **(t.bnb_config_kwargs or {})}
    for key in ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"):
        if key in settings:
            settings[key] = getattr(torch, str(settings[key]).removeprefix("torch."))
    device = {"": torch.cuda.current_device()} if torch.cuda.is_available() else "cpu"
    if t.load_in_8bit:  # LLM.int8 (bitsandbytes' defaults, as Axolotl's); on CPU it trains by dequantizing per row
        return {"quantization_config": BitsAndBytesConfig(load_in_8bit=True), "device_map": device}
    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, **settings), "device_map": device}


def _fake_quantize(model, qat: dict) -> None:
    """Axolotl's qat: the model's Linears fake-quantized (nd_parallel/models/qat.py), one line on rank 0."""
    from nd_parallel.models.qat import COMBOS, QATOptions, prepare_qat

    options = QATOptions.from_dict(qat)
    layers = prepare_qat(model, options)
    if os.environ.get("RANK", "0") == "0":
        after, what = options.fake_quant_after_n_steps, COMBOS[options.activation_dtype, options.weight_dtype]
        print(f"[nd_parallel] qat: {len(layers)} layers fake-quantized ({what})"
              + (f", off until step {after}" if after else ""), flush=True)


def _experts_quantized(t: TrainConfig):
    """Axolotl's quantize_moe_experts: the experts in load_in_4bit's format (bnb_config_kwargs' quant type and
    double quantization) or load_in_8bit's (models/quantized_experts.py)."""
    import contextlib

    if not t.quantize_moe_experts:
        return contextlib.nullcontext()
    from nd_parallel.models.quantized_experts import quantizing_experts

    kwargs = t.bnb_config_kwargs or {}
    return quantizing_experts(8 if t.load_in_8bit else 4, quant_type=kwargs.get("bnb_4bit_quant_type", "nf4"),
                              double_quant=kwargs.get("bnb_4bit_use_double_quant", True))


def _run_train(job: TrainJob) -> dict:
    from transformers import TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from nd_parallel.fault.resume import account as account_for_resume
    from nd_parallel.fault.resume import agreed as agreed_checkpoint
    from nd_parallel.fault.resume import finished as finished_at
    from nd_parallel.fault.resume import init_restarted_process_group
    from nd_parallel.plugins.trainer import NDParallelCallback

    from .callbacks import LOG_FILE, ProgressAndLog, StopBeforeTheFirstStep, fake_quant_after, user_callbacks, watchdog
    from .data import load_prepared
    from .preference import preference_trainer
    from .reward import reward_kind, reward_trainer

    t = job.train
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # rank entry point: torchrun's agent sets it
    init_restarted_process_group(restart)  # a restarted attempt must not read the dead one's addresses
    train_ds, eval_ds, tokenizer = load_prepared(job.prepared)
    layout = NDParallelCallback(job.layout)  # before the Trainer builds its Accelerator
    model = _model(t, tokenizer)
    fixed = embeddings.fix_untrained(model, t, tokenizer, train_ds)  # fix_untrained_tokens: whole rows, every rank
    if fixed and os.environ.get("RANK", "0") == "0":
        print(f"[nd_parallel] fix_untrained_tokens: rows of tokens {fixed} set from the trained rows' mean", flush=True)
    parts = dict(model=model, train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tokenizer,
                 callbacks=[layout, *watchdog(t), *fake_quant_after(t), *user_callbacks(t.trainer_callbacks)])
    if t.rl:  # TRL's GRPOTrainer on prompts (grpo.py), or its DPO / KTO / ORPO trainers on preferences (preference.py)
        trainer = (grpo_rank.trainer if t.rl in grpo.RL else preference_trainer)(t, job.trainer_args, **parts)
    elif reward_kind(t):  # TRL's RewardTrainer / the Trainer on a token-classification head (reward.py)
        trainer = reward_trainer(t, job.trainer_args, **parts)
    else:
        collator = data_options.collator(t, tokenizer.pad_token_id)  # padding, pad_to_multiple_of, batch_flattening
        if t.processor_type:  # images: each rank processes its own rows at collate time (data/mm_collate.py)
            from .data.mm_collate import MultimodalCollator
            from .data.mm_rows import load_prepared_processor

            collator = MultimodalCollator(*load_prepared_processor(job.prepared, t.trust_remote_code))
            parts["processing_class"] = collator.processor  # saved with the model, as Axolotl saves it
        base = trainer_class.trainer_base(t)  # trainer_cls, else transformers' Trainer
        trainer = diffusion.trainer(t, base, TrainingArguments(**job.trainer_args), collator, parts)  # or plain
    _adjust(trainer, t, job.layout.dp_size)  # Muon, quadratic warm-up, jagged restarts, length groups
    for callback in _extra_callbacks(t, trainer):  # lisa, relora, generation metrics, sparsity masks, neftune
        trainer.add_callback(callback)
    for noisy in (PrinterCallback, ProgressCallback):  # ProgressAndLog prints instead, every logging_steps
        trainer.remove_callback(noisy)
    # After a failure torchrun's elastic agent (--max-restarts) starts the ranks again: they take the latest complete
    # checkpoint, the same one on every rank (nd_parallel/fault/resume.py).
    resume, restart = agreed_checkpoint(t.resume_from_checkpoint, t.output_dir, restart)
    if trainer.is_world_process_zero():
        note = account_for_resume(resume, Path(t.output_dir) / LOG_FILE, restart)  # the log back to its step
        if note:
            print(note, flush=True)
    trainer.add_callback(ProgressAndLog(t.output_dir, t.logging_steps or 1, job.name, append=bool(resume)))
    if finished_at(resume):  # restarted after the last step's checkpoint (a rank failed at exit): train no more
        trainer.add_callback(StopBeforeTheFirstStep())
    try:
        trainer.train(resume_from_checkpoint=resume)
    except StopBeforeTheFirstStep.Reached:  # the model is prepared and loaded from the checkpoint: save it again
        if trainer.is_world_process_zero():
            print(f"[nd_parallel] {Path(resume).name} is the run's last step: nothing left to train", flush=True)
    if t.relora:  # Axolotl saves a ReLoRA run merged: the restarts' merges and the last adapter
        restarts.save_relora(t, trainer, tokenizer)
    else:
        trainer.save_model(t.output_dir)  # collective: the full HF model, or the adapter; plus the tokenizer
    logs = trainer.state.log_history
    return {"losses": [h["loss"] for h in logs if "loss" in h],
            "norms": [h.get("grad_norm", float("nan")) for h in logs if "loss" in h],
            "eval_losses": [h["eval_loss"] for h in logs if "eval_loss" in h],
            "bytes": local_state_bytes(trainer.optimizer), "device": str(trainer.accelerator.device),
            "layout": layout.plugin.config.describe(), "main": trainer.accelerator.is_main_process}


# ----------------------------------------------------------------------------------------------- demo
def _run_demo(job: DemoJob) -> dict:
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    from nd_parallel.accelerate.plugin import NDParallelPlugin
    from nd_parallel.testing.parity import train_layout

    accelerator = Accelerator()
    plugin = NDParallelPlugin(job.layout).attach(accelerator)
    samples = torch.load(job.samples, weights_only=True) if isinstance(job.samples, str) else job.samples
    with tqdm(total=job.recipe.steps, desc=job.name, disable=not accelerator.is_main_process) as bar:
        def progress(step, loss):
            bar.set_postfix(loss=f"{loss:.4f}")
            bar.update()

        result = train_layout(accelerator, plugin, job.model_dir, samples, job.recipe, progress)
    return {"losses": result.losses, "norms": result.norms, "state": result.state,
            "bytes": local_state_bytes(result.optimizer), "device": str(accelerator.device),
            "layout": plugin.config.describe(), "main": accelerator.is_main_process}


def run_rank(job: Job) -> dict | None:
    """Run one job on this rank; rank 0 returns (and writes to job.results) every rank's results."""
    import torch.distributed as dist

    adopt_launcher_env()
    if job.quiet:  # the report is the table: hide library warnings meant for developers
        warnings.filterwarnings("ignore")
        logging.getLogger("torch.distributed").setLevel(logging.ERROR)
        logging.getLogger("torchao").setLevel(logging.ERROR)  # its optional CUDA extensions, unloadable on CPU ranks
    mine = _run_demo(job) if isinstance(job, DemoJob) else _run_train(job)
    ranks = [mine]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, {k: mine[k] for k in ("losses", "bytes", "device")})
    if not mine.pop("main"):
        return None
    results = {**mine, "ranks": ranks}
    if job.results:
        torch.save(results, job.results)
    return results


def main(path: str) -> None:
    import torch.distributed as dist

    for job in read_jobs(path):
        run_rank(job)
    if dist.is_initialized():
        # Every rank is done before any leaves. The group is left to process exit: destroying it after the
        # Trainer's sharded checkpoint saves aborted rank 0 here ("terminate called without an active exception",
        # torch 2.13 + gloo), while an exit without it is clean.
        dist.barrier()


if __name__ == "__main__":  # a launched rank: python -m nd_parallel.cli.train.rank JOB.json
    from nd_parallel.fault.proctree import die_with_parent

    die_with_parent()  # a rank never outlives torchrun's agent (a dead agent is a dead node)
    main(sys.argv[1])
    # The run is over: the exit handlers end it in order (a pending checkpoint, the process groups: fault/runtime.py),
    # then the process leaves without the interpreter's and C++'s own teardown of torch objects. That teardown is
    # where a rank can still abort after a clean run ("terminate called without an active exception": seen once in
    # CI, rank 1 of a restarted attempt on a loaded machine), with nothing left for it to do.
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
