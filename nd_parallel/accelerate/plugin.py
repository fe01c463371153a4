"""NDParallelPlugin: attach nd_parallel to an ``accelerate.Accelerator``.

``attach`` replaces a handful of the accelerator's methods on that one instance (prepare*, clip_grad_norm_,
get_state_dict) so that an unchanged Accelerate loop trains under any layout. The plugin only orchestrates:
the work is done by parallelize.py (model), data.py (dataloader), loss.py and grad_norm.py, and around every run by
fault/ (hang watchdog, agreement at prepare, non-finite values, preemption signals, the order a process ends in).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader

from nd_parallel.checkpoint.dataloader import track as track_position
from nd_parallel.config import ParallelismConfig
from nd_parallel.distributed.data import check_batch_size, shard_dataloader
from nd_parallel.distributed.grad_norm import clip_grad_norm_
from nd_parallel.distributed.mesh import ParallelMesh, build_mesh, single_process_group
from nd_parallel.distributed.parallelize import check_model, parallelize
from nd_parallel.distributed.precision import check_mixed_precision, policy_for
from nd_parallel.distributed.tensor_parallel import check_styles
from nd_parallel.fault.runtime import FaultTolerance
from nd_parallel.models import peft as adapters
from nd_parallel.models.loading import from_pretrained as load_pretrained

logger = logging.getLogger("nd_parallel")

_SUPPORTED_TYPES = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.FSDP}


def _setup_logging(is_main: bool) -> None:
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[nd_parallel] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if is_main else logging.WARNING)
    logger.propagate = False


def _check_accelerator_saw_all_ranks(accelerator) -> None:
    """A CPU-only Accelerator() ignores torchrun's ranks unless told to use the CPU: say so instead of hanging."""
    import os

    launched = int(os.environ.get("WORLD_SIZE", "1"))  # launcher boundary: torchrun / accelerate launch
    if accelerator.num_processes == 1 and launched > 1:
        raise RuntimeError(
            f"the launcher started WORLD_SIZE={launched} ranks but the Accelerator sees 1 process: on a machine "
            "without GPUs create it with Accelerator(cpu=True), launch with `accelerate launch --cpu`, or set "
            "ACCELERATE_USE_CPU=true"
        )


def _check_fresh_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if optimizer.state:
        raise ValueError(
            "the optimizer already has state (it has stepped); build it on the unsharded model and pass it to "
            "prepare() before the first step, so it can be re-pointed to the sharded parameters"
        )


