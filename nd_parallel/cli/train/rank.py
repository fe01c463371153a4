"""What every launched rank of `nd-parallel train` and `nd-parallel demo` runs (`python -m nd_parallel.cli.train.rank JOB.json`
under torchrun); cli.py prepares the job (layout, YAML, tokenized data) in the parent before any rank starts.

- train: ``transformers.Trainer`` + ``NDParallelCallback`` (the layout) + ``peft`` (adapter) on the data that
  data_pipeline prepared. Checkpoints, resuming, evaluation, the LR schedule and gradient accumulation are the
  Trainer's; train_callbacks.py adds the progress bar and ``output_dir/train_log.jsonl``.
- demo: the Accelerate loop of parity.py, compared by the parent with one process.

A job file holds one job, or ``{"jobs": [...]}``: several runs in one launch (the tests use it to amortise
start-up); rank 0 writes each job's results to ``job["results"]``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path

import torch

from nd_parallel.accelerate.launcher_env import adopt_launcher_env
from nd_parallel.config import ParallelismConfig

from .data.sources import DatasetSpec  # noqa: F401 (examples/train.py builds samples with it)

LOG_FILE = "train_log.jsonl"


# ----------------------------------------------------------------------------------------------- helpers
def mixed_precision(bf16) -> str:
    """Accelerate's mixed_precision for the YAML's ``bf16``: "auto" is bf16 only on GPUs that support it (on CPU
    ranks bf16 matmuls are slower than fp32, and Axolotl's auto -> fp16 fallback would need loss scaling)."""
    if bf16 == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    return "bf16" if bf16 else "no"


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP/TP): only this rank's shard is real
    return t.numel() * t.element_size()


def local_state_bytes(optimizer) -> dict[str, int]:
    """Bytes this rank holds for trained parameters and AdamW moments, measured on the real (sharded) tensors."""
    opt = getattr(optimizer, "optimizer", optimizer)
    params = list({id(p): p for g in opt.param_groups for p in g["params"]}.values())
    moments = [v for p in params for k, v in opt.state.get(p, {}).items() if k != "step" and torch.is_tensor(v)]
    return {"params": sum(map(_local_bytes, params)), "optimizer": sum(map(_local_bytes, moments))}


def checkpoint_numel(model_dir: str) -> int:
    """Parameters of a checkpoint, from its safetensors headers (a tied weight is stored once)."""
    from safetensors import safe_open

    total = 0
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (no __iter__)
    return total


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def build_samples(base_model: str, paths: list, sequence_len: int) -> tuple[list[dict], str]:
    """Completion samples of local text files, packed and padded to sequence_len, as tensors (examples/train.py's
    Accelerate loop). The same data_pipeline as `nd-parallel train`; `paths`: files or DatasetSpec objects."""
    import tempfile

    from .config import TrainConfig
    from .data import Collator, load_prepared, prepare

    specs = [p if hasattr(p, "resolved") else _completion_spec(p) for p in paths]
    cfg = TrainConfig(base_model=base_model, datasets=specs, sequence_len=sequence_len, sample_packing=True)
    with tempfile.TemporaryDirectory(prefix="nd-parallel-samples-") as tmp:
        prepared = prepare(cfg, tmp)
        rows, _, tokenizer = load_prepared(prepared.path)
        collator = Collator(tokenizer.pad_token_id, pad_to=sequence_len)
        return [{k: v[0] for k, v in collator([row]).items()} for row in rows], prepared.tokenizer_how


def _completion_spec(path):

    return DatasetSpec(path=os.path.abspath(str(path)))


# ----------------------------------------------------------------------------------------------- train
def _model(t: dict, tokenizer):
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM

    set_seed(t["seed"])  # the model and adapter init are the same on every rank and in one process
    extra = {} if t.get("trust_remote_code") is None else {"trust_remote_code": t["trust_remote_code"]}
    if t.get("base_model_config"):
        from transformers import AutoConfig

        extra["config"] = AutoConfig.from_pretrained(t["base_model_config"], **extra)
    model = AutoModelForCausalLM.from_pretrained(t["base_model"], dtype=torch.float32, **extra)  # fp32 master
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:  # special_tokens / tokens added new ids
        model.resize_token_embeddings(len(tokenizer))
    if t.get("adapter") != "lora":
        return model
    from peft import LoraConfig, PeftModel, get_peft_model

    if t.get("lora_model_dir"):
        return PeftModel.from_pretrained(model, t["lora_model_dir"], is_trainable=True)
    targets = "all-linear" if t.get("lora_target_linear") else t.get("lora_target_modules")
    return get_peft_model(model, LoraConfig(
        r=t["lora_r"], lora_alpha=t["lora_alpha"], lora_dropout=t["lora_dropout"], target_modules=targets,
        modules_to_save=t.get("lora_modules_to_save"), task_type="CAUSAL_LM"))


