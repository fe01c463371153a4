"""NDParallelPlugin: attach nd_parallel to an ``accelerate.Accelerator``.

``attach`` replaces a handful of the accelerator's methods on that one instance (prepare*, backward,
clip_grad_norm_, unscale_gradients, get_state_dict, gather*, save/load_state, save_model, skip_first_batches) so
that an unchanged Accelerate loop trains under any layout. fp16 keeps Accelerate's own loss-scaling path with a
scaler whose overflow flag every rank agrees on (``scaling.py``). The plugin only routes: the model is laid out by
``distributed/parallelize.py``, the dataloader sharded by ``distributed/data.py``, the norm computed by
``distributed/grad_norm.py``, checkpoints handled by ``checkpoint/`` and faults by ``fault/``, each given a
``TrainState`` rather than the plugin.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from torch.utils.data import DataLoader

from nd_parallel import checkpoint
from nd_parallel.checkpoint.dataloader import has_pending
from nd_parallel.checkpoint.dataloader import track as track_position
from nd_parallel.config import ParallelismConfig
from nd_parallel.distributed.data import check_batch_size, shard_dataloader
from nd_parallel.distributed.grad_norm import clip_grad_norm_
from nd_parallel.distributed.mesh import ParallelMesh, build_mesh, single_process_group
from nd_parallel.distributed.optimizer import prefer_foreach
from nd_parallel.distributed.optimizer_8bit import refuse_checkpoint, step_local_shards
from nd_parallel.distributed.parallelize import check_model, parallelize
from nd_parallel.distributed.precision import policy_for
from nd_parallel.fault.runtime import FaultTolerance
from nd_parallel.models.loading import from_pretrained as load_pretrained

from . import accelerate_config, evaluation, scaling
from .checks import check_accelerator, check_fresh_optimizer, check_layout, check_master_weights
from .launch_keys import apply_fsdp_keys, check_wrap_class
from .launcher_env import adopt_launcher_env, launched_world_size

logger = logging.getLogger("nd_parallel")

# Accelerator methods the plugin replaces on the instance it is attached to (attach keeps the originals).
ROUTED = ("prepare", "prepare_model", "prepare_optimizer", "prepare_data_loader", "prepare_scheduler", "backward",
          "clip_grad_norm_", "get_state_dict", "gather", "gather_for_metrics", "save_state", "load_state",
          "save_model", "skip_first_batches", "maybe_context_parallel", "unscale_gradients")


def _setup_logging(is_main: bool) -> None:
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[nd_parallel] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if is_main else logging.WARNING)
    logger.propagate = False


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
        self.scaler = None  # fp16: the loss scaler every rank agrees with (accelerate/scaling.py)
        self.loading_report = None  # what this rank read at prepare() for a model from from_pretrained
        self._expose = False  # attach(expose=...): the layout shown as accelerator.parallelism_config

    @classmethod
    def from_env(cls, environ=None) -> NDParallelPlugin:
        """The layout `accelerate launch` passed (PARALLELISM_CONFIG_*), taken over from Accelerate.

        Call it before ``Accelerator()``: it also adjusts the launcher's variables so that Accelerate neither
        builds its own mesh nor ignores CPU ranks (``launcher_env.adopt_launcher_env``).
        """
        adopt_launcher_env(environ)
        return cls(ParallelismConfig.from_env(environ))

    # ------------------------------------------------------------------ attach
    def attach(self, accelerator, expose: bool = True) -> NDParallelPlugin:
        """Validate the layout against the accelerator (no collective yet) and take over its calls.

        ``expose``: show the layout as ``accelerator.parallelism_config`` / ``torch_device_mesh`` (Accelerate's
        attributes; the mesh once it is built). The Trainer integration passes False: the Trainer and TRL turn
        Accelerate's own tp / cp arithmetic on when they see one (plugins/trainer/adopt.py)."""
        check_accelerator(accelerator, launched_world_size())
        given = self.config
        accelerate_config.refuse_two_layouts(accelerator, given)
        self.config = apply_fsdp_keys(given.resolve(accelerator.num_processes))  # the launch file's fsdp_config
        check_layout(accelerator, self.config)
        self._expose = expose or getattr(accelerator, "parallelism_config", None) is not None
        self._mesh = accelerate_config.mesh_built_for(given, self.config)
        self.mp_policy = policy_for(accelerator.mixed_precision)
        self.scaler = scaling.install_scaler(accelerator)  # fp16 only; replaces the one Accelerate built, if any
        self.accelerator = accelerator
        _setup_logging(accelerator.is_main_process)
        self._originals = {name: getattr(accelerator, name, None) for name in ROUTED}
        for name in ROUTED:
            setattr(accelerator, name, getattr(self, name))
        accelerator.nd_parallel = self
        distributed = dist.is_initialized() and accelerator.num_processes > 1
        # watchdog, non-finite guard, signals, exit order (fault/)
        self.fault = FaultTolerance(self.config, accelerator.device, distributed, self.train_state)
        if self._mesh is not None:
            self.fault.on_mesh(self._mesh)
        accelerate_config.show(accelerator, self.config, self._mesh, self._expose)
        logger.info("attached: %s", self.config.describe())
        return self

    @property
    def mesh(self) -> ParallelMesh:
        """Built on first use, after every input was validated, because building it is a collective."""
        if self._mesh is None:
            self._require_attached()
            self._mesh = build_mesh(self.config, self.accelerator.device.type)
            self.fault.on_mesh(self._mesh)
            accelerate_config.show(self.accelerator, self.config, self._mesh, self._expose)
        return self._mesh

    def _require_attached(self) -> None:
        if self.accelerator is None:
            raise RuntimeError("call plugin.attach(accelerator) first")

    def train_state(self) -> checkpoint.TrainState:
        """What checkpoint/ and fault/ act on, read from the Accelerator now."""
        acc = self.accelerator
        return checkpoint.TrainState(
            config=self.config, device=acc.device, models=list(self._models), optimizers=list(acc._optimizers),
            schedulers=list(acc._schedulers), dataloaders=list(acc._dataloaders),
            custom_objects=list(acc._custom_objects), process_index=acc.process_index,
            num_processes=acc.num_processes, is_main_process=acc.is_main_process, step=int(acc.step),
            steps_taken=self.fault.step, project=acc.project_configuration,
            project_dir=acc.project_dir, scaler=self.scaler)

    # ----------------------------------------------------------------- prepare
    def prepare(self, *objects, device_placement=None):
        """Accelerator.prepare: models first (optimizers are re-pointed to their new parameters), then the rest."""
        self._require_attached()
        for obj in objects:  # every check before the first collective
            if isinstance(obj, nn.Module):
                check_model(obj, self.config, self.accelerator.device.type)
                check_wrap_class(obj)  # the launch file's fsdp_transformer_layer_cls_to_wrap
                check_master_weights(obj, self.accelerator.mixed_precision)
            elif isinstance(obj, DataLoader):
                check_batch_size(obj, self.config, self.accelerator.split_batches)
            elif isinstance(obj, torch.optim.Optimizer):
                check_fresh_optimizer(obj)
        self.fault.check_agreement(objects)  # same config, model, data, versions on every rank (fault/agreement.py)
        prepared = {id(o): self.prepare_model(o) for o in objects if isinstance(o, nn.Module)}
        for obj in objects:
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
        """Lay the model out (parallelize.py decides everything and its order); remember how to re-point an
        optimizer built on the unsharded model."""
        acc = self.accelerator
        distributed = acc.num_processes > 1
        done = parallelize(model, self.config, acc.device, lambda: self._mesh_for_prepare(distributed),
                           distributed=distributed, mp_policy=self.mp_policy)
        self.loading_report = done.loading or self.loading_report
        scaling.reach_pipeline(done.model, self.scaler)
        for key, targets in done.replaced.items():
            known = self._param_map.setdefault(key, [])
            known.extend(t for t in targets if all(t is not k for k in known))
        self._models.append(done.model)
        acc._models.append(done.model)
        return done.model

    def _mesh_for_prepare(self, distributed: bool) -> ParallelMesh | None:
        """One process has nothing to split but follows the same recipe as every layout: bf16 goes through a
        one-rank fully_shard, which needs a one-rank process group and mesh."""
        one_rank_fsdp = self.mp_policy is not None or self.config.fsdp_offload_params  # offload is FSDP's policy too
        if not distributed and one_rank_fsdp:
            single_process_group(self.accelerator.device.type)
        return self.mesh if distributed or one_rank_fsdp else None

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        check_fresh_optimizer(optimizer)
        for group in optimizer.param_groups:
            group["params"] = [q for p in group["params"] for q in self._param_map.get(id(p), [p])]
        step_local_shards(optimizer)  # bitsandbytes' 8-bit optimizers step each rank's shards (optimizer_8bit.py)
        prefer_foreach(optimizer)  # one DTensor dispatch per op for all parameters, not one per parameter
        wrapped = AcceleratedOptimizer(optimizer, device_placement=False, scaler=self.scaler)  # fp16: steps via it
        # counts steps; skips one the non-finite guard refused (and then tells the scaler the step did not happen)
        self.fault.on_optimizer(wrapped, on_skip=lambda: scaling.drop_step(self.scaler))
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
        step_with_optimizer = self.accelerator.step_scheduler_with_optimizer
        wrapped = AcceleratedScheduler(scheduler, owner, step_with_optimizer=step_with_optimizer, split_batches=True)
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
        if scaling.unscale(self.scaler, self.accelerator._optimizers):  # fp16: the norm of unscaled gradients
            # an fp16 overflow: the scaler skips this step on every rank and halves the scale; the guard checks
            # the loss only (a non-finite loss is not something a smaller scale fixes)
            check = lambda norm: self.fault.observe_norm(None)  # noqa: E731
        if self.config.pp_size == 1 or self._mesh is None:
            return clip_grad_norm_(parameters, max_norm, norm_type, check=check)
        # Stages hold different parameters: add their squares over pp; count a tied weight's copy once.
        skip = {id(m.tied.duplicate) for m in self._models if getattr(m, "tied", None) and m.tied.duplicate is not None}
        return clip_grad_norm_(parameters, max_norm, norm_type, extra_group=self.mesh["pp"].get_group(),
                               exclude_from_norm=skip, check=check)

    def unscale_gradients(self, optimizer=None):
        """accelerator.unscale_gradients: fp16's unscale (once per step; a second call is a no-op)."""
        optimizers = self.accelerator._optimizers if optimizer is None else optimizer
        scaling.unscale(self.scaler, optimizers if isinstance(optimizers, (list, tuple)) else [optimizers])

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Full, unsharded, HF-named state dict on the main process (an empty dict on the others)."""
        return checkpoint.full_state_dict(self.train_state(), model, self._mesh)

    # -------------------------------------------------------------- evaluation
    def _dp_group(self):
        """The data-parallel group, or None where Accelerate's own gathers are right (nothing is split)."""
        if self._mesh is None or self.accelerator.num_processes == 1:
            return None
        return self.mesh["dp"].get_group()

    def gather(self, tensor):
        """accelerator.gather: over the data-parallel ranks only (accelerate/evaluation.py)."""
        return evaluation.gather(self.accelerator, self._originals["gather"], self._dp_group(), tensor)

    def gather_for_metrics(self, input_data, use_gather_object=False):
        return evaluation.gather_for_metrics(self.accelerator, self._originals["gather_for_metrics"],
                                             self._dp_group(), input_data, use_gather_object)

    # ------------------------------------------------------------- checkpoints
    def save_state(self, output_dir=None, **kwargs):
        """accelerator.save_state: an atomic, sharded DCP checkpoint under HF names (checkpoint/state.py)."""
        refuse_checkpoint(self.train_state().torch_optimizers(), "save_state")
        self.fault.before_save()  # never a checkpoint holding NaN/Inf
        return checkpoint.save_state(self.train_state(), output_dir, **kwargs)

    def load_state(self, input_dir=None, **kwargs):
        """accelerator.load_state: checked first, then loaded under this layout, whatever layout saved it."""
        refuse_checkpoint(self.train_state().torch_optimizers(), "load_state")
        marker = checkpoint.load_state(self.train_state(), input_dir, **kwargs)
        self.accelerator.step = int(marker.get("step", 0))
        self.fault.resumed_at(int(marker.get("steps_taken") or marker.get("optimizer_step") or 0))
        return marker

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True,
                   merge_adapter: bool = False):
        """accelerator.save_model: HF safetensors + config.json, gathered and written one tensor at a time; for a
        PEFT model its adapter, or with ``merge_adapter=True`` the merged model (checkpoint/export/)."""
        return checkpoint.save_model(self.train_state(), model, save_directory, max_shard_size, safe_serialization,
                                     merge_adapter)

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """Accelerate's, except right after load_state, which already put the dataloader where it was."""
        if has_pending(dataloader):
            raise RuntimeError(
                f"skip_first_batches(num_batches={num_batches}): accelerator.load_state already positioned this "
                "dataloader where the saved run stopped; iterate it directly (skipping as well would skip twice)")
        return self._originals["skip_first_batches"](dataloader, num_batches=num_batches)

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        """Accelerate's CP context: a no-op here. nd_parallel's CP cuts each batch inside the prepared model
        (``distributed/context_parallel``), so the buffers stay whole, as the loop built them."""
        yield

    def preemption_requested(self) -> bool:
        """With ``save_on_signal``: True on every rank, after the same optimizer step, once any rank got SIGTERM or
        SIGINT. Ask after ``optimizer.step()``; then ``accelerator.save_state(...)`` and leave the loop. One small
        all_reduce per call."""
        self._require_attached()
        return self.fault.preemption_requested()

    # ----------------------------------------------------------------- loading
    def from_pretrained(self, path, memory_efficient: bool = True, peft_config=None, **hf_kwargs) -> nn.Module:
        """Load a causal LM from a local safetensors checkpoint directory without reading its weights yet.

        The model comes back on the meta device; ``accelerator.prepare`` splits and shards it, then each rank
        reads from the safetensors files only the slices it owns (``nd_parallel.models.loading``). The parameters
        equal those of a plain ``AutoModelForCausalLM.from_pretrained(path, **hf_kwargs)``. Where that cannot be
        promised (a hub id, weights transformers converts on load, arguments such as ``device_map``) the plain
        path is taken, with a warning; ``memory_efficient=False`` takes it always (e.g. to use the model before
        ``prepare``). Weights are read from safetensors only; ``trust_remote_code`` is passed on only if you pass
        it. ``peft_config`` (e.g. ``LoraConfig``): returns ``get_peft_model(model, peft_config)``, still read slice
        by slice at prepare; the adapter's init is the one a plain ``get_peft_model`` gives under the same seed.
        """
        return load_pretrained(path, memory_efficient=memory_efficient, peft_config=peft_config, **hf_kwargs)