class NDParallelPlugin:
    """Applies a :class:`ParallelismConfig` to the objects an Accelerator prepares."""

    def __init__(self, config: ParallelismConfig | None = None, **sizes):
        if config is not None and sizes:
            raise ValueError("pass either a ParallelismConfig or keyword sizes, not both")
        self.config = config if config is not None else ParallelismConfig(**sizes)
        self.accelerator = None
        self._mesh: ParallelMesh | None = None
        self._param_map: dict[int, list[nn.Parameter]] = {}
        self._models: list[nn.Module] = []
        self.mp_policy = None  # FSDP2 MixedPrecisionPolicy for the accelerator's mixed_precision (precision.py)
        self.loading_report = None  # what this rank read at prepare() for a model from from_pretrained (loading.py)

    @classmethod
    def from_env(cls, environ=None) -> "NDParallelPlugin":
        """The layout `accelerate launch` passed (PARALLELISM_CONFIG_*), taken over from Accelerate.

        Call it before ``Accelerator()``: it also adjusts the launcher's variables so that Accelerate neither
        builds its own mesh nor ignores CPU ranks (see ``nd_parallel.cli.train.rank.adopt_launcher_env``).
        """
        from .launcher_env import adopt_launcher_env

        adopt_launcher_env(environ)
        return cls(ParallelismConfig.from_env(environ))

    # ------------------------------------------------------------------ attach
    def attach(self, accelerator) -> "NDParallelPlugin":
        """Validate the layout against the accelerator (no collective yet) and take over its prepare path."""
        if accelerator.distributed_type not in _SUPPORTED_TYPES:
            raise NotImplementedError(
                f"Accelerator distributed_type={accelerator.distributed_type} is not supported by nd_parallel; "
                "launch with plain multi-process (accelerate launch --multi_gpu / --cpu, or torchrun)"
            )
        check_mixed_precision(accelerator.mixed_precision)
        _check_accelerator_saw_all_ranks(accelerator)
        self.config = self.config.resolve(accelerator.num_processes)
        c = self.config
        if c.pp_size > 1 and c.pp_backend == "deepspeed" and accelerator.mixed_precision == "bf16":
            raise NotImplementedError(
                "mixed_precision='bf16' with pp_backend='deepspeed': DeepSpeed's pipeline engine keeps its own "
                "precision state and would not follow nd_parallel's fp32-master recipe; use pp_backend='torch'")
        self.mp_policy = policy_for(accelerator.mixed_precision)
        check_styles(c.tp_plan or {})  # a typo in an override is an error even while tp_size=1
        if c.pp_size > 1 and c.pp_backend == "deepspeed":
            from nd_parallel.distributed.pipeline.deepspeed_backend import require_deepspeed

            require_deepspeed()  # a missing package is reported before the first collective
        self.accelerator = accelerator
        _setup_logging(accelerator.is_main_process)
        self._originals = {
            name: getattr(accelerator, name) for name in ("prepare", "backward", "clip_grad_norm_", "get_state_dict")
        }
        accelerator.prepare = self.prepare
        accelerator.prepare_model = self.prepare_model
        accelerator.prepare_optimizer = self.prepare_optimizer
        accelerator.prepare_data_loader = self.prepare_data_loader
        accelerator.prepare_scheduler = self.prepare_scheduler
        accelerator.backward = self.backward
        accelerator.clip_grad_norm_ = self.clip_grad_norm_
        accelerator.get_state_dict = self.get_state_dict
        for name in ("gather", "gather_for_metrics"):  # evaluation.py: over the dp ranks only
            self._originals[name] = getattr(accelerator, name, None)
        accelerator.gather = self.gather
        accelerator.gather_for_metrics = self.gather_for_metrics
        for name in ("save_state", "load_state", "save_model", "skip_first_batches"):  # checkpoint/ does these
            self._originals[name] = getattr(accelerator, name, None)
            setattr(accelerator, name, getattr(self, name))
        accelerator.nd_parallel = self
        self.fault = FaultTolerance(self)  # watchdog, non-finite guard, signals, exit order (fault/)
        logger.info("attached: %s", c.describe())
        return self

    @property
    def mesh(self) -> ParallelMesh:
        """Built on first use, after every input was validated, because building it is a collective."""
        if self._mesh is None:
            self._require_attached()
            self._mesh = build_mesh(self.config, self.accelerator.device.type)
            self.fault.on_mesh(self._mesh)
        return self._mesh

    def _require_attached(self) -> None:
        if self.accelerator is None:
            raise RuntimeError("call plugin.attach(accelerator) first")

    # ----------------------------------------------------------------- prepare
    def prepare(self, *objects, device_placement=None):
        """Accelerator.prepare: models first (optimizers are re-pointed to their new parameters), then the rest."""
        self._require_attached()
        for obj in objects:  # every check before the first collective
            if isinstance(obj, nn.Module):
                check_model(obj, self.config, self.accelerator.device.type)
            elif isinstance(obj, DataLoader):
                check_batch_size(obj, self.config, self.accelerator.split_batches)
            elif isinstance(obj, torch.optim.Optimizer):
                _check_fresh_optimizer(obj)
        self.fault.check_agreement(objects)  # same config, model, data, versions on every rank (fault/agreement.py)
        prepared = {id(o): self.prepare_model(o) for o in objects if isinstance(o, nn.Module)}
        for obj in objects:
            if id(obj) in prepared:
                continue
            if isinstance(obj, torch.optim.Optimizer):
                prepared[id(obj)] = self.prepare_optimizer(obj)
            elif isinstance(obj, DataLoader):
                prepared[id(obj)] = self.prepare_data_loader(obj)
        for obj in objects:  # schedulers last: they look up their prepared optimizer
            if id(obj) not in prepared:
                is_sched = isinstance(obj, torch.optim.lr_scheduler.LRScheduler)
                prepared[id(obj)] = self.prepare_scheduler(obj) if is_sched else self._originals["prepare"](obj)
        result = tuple(prepared[id(o)] for o in objects)
        return result[0] if len(result) == 1 else result

    def prepare_model(self, model: nn.Module, device_placement=None, evaluation_mode=False) -> nn.Module:
        """Lay the model out (distributed/parallelize.py decides everything and its order) and remember how to
        re-point an optimizer built on the unsharded model."""
        accelerator = self.accelerator
        distributed = accelerator.num_processes > 1
        done = parallelize(model, self.config, accelerator.device, lambda: self._mesh_for_prepare(distributed),
                           distributed=distributed, mp_policy=self.mp_policy)
        if done.loading is not None:
            self.loading_report = done.loading
        for key, targets in done.replaced.items():
            self._param_map.setdefault(key, []).extend(t for t in targets if all(t is not s for s in
                                                                                   self._param_map[key]))
        self._models.append(done.model)
        accelerator._models.append(done.model)
        return done.model

    def _mesh_for_prepare(self, distributed: bool) -> ParallelMesh | None:
        """One process has nothing to split but follows the same recipe as every layout: bf16 goes through a
        one-rank fully_shard, which needs a one-rank process group and mesh."""
        if not distributed and self.mp_policy is not None:
            single_process_group(self.accelerator.device.type)
        return self.mesh if distributed or self.mp_policy is not None else None

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        _check_fresh_optimizer(optimizer)
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                params.extend(self._param_map.get(id(p), [p]) if self._param_map else [p])
            group["params"] = params
        wrapped = AcceleratedOptimizer(optimizer, device_placement=False, scaler=None)
        self.fault.on_optimizer(wrapped)  # counts steps; skips one the non-finite guard refused
        self.accelerator._optimizers.append(wrapped)
        return wrapped

    def prepare_data_loader(self, data_loader: DataLoader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return data_loader
        check_batch_size(data_loader, self.config, self.accelerator.split_batches)
        prepared = shard_dataloader(data_loader, self.config, self.accelerator.process_index, self.accelerator)
        track_position(prepared)  # so that save_state / load_state keep where the loop stands
        self.fault.on_dataloader(prepared)  # save_on_signal: its workers outlive the signal until the rank saves
        self.accelerator._dataloaders.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler):
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler
        optimizers = self.accelerator._optimizers
        owner = [o for o in optimizers if getattr(scheduler, "optimizer", None) is o.optimizer] or optimizers
        # split_batches=True makes Accelerate step the schedule once per optimizer step. Its default steps it
        # num_processes times, which would count tp/pp peers as if they were extra data-parallel batches.
        wrapped = AcceleratedScheduler(
            scheduler, owner, step_with_optimizer=self.accelerator.step_scheduler_with_optimizer, split_batches=True
        )
        self.accelerator._schedulers.append(wrapped)
        return wrapped

    # ------------------------------------------------------------ training ops
    def backward(self, loss, **kwargs):
        """Accelerate's backward, except where the pipeline schedule already ran it inside forward."""
        self.fault.observe_loss(loss)
        if getattr(loss, "_nd_parallel_backward_done", False):
            return None
        return self._originals["backward"](loss, **kwargs)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The true global gradient norm over every dimension, identical on every rank."""
        parameters = list(parameters)
        check = self.fault.observe_norm  # NaN/Inf: stop naming step, rank, parameter, or skip (fault/nonfinite.py)
        if self.config.pp_size == 1 or self._mesh is None:
            return clip_grad_norm_(parameters, max_norm, norm_type, check=check)
        # Stages hold different parameters: add their squares over pp; count a tied weight's copy once.
        skip = {id(m.tied.duplicate) for m in self._models if getattr(m, "tied", None) and m.tied.duplicate is not None}
        return clip_grad_norm_(parameters, max_norm, norm_type, extra_group=self.mesh["pp"].get_group(),
                               exclude_from_norm=skip, check=check)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Full, unsharded, HF-named state dict on the main process (an empty dict on the others)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not dist.is_initialized() or (self.accelerator.num_processes == 1 and self._mesh is None):
            return {k: v.detach().cpu() for k, v in model.state_dict().items()}
        if self.config.pp_size == 1:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(model, options=options)
            return state if self.accelerator.is_main_process else {}
        return adapters.with_peft_names(model, self._pipeline_state_dict(model))

    def _pipeline_state_dict(self, model) -> dict[str, torch.Tensor]:
        """Each stage gathers its full tensors, then the pp ranks send theirs to the main process."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        state = {}
        for stage in model.stages:
            state.update({k: v.detach().cpu() for k, v in get_model_state_dict(stage, options=options).items()})
        mesh = self.mesh
        inner_first = all(mesh.local_rank(d) == 0 for d in ("dp_replicate", "dp_shard", "cp", "tp"))
        pieces = [None] * mesh.size("pp") if self.accelerator.is_main_process else None
        if inner_first:  # one rank per stage sends; pp group of the first dp/cp/tp coordinate
            dist.gather_object(state, pieces, group=mesh["pp"].get_group(), group_dst=0)
        if not self.accelerator.is_main_process:
            return {}
        merged = {}
        for piece in pieces:
            merged.update(piece)
        return merged

    # -------------------------------------------------------------- evaluation
    def gather(self, tensor):
        """accelerator.gather (and so gather_for_metrics): over the data-parallel ranks only, since tp/cp/pp peers
        hold the same samples; every rank gets the whole result."""
        from nd_parallel.distributed.evaluation import gather_objects_over, gather_over

        if self._mesh is None or self.accelerator.num_processes == 1:
            return self._originals["gather"](tensor)
        group = self.mesh["dp"].get_group()
        if isinstance(tensor, list) and tensor and not isinstance(tensor[0], torch.Tensor):
            return gather_objects_over(tensor, group)
        return gather_over(tensor, group)

    def gather_for_metrics(self, input_data, use_gather_object=False):
        """Accelerate's, over the dp ranks (tensors through ``gather`` above; other objects here), dropping the
        duplicated tail of the last batch as Accelerate does."""
        from accelerate.utils import recursively_apply

        from nd_parallel.distributed.evaluation import gather_objects_over

        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            all_tensors = True
        except TypeError:
            all_tensors = False
        if (all_tensors and not use_gather_object) or self._mesh is None or self.accelerator.num_processes == 1:
            return self._originals["gather_for_metrics"](input_data, use_gather_object=use_gather_object)
        objects = input_data if isinstance(input_data, list) else [input_data]
        data = gather_objects_over(objects, self.mesh["dp"].get_group())
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            return data[: state.remainder]
        return data

    # ------------------------------------------------------------- checkpoints
    def save_state(self, output_dir=None, **kwargs):
        """accelerator.save_state: an atomic, sharded DCP checkpoint under HF names (checkpoint/state.py)."""
        from nd_parallel.checkpoint import save_state

        self.fault.before_save()  # never a checkpoint holding NaN/Inf
        return save_state(self, output_dir, **kwargs)

    def preemption_requested(self) -> bool:
        """With ``save_on_signal``: True on every rank, after the same optimizer step, once any rank got SIGTERM or
        SIGINT. Ask after ``optimizer.step()``; then ``accelerator.save_state(...)`` and leave the loop. One small
        all_reduce per call."""
        self._require_attached()
        return self.fault.preemption_requested()

    def load_state(self, input_dir=None, **kwargs):
        """accelerator.load_state: checked first, then loaded under this layout, whatever layout saved it."""
        from nd_parallel.checkpoint import load_state

        return load_state(self, input_dir, **kwargs)

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True,
                   merge_adapter: bool = False):
        """accelerator.save_model: HF safetensors + config.json, gathered and written one tensor at a time.

        For a PEFT model: the adapter (adapter_model.safetensors + adapter_config.json), or with
        ``merge_adapter=True`` the base model with the adapter folded in (checkpoint/adapter.py)."""
        from nd_parallel.checkpoint import save_model

        return save_model(self, model, save_directory, max_shard_size, safe_serialization, merge_adapter)

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """Accelerate's, except right after load_state, which already put the dataloader where it was."""
        from nd_parallel.checkpoint.dataloader import has_pending

        if has_pending(dataloader):
            raise RuntimeError(
                f"skip_first_batches(num_batches={num_batches}): accelerator.load_state already positioned this "
                "dataloader where the saved run stopped; iterate it directly (skipping as well would skip twice)")
        return self._originals["skip_first_batches"](dataloader, num_batches=num_batches)

    # ----------------------------------------------------------------- loading
    def from_pretrained(self, path, memory_efficient: bool = True, peft_config=None, **hf_kwargs) -> nn.Module:
        """Load a causal LM from a local safetensors checkpoint directory without reading its weights yet.

        The model comes back on the meta device; ``accelerator.prepare`` splits and shards it, then each rank
        reads from the safetensors files only the slices it owns (``nd_parallel.models.loading``). The parameters equal those of a
        plain ``AutoModelForCausalLM.from_pretrained(path, **hf_kwargs)``. Where that cannot be promised (a hub
        id, weights transformers converts on load, arguments such as ``device_map``) the plain path is taken,
        with a warning; ``memory_efficient=False`` takes it always (e.g. to use the model before ``prepare``).
        Weights are read from safetensors only; ``trust_remote_code`` is passed on only if you pass it.
        ``peft_config`` (e.g. ``LoraConfig``): returns ``get_peft_model(model, peft_config)``, still read slice by
        slice at prepare; the adapter's init is the one a plain ``get_peft_model`` gives under the same seed.
        """
        return load_pretrained(path, memory_efficient=memory_efficient, peft_config=peft_config, **hf_kwargs)
