"""The job: what the parent of `nd-parallel demo | train` hands every rank, and how `train` builds it.

The parent writes the job as JSON (`write_jobs`) before any rank starts, and every rank reads it back (`read_jobs`)
into the same dataclasses, so ``Job.from_json(job.to_json()) == job``. A file holds one job, or ``{"jobs": [...]}``:
several runs in one launch (the tests use it to amortise start-up).

`build_job` turns a loaded YAML into a `TrainJob`: the layout checked, the data prepared and the Trainer's
arguments made here, so that every bad input stops the run in the parent with the file, the record and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from nd_parallel.config import ConfigError, ParallelismConfig

from . import adapter_options, grpo, objective, param_groups, restarts, sparsity, trainer_class, trainer_keys
from .config import TrainConfig
from .data.sources import DatasetSpec
from .extras import check_installed, check_layout, mixed_precision, scheduler_args
from .keys import ALTERNATE_SCHEDULERS
from .objective import check_dora_layout, check_llama4_experts

if TYPE_CHECKING:
    from nd_parallel.testing.parity import Recipe


# ---------------------------------------------------------------------------------------------------- the job
@dataclass(kw_only=True)
class Job:
    """What every kind of job tells the ranks."""

    kind: ClassVar[str]
    name: str
    """The run's name: the progress bar's label, and a train job's run_name."""
    layout: ParallelismConfig
    """The resolved layout every rank builds."""
    quiet: bool = True
    """Hide the libraries' warnings and loading bars: the report is the table."""
    results: str | None = None
    """Where rank 0 writes every rank's results (torch.save); None: only returned (under an outer launcher)."""

    def to_json(self) -> dict[str, Any]:
        """The job as plain JSON values (a dict for json.dumps); `Job.from_json` reads it back."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {"kind": self.kind, **own, "layout": self.layout.to_dict(), **self._json_fields()}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Job:
        """The DemoJob or TrainJob that `to_json` wrote (its "kind" says which)."""
        kinds = {cls.kind: cls for cls in (DemoJob, TrainJob)}
        cls = kinds.get(data.get("kind"))
        if cls is None:
            raise ValueError(f"job kind {data.get('kind')!r}; expected one of {', '.join(kinds)}")
        fields = {f.name: data.get(f.name) for f in dataclasses.fields(cls)}
        return cls(**{**fields, "layout": ParallelismConfig(**data["layout"]), **cls._from_json_fields(data)})

    def _json_fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def _from_json_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
        return {}


@dataclass(kw_only=True)
class DemoJob(Job):
    """`nd-parallel demo`: the Accelerate loop of nd_parallel/testing/parity.py on seeded samples."""

    kind: ClassVar[str] = "demo"
    model_dir: str
    samples: str | list[dict]
    """A torch.save file of the samples; under an outer launcher (no job file) the samples themselves."""
    recipe: Recipe

    def _json_fields(self) -> dict[str, Any]:
        return {"recipe": dataclasses.asdict(self.recipe)}

    @classmethod
    def _from_json_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
        from nd_parallel.testing.parity import Recipe

        recipe = data["recipe"]
        return {"recipe": Recipe(**{**recipe, "eval_at": tuple(recipe["eval_at"])})}  # JSON has no tuples


@dataclass(kw_only=True)
class TrainJob(Job):
    """`nd-parallel train`: transformers.Trainer on the data the parent prepared."""

    kind: ClassVar[str] = "train"
    train: TrainConfig
    """The YAML as loaded (its ``parallel`` as written; ``layout`` is that layout resolved for the ranks)."""
    prepared: str
    """The directory `data.prepare` wrote: train/, eval/ and tokenizer/."""
    trainer_args: dict[str, Any]
    """TrainingArguments(**trainer_args) on every rank (`trainer_arguments`)."""

    def _json_fields(self) -> dict[str, Any]:
        return {"train": dataclasses.asdict(self.train)}  # its datasets and parallel as plain dicts too

    @classmethod
    def _from_json_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
        train = data["train"]
        return {"train": TrainConfig(**{**train, "datasets": [DatasetSpec(**d) for d in train["datasets"]],
                                        "parallel": ParallelismConfig(**train["parallel"])})}


def write_jobs(path: str | os.PathLike, jobs: list[Job]) -> None:
    data = jobs[0].to_json() if len(jobs) == 1 else {"jobs": [job.to_json() for job in jobs]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


def read_jobs(path: str | os.PathLike) -> list[Job]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return [Job.from_json(job) for job in data.get("jobs", [data])]


# ---------------------------------------------------------------------------------------- building a TrainJob
def _steps_per_epoch(cfg: TrainConfig, rows: int, dp: int) -> int:
    """Optimizer steps in one pass over `rows` samples: each dp rank takes ceil(rows / dp) of them."""
    return max(1, math.ceil(math.ceil(math.ceil(rows / dp) / cfg.micro_batch_size) / cfg.gradient_accumulation_steps))


def _every(steps: int | float | None, per_epoch: int | None, epoch_steps: int) -> int | float | None:
    """Axolotl's evals_per_epoch / saves_per_epoch as a step interval (an explicit *_steps wins)."""
    if steps is not None:
        return steps
    return max(1, epoch_steps // per_epoch) if per_epoch else None


def trainer_arguments(cfg: TrainConfig, name: str, train_rows: int, eval_rows: int, dp: int) -> dict:
    """TrainingArguments(**this) on every rank: Axolotl's keys in the Trainer's words."""
    import torch

    epoch_steps = _steps_per_epoch(cfg, train_rows, dp)
    eval_every = _every(cfg.eval_steps, cfg.evals_per_epoch, epoch_steps)
    save_every = _every(cfg.save_steps, cfg.saves_per_epoch, epoch_steps)
    no_evals = cfg.evals_per_epoch == 0 and cfg.eval_steps is None  # Axolotl's evals_per_epoch: 0 = no evaluation
    eval_strategy = "no" if not eval_rows or no_evals else cfg.eval_strategy or ("steps" if eval_every else "epoch")
    save_strategy = cfg.save_strategy or ("steps" if save_every else "no")
    precision = mixed_precision(cfg.bf16, cfg.fp16, cfg.float16)
    args = dict(
        output_dir=cfg.output_dir, run_name=name, report_to=[], disable_tqdm=True, remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(), seed=cfg.seed,
        per_device_train_batch_size=cfg.micro_batch_size,
        per_device_eval_batch_size=cfg.eval_batch_size or cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, num_train_epochs=cfg.num_epochs,
        max_steps=cfg.max_steps or -1, learning_rate=cfg.learning_rate,
        optim="adamw_torch" if cfg.optimizer == "muon" else cfg.optimizer,  # muon: schedules.use_muon builds it
        # Axolotl's rex / one_cycle: "cosine" in TrainingArguments, built in create_scheduler (schedules.use_alternate)
        lr_scheduler_type="cosine" if cfg.lr_scheduler in ALTERNATE_SCHEDULERS else cfg.lr_scheduler,
        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
        # transformers 5 reads a warmup_steps below 1 as a share of the steps (what warmup_ratio was)
        warmup_steps=cfg.warmup_ratio if cfg.warmup_ratio is not None else (cfg.warmup_steps or 0),
        bf16=precision == "bf16", fp16=precision == "fp16",
        logging_strategy="steps", logging_steps=1,  # one train_log.jsonl line per optimizer step
        eval_strategy=eval_strategy, save_strategy=save_strategy, save_total_limit=cfg.save_total_limit)
    if eval_strategy == "steps":
        args["eval_steps"] = eval_every
    if save_strategy == "steps":
        args["save_steps"] = save_every or 500
    if trainer_keys.loads_best(cfg):  # Axolotl: load_best_model_at_end on eval_loss (the Trainer's default metric)
        args["load_best_model_at_end"] = True
    args.update(objective.best_args(cfg))  # save_strategy: best's metric_for_best_model, greater_is_better
    if cfg.curriculum_sampling:  # Axolotl's SequentialSampler; the dp ranks take consecutive parts of each batch
        args["train_sampling_strategy"] = "sequential"
    if cfg.save_only_model:  # checkpoints: the model only (plugins/trainer/adopt.py writes it whole)
        args["save_only_model"] = True
    if cfg.tf32 is True and torch.cuda.is_available():  # TF32 exists on CUDA only; on CPU ranks the key is a no-op
        args["tf32"] = True
    for key in ("adam_beta1", "adam_beta2", "adam_epsilon"):
        if getattr(cfg, key) is not None:
            args[key] = getattr(cfg, key)
    scheduler = scheduler_args(cfg)  # cosine_min_lr_ratio (extras.py)
    return {**args, **scheduler, **param_groups.trainer_args(cfg, scheduler)}  # lr_scheduler_kwargs, optim_args


def check_layout_rules(cfg: TrainConfig, path) -> None:
    layout = cfg.parallel
    if layout.pp_size > 1 and cfg.micro_batch_size % layout.microbatches:  # the ranks' check, before they start
        raise ConfigError(f"{path}: micro_batch_size={cfg.micro_batch_size} cannot be split into "
                          f"pp_microbatches={layout.microbatches} pipeline micro-batches (pipeline_parallel_size="
                          f"{layout.pp_size}); set micro_batch_size to a multiple of {layout.microbatches}, or "
                          "pp_microbatches to a divisor of it")
    if layout.pp_size > 1 and layout.pp_backend == "deepspeed" and cfg.gradient_accumulation_steps > 1:
        # DeepSpeed all-reduces a tied weight's whole gradient at the end of every schedule run, so a second
        # accumulated run would count the first one's tied gradient twice.
        raise ConfigError(f"{path}: gradient_accumulation_steps={cfg.gradient_accumulation_steps} with "
                          "pp_backend='deepspeed': the pipeline already splits each step into micro-batches; set "
                          "gradient_accumulation_steps: 1 and raise pp_microbatches, or use pp_backend='torch'")
    resume = cfg.resume_from_checkpoint
    if resume and resume != "auto" and not os.path.isdir(resume):
        raise ConfigError(f"{path}: resume_from_checkpoint={resume!r} is not a directory; point it at a "
                          f"checkpoint-N folder under {cfg.output_dir}, or write 'auto' for the latest complete one")
    if resume and resume != "auto":  # a model-only (save_only_model) or foreign folder: refused before any rank starts
        from nd_parallel.plugins.trainer.adopt import check_resumable

        try:
            check_resumable(resume)
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(f"{path}: {err}") from None


def _no_tp_plan(model, layout: ParallelismConfig) -> bool:
    """Whether TP would find no plan for ``model`` (the ranks' tensor_parallel.check_model refuses that)."""
    from nd_parallel.distributed import tensor_parallel

    try:
        return not tensor_parallel.resolve_plan(model, tensor_parallel.plan_overrides(model, layout))
    except Exception:  # noqa: BLE001 - a plan this cannot read is checked and explained by the ranks
        return False


def check_local_model(cfg: TrainConfig, layout: ParallelismConfig, path) -> None:
    """The ranks' model checks that a local config.json can answer, made on the meta device before any rank starts:
    CP on a model that mixes tokens outside attention (a Mamba mixer, a short convolution:
    context_parallel.hf.check_sequence_mixing; Axolotl's examples/nemotron-h/nano-30b-a3b-qlora-cp.yaml stopped
    on the ranks), QAT groups that do not divide a layer's input features (models.qat), TP on a model without a
    tp_plan (Mllama, for one), and fsdp_config's transformer_layer_cls_to_wrap naming a class the model does not have
    (Accelerate's wrap policy stops there too; FSDP2 here shards per decoder layer, so a name that is in the model
    changes nothing, and one that is not is a wrong file: a config copied from another family)."""
    source = cfg.base_model_config or cfg.base_model
    if not (layout.cp_size > 1 or cfg.qat or layout.tp_size > 1 or cfg.fsdp_wrap_classes) or not os.path.isfile(
            os.path.join(source, "config.json")):
        return  # a hub name, or nothing to check: the ranks check the loaded model as before
    import torch
    from transformers import AutoConfig

    from .reward import auto_class

    remote = {"trust_remote_code": True} if cfg.trust_remote_code else {}
    try:
        config = AutoConfig.from_pretrained(source, **remote, **(cfg.model_config or {}))
        with torch.device("meta"):  # no memory: only the modules' classes and shapes are read
            model = auto_class(cfg, {"config": config}).from_config(config, **remote)
    except Exception:  # noqa: BLE001 - a model this cannot build is loaded, checked and explained by the ranks
        return
    classes = {type(m).__name__ for m in model.modules()}
    missing = [name for name in cfg.fsdp_wrap_classes if name not in classes]
    if missing:
        from nd_parallel.models import hf

        layers = sorted({type(layer).__name__ for layer in hf.decoder_layers(model)})
        raise ConfigError(f"{path}: fsdp_config transformer_layer_cls_to_wrap names {', '.join(missing)}, which "
                          f"{type(model).__name__} ({source}) does not have; its decoder layers are "
                          f"{', '.join(layers) or 'not found'}: set transformer_layer_cls_to_wrap: {','.join(layers)} "
                          "(nd_parallel shards per decoder layer whatever it names) or drop it")
    if layout.tp_size > 1 and _no_tp_plan(model, layout):
        raise ConfigError(f"{path}: tensor_parallel_size={layout.tp_size} with base_model {source}: "
                          f"{type(model).__name__} has no tp_plan (transformers gives its config none), so TP "
                          "cannot shard it; use dp_shard_size / dp_replicate_size, or give the layout a tp_plan")
    if layout.cp_size > 1:
        from nd_parallel.distributed.context_parallel.hf import check_sequence_mixing

        try:
            check_sequence_mixing(model)
        except NotImplementedError as err:
            raise ConfigError(f"{path}: context_parallel_size={layout.cp_size} with base_model {source}: {err}") \
                from None
    if cfg.qat:
        from nd_parallel.models.qat import QATOptions, qat_targets

        try:
            qat_targets(model, QATOptions.from_dict(cfg.qat))
        except ConfigError as err:
            raise ConfigError(f"{path}: qat with base_model {source}: {err}") from None


def _mamba_ssm(cfg: TrainConfig, workdir: str) -> None:
    """Axolotl's model_type: MambaLMHeadModel: a mamba_ssm checkpoint (local, or a hub name fetched here) becomes a
    transformers MambaForCausalLM checkpoint of the same weights (models/mamba_ssm_checkpoint.py)."""
    from nd_parallel.models import mamba_ssm_checkpoint as mamba

    source = cfg.base_model
    if not os.path.isdir(source):
        from huggingface_hub import snapshot_download

        source = snapshot_download(source, allow_patterns=["config.json", "pytorch_model.bin", "*.safetensors"])
    if mamba.is_mamba_ssm(source):
        found = mamba.problems(source)
        if found:
            raise ConfigError(f"model_type='MambaLMHeadModel' with {cfg.base_model}: {'; '.join(found)}")
        cfg.base_model = mamba.convert(source, os.path.join(workdir, "mamba-hf"))
        cfg.notes.append(f"model_type: MambaLMHeadModel: {source} (mamba_ssm's format) trains as transformers' "
                         f"MambaForCausalLM, the same weights converted to {cfg.base_model}; the run saves "
                         "transformers' format")
    cfg.model_type = "MambaForCausalLM"


def build_job(path, cfg: TrainConfig, layout: ParallelismConfig, workdir: str, quiet: bool = True):
    """(the ranks' TrainJob, the data.Prepared data) for a loaded config and a resolved layout."""
    from .data import prepare

    check_layout_rules(cfg, path)
    if cfg.model_type == "MambaLMHeadModel":  # mamba_ssm's format -> transformers' MambaForCausalLM, in the parent
        _mamba_ssm(cfg, workdir)
    if cfg.rl in grpo.RL:
        problem = grpo.batch_problem(cfg, layout.dp_size)  # TRL's rule, raised on the ranks otherwise
        if problem:
            raise ConfigError(f"{path}: {problem}")
        # GRPOTrainer computes its log-probs with its own fused head, not the model's loss
        layout = dataclasses.replace(layout, loss_chunk_size=0)
    check_installed(cfg.optimizer, path)
    check_layout(cfg, layout, path)
    restarts.check_layout(cfg, layout, path)  # lisa / relora
    sparsity.check_layout(cfg, layout, path)  # llmcompressor's masks
    check_local_model(cfg, layout, path)
    check_llama4_experts(cfg, cfg.base_model, layout, path)
    check_dora_layout(cfg, layout, path)
    adapter_options.check_layout(cfg, layout, path)  # trainable token rows, replicated layers
    trainer_class.check(cfg, path)  # trainer_cls: imports, a transformers.Trainer subclass
    prepared = prepare(cfg, workdir, dp=layout.dp_size)  # a stream is read for this many dp ranks' batches
    per_micro = cfg.micro_batch_size * layout.dp_size
    if prepared.train_rows < per_micro:
        raise ConfigError(f"{path}: {prepared.train_rows} training samples, but one micro-batch over "
                          f"{layout.dp_size} data-parallel ranks needs micro_batch_size x {layout.dp_size} = "
                          f"{per_micro}; add data or lower micro_batch_size")
    name = os.path.splitext(os.path.basename(str(path)))[0]
    args = trainer_arguments(cfg, name, prepared.train_rows, prepared.eval_rows, layout.dp_size)
    if args["save_strategy"] != "no" and not args.get("save_only_model") and steps_local_shards(cfg, layout):
        # The optimizer's state is per rank and cannot go into a sharded checkpoint (optimizer_8bit.refuse_checkpoint):
        # without this the run would train and then stop at its first checkpoint.
        args["save_only_model"] = True
        cfg.notes.append(f"optimizer={cfg.optimizer} on {layout.world_size // layout.pp_size} sharded ranks: its "
                         "state cannot be checkpointed yet, so checkpoints hold the model only (save_only_model) and "
                         "cannot be resumed; use optimizer: adamw_torch or adamw_torch_8bit for resumable ones")
    job = TrainJob(name=name, layout=layout, quiet=quiet, train=cfg, prepared=prepared.path, trainer_args=args)
    return job, prepared


def steps_local_shards(cfg: TrainConfig, layout: ParallelismConfig) -> bool:
    """A bitsandbytes optimizer on DTensor parameters (every layout but one rank or a pipeline alone, fsdp.py shards
    or replicates them) steps each rank's shards (distributed/optimizer_8bit.py)."""
    from .keys import BNB_OPTIMIZERS

    return cfg.optimizer in BNB_OPTIMIZERS and layout.world_size // layout.pp_size > 1