def _run_train(job: dict) -> dict:
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from nd_parallel.fault.resume import account as account_for_resume
    from nd_parallel.fault.resume import agreed as agreed_checkpoint
    from nd_parallel.fault.resume import finished as finished_at
    from nd_parallel.fault.resume import init_restarted_process_group
    from nd_parallel.plugins.trainer import NDParallelCallback

    from .callbacks import ProgressAndLog, StopBeforeTheFirstStep, user_callbacks
    from .data import Collator, load_prepared

    t = job["train"]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # rank entry point: torchrun's agent sets it
    init_restarted_process_group(restart)  # a restarted attempt must not read the dead one's addresses
    train_ds, eval_ds, tokenizer = load_prepared(job["prepared"])
    layout = NDParallelCallback(ParallelismConfig(**job["layout"]))  # before the Trainer builds its Accelerator
    model = _model(t, tokenizer)
    pad_to = t["sequence_len"] if t.get("pad_to_sequence_len") or t.get("sample_packing") else None
    args = TrainingArguments(**job["trainer_args"])
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                      data_collator=Collator(tokenizer.pad_token_id, pad_to), processing_class=tokenizer,
                      callbacks=[layout, *user_callbacks(t.get("trainer_callbacks"))])  # theirs see on_init_end too
    for noisy in (PrinterCallback, ProgressCallback):  # ProgressAndLog prints instead, every logging_steps
        trainer.remove_callback(noisy)
    # After a failure torchrun's elastic agent (--max-restarts) starts the ranks again: they take the latest complete
    # checkpoint, the same one on every rank (nd_parallel/fault/resume.py).
    resume, restart = agreed_checkpoint(t.get("resume_from_checkpoint"), t["output_dir"], restart)
    if trainer.is_world_process_zero():
        note = account_for_resume(resume, Path(t["output_dir"]) / LOG_FILE, restart)  # the log back to its step
        if note:
            print(note, flush=True)
    trainer.add_callback(ProgressAndLog(t["output_dir"], t.get("logging_steps") or 1, job["name"],
                                        append=bool(resume)))
    if finished_at(resume):  # restarted after the last step's checkpoint (a rank failed at exit): train no more
        trainer.add_callback(StopBeforeTheFirstStep())
    try:
        trainer.train(resume_from_checkpoint=resume)
    except StopBeforeTheFirstStep.Reached:  # the model is prepared and loaded from the checkpoint: save it again
        if trainer.is_world_process_zero():
            print(f"[nd_parallel] {Path(resume).name} is the run's last step: nothing left to train", flush=True)
    trainer.save_model(t["output_dir"])  # collective: the full HF model, or the adapter; plus the tokenizer
    logs = trainer.state.log_history
    return {"losses": [h["loss"] for h in logs if "loss" in h],
            "norms": [h.get("grad_norm", float("nan")) for h in logs if "loss" in h],
            "eval_losses": [h["eval_loss"] for h in logs if "eval_loss" in h],
            "bytes": local_state_bytes(trainer.optimizer), "device": str(trainer.accelerator.device),
            "layout": layout.plugin.config.describe(), "main": trainer.accelerator.is_main_process}


# ----------------------------------------------------------------------------------------------- demo
def _run_demo(job: dict) -> dict:
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    from nd_parallel import NDParallelPlugin
    from nd_parallel.testing.parity import Recipe, train_layout

    accelerator = Accelerator()
    plugin = NDParallelPlugin(ParallelismConfig(**job["layout"])).attach(accelerator)
    samples = torch.load(job["samples"], weights_only=True) if isinstance(job["samples"], str) else job["samples"]
    with tqdm(total=job["steps"], desc=job["name"], disable=not accelerator.is_main_process) as bar:
        def progress(step, loss):
            bar.set_postfix(loss=f"{loss:.4f}")
            bar.update()

        result = train_layout(accelerator, plugin, job["model_dir"], samples, Recipe(**job["recipe"]), progress)
    return {"losses": result.losses, "norms": result.norms, "state": result.state,
            "bytes": local_state_bytes(result.optimizer), "device": str(accelerator.device),
            "layout": plugin.config.describe(), "main": accelerator.is_main_process}


def run_rank(job: dict) -> dict | None:
    """Run one job on this rank; rank 0 returns (and writes to job["results"]) every rank's results."""
    import torch.distributed as dist

    adopt_launcher_env()
    if job.get("quiet"):  # the report is the table: hide library warnings meant for developers
        warnings.filterwarnings("ignore")
        logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    mine = (_run_demo if job["kind"] == "demo" else _run_train)(job)
    ranks = [mine]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, {k: mine[k] for k in ("losses", "bytes", "device")})
    if not mine.pop("main"):
        return None
    results = {**mine, "ranks": ranks}
    if job.get("results"):
        torch.save(results, job["results"])
    return results


def main(path: str) -> None:
    import torch.distributed as dist

    spec = json.loads(Path(path).read_text())
    for job in spec.get("jobs", [spec]):
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
