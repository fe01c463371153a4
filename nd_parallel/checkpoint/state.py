"""``accelerator.save_state`` / ``load_state`` under the plugin: one sharded DCP checkpoint per call.

Each rank hands DCP its own shards (DTensor pieces under FSDP/TP, its stages' tensors under PP) under HF
names; DCP writes one file per rank, each replicated piece once, and reads back whatever region a rank of any
other layout owns. Around it: schedulers, custom objects and ``accelerator.step`` (small, in the DCP
checkpoint too), each rank's RNG states (safetensors), the dataloader positions (``dataloader.py``), the
model's ``config.json``, and the completion marker that makes the save atomic (``format.py``).
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from . import dataloader as dl
from .format import (
    DCP_DIR,
    FORMAT,
    MARKER,
    RNG_DIR,
    VERSION,
    CheckpointError,
    apply_total_limit,
    auto_checkpoints,
    check_keys,
    check_shard_files,
    publish,
    quiet_single_process,
    read_dcp_metadata,
    read_marker,
    safe_load_planner,
    safe_reader,
    temp_sibling,
    write_json,
)
from .names import MODEL, OPTIM, global_shape, hf_modules, named_state, tied_keys
from .train_state import TrainState

logger = logging.getLogger("nd_parallel")


def _target(state: TrainState, output_dir) -> Path:
    project = state.project
    if project is not None and project.automatic_checkpoint_naming:
        final = Path(state.project_dir) / "checkpoints" / f"checkpoint_{project.iteration}"
        if final.exists():
            raise CheckpointError(
                f"checkpoint directory {final} already exists (iteration {project.iteration}); set "
                "accelerator.project_configuration.iteration to the next free number or move the directory")
        return final
    if output_dir is None:
        raise CheckpointError("save_state needs an output_dir, or ProjectConfiguration(automatic_checkpoint_naming"
                              "=True, project_dir=...) on the Accelerator")
    return Path(os.path.expanduser(str(output_dir)))


# --------------------------------------------------------------------------------------------------- RNG
def _rng_tensors(state: TrainState) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    import numpy as np

    version, py_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "python": torch.tensor(py_state, dtype=torch.int64),
               "numpy": torch.from_numpy(np_keys.astype("int64"))}
    meta = {"python_version": str(version), "python_gauss": repr(gauss), "numpy_name": np_name,
            "numpy_pos": str(np_pos), "numpy_has_gauss": str(np_has_gauss), "numpy_gauss": repr(float(np_gauss))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = state
    for i, loader in enumerate(state.dataloaders):
        pos = dl.position(loader)
        if pos is not None and pos.torch_rng is not None:
            tensors[f"loader.{i}.torch"] = pos.torch_rng
            if pos.generator is not None:
                tensors[f"loader.{i}.generator"] = pos.generator
    return tensors, meta


def _set_rng(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    import ast

    import numpy as np

    torch.set_rng_state(tensors["torch"])
    random.setstate((int(meta["python_version"]), tuple(tensors["python"].tolist()),
                     ast.literal_eval(meta["python_gauss"])))
    np.random.set_state((meta["numpy_name"], tensors["numpy"].numpy().astype("uint32"), int(meta["numpy_pos"]),
                         int(meta["numpy_has_gauss"]), float(meta["numpy_gauss"])))
    cuda = sorted(k for k in tensors if k.startswith("cuda."))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda][: torch.cuda.device_count()])


def _rng_file(root: Path, rank: int) -> Path:
    return root / RNG_DIR / f"rank_{rank:05d}.safetensors"


# -------------------------------------------------------------------------------------------------- save
def _small_state(state: TrainState, for_load: bool = False, saved_scaler: bool = True) -> dict:
    """Schedulers, registered custom objects and fp16's loss scaler (its scale and growth count: the same on every
    rank), each stored as one pickled value whatever its structure (DCP walks into dicts and lists, not tuples),
    read back with weights_only=True. ``saved_scaler``: whether the checkpoint being loaded holds one."""
    objects = {f"scheduler.{i}": s for i, s in enumerate(state.schedulers)}
    objects.update({f"custom.{i}": obj for i, obj in enumerate(state.custom_objects)})
    if state.scaler is not None and saved_scaler:
        objects["loss_scaler"] = state.scaler
    return {k: None if for_load else (obj.state_dict(),) for k, obj in objects.items()}


def save_state(state: TrainState, output_dir=None, **unused) -> Path:
    """Write this rank's part of a checkpoint; the main process publishes it once every rank is done."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from .asynchronous import wait_pending

    wait_pending()  # an async save in flight finishes (and publishes) before anything else touches the disk
    model = state.the_model()
    final = _target(state, output_dir)
    tmp = temp_sibling(final)
    main = state.is_main_process
    if main:
        if tmp.exists():  # left by a save that was interrupted: never part of a good checkpoint
            shutil.rmtree(tmp)
        (tmp / DCP_DIR).mkdir(parents=True)
        (tmp / RNG_DIR).mkdir()
    state.barrier()
    named = named_state(model, state.torch_optimizers() or None)
    values = {**named.flat, **_small_state(state)}
    tensors, meta = _rng_tensors(state)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(_rng_file(tmp, state.process_index)),
              metadata=meta)
    loaders = [dl.describe(loader, state.dp_size) for loader in state.dataloaders]
    finalize = _publisher(state, model, tmp, final, loaders) if main else None
    writer, no_dist = dcp.FileSystemWriter(str(tmp / DCP_DIR)), not state.distributed
    if state.config.async_save:  # published in the background once every rank's files are written
        from .asynchronous import start

        state.barrier()  # every rank's RNG file is written before the marker can be
        start(values, writer, no_dist, finalize)
        _next_iteration(state)
        logger.info("saving checkpoint %s in the background", final)
        return final
    with quiet_single_process():
        dcp.save(values, storage_writer=writer, no_dist=no_dist)
    state.barrier()  # every rank's files are written
    if main:
        finalize()
    state.barrier()  # nobody returns before the checkpoint is visible under its final name
    _next_iteration(state)
    logger.info("saved checkpoint %s", final)
    return final


def _next_iteration(state: TrainState) -> None:
    if state.project is not None:
        state.project.iteration += 1


def _publisher(state: TrainState, model, tmp: Path, final: Path, loaders: list[dict]):
    """What the main process does once every rank's files are written: config, marker, rename, retention. The
    marker's values are taken now, at the step being saved, not when an async save finishes."""
    from .export.writer import write_model_config

    _, hf = hf_modules(model)
    marker = _marker(state, hf, loaders)
    project = state.project
    limit = project.total_limit if project is not None and project.automatic_checkpoint_naming else None

    def finalize() -> None:
        write_model_config(hf, tmp)
        write_json(tmp / MARKER, marker)
        publish(tmp, final)
        for old in apply_total_limit(final.parent, limit):
            logger.info("removed %s (total_limit=%d)", old, limit)

    return finalize


def _optimizer_step(state: TrainState) -> int | None:
    """Optimizer steps taken, from the optimizer's own per-parameter ``step`` (Adam-style) where it keeps one."""
    for optimizer in state.torch_optimizers():
        for state in optimizer.state.values():
            if "step" in state:
                return int(state["step"])
    return None


def _marker(state: TrainState, hf, loaders: list[dict]) -> dict:
    import transformers

    c = state.config
    sizes = {f"{d}_size": getattr(c, f"{d}_size") for d in ("dp_replicate", "dp_shard", "tp", "cp", "pp")}
    return {
        "format": FORMAT, "version": VERSION, "kind": "training_state",
        "step": int(state.step), "optimizer_step": _optimizer_step(state),
        "steps_taken": state.steps_taken,  # optimizer steps, skipped ones included: what fault reports count from
        "save_iteration": int(state.project.iteration) if state.project is not None else 0,
        "world_size": int(state.num_processes), "layout": sizes, "dp_size": state.dp_size,
        "model_class": type(hf).__name__.removeprefix("FSDP"), "tied": tied_keys(hf),
        "optimizers": len(state.optimizers), "schedulers": len(state.schedulers),
        "custom_objects": len(state.custom_objects), "dataloaders": loaders, "loss_scaler": state.scaler is not None,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


# -------------------------------------------------------------------------------------------------- load
def _source(state: TrainState, input_dir) -> Path:
    if input_dir is not None:
        return Path(os.path.expanduser(str(input_dir)))
    if state.project is None or not state.project.automatic_checkpoint_naming:
        raise CheckpointError("load_state needs an input_dir, or automatic_checkpoint_naming=True to load the latest")
    root = Path(state.project_dir) / "checkpoints"
    done = auto_checkpoints(root)
    if not done:
        raise CheckpointError(f"no complete checkpoint under {root} (a directory counts once its {MARKER} exists)")
    return done[-1]


def _all_ranks(state: TrainState, local: dict) -> dict:
    """Union over ranks of {key: shape}: every rank must take the same decision before any collective load."""
    if not state.distributed:
        return dict(local)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = {}
    for part in gathered:
        merged.update(part)
    return merged


def _validate(state: TrainState, path: Path, marker: dict, named, metadata) -> None:
    dcp_dir = path / DCP_DIR
    check_shard_files(dcp_dir, metadata)
    expected = _all_ranks(state, {k: global_shape(v) for k, v in named.flat.items()})
    check_keys(metadata, {k: v for k, v in expected.items() if k.startswith(MODEL + ".")}, MODEL, path, "model")
    optim_expected = {k: v for k, v in expected.items() if k.startswith(OPTIM + ".")}
    if optim_expected and marker.get("optimizers", 0) == 0:
        raise CheckpointError(f"{path} holds no optimizer state (it was saved without a prepared optimizer); "
                              "prepare the optimizer after load_state, or load a checkpoint saved with one")
    if optim_expected:  # no optimizer prepared (evaluation): its state in the checkpoint is simply not read
        check_keys(metadata, optim_expected, OPTIM, path, "optimizer")
    for kind, have in (("schedulers", state.schedulers), ("custom_objects", state.custom_objects)):
        if marker.get(kind, 0) < len(have):  # fewer is fine (e.g. evaluation): the others are not read
            raise CheckpointError(f"{path} holds {marker.get(kind, 0)} {kind.replace('_', ' ')}, this run prepared "
                                  f"{len(have)}; prepare/register the same ones as the saved run")
    for rank in range(int(marker["world_size"])):
        if not _rng_file(path, rank).is_file():
            raise CheckpointError(f"{_rng_file(path, rank)} is missing; the checkpoint is incomplete: copy the "
                                  "whole directory again or load an earlier checkpoint")


def _load_values(values: dict, reader, no_dist: bool, path: Path) -> None:
    """The pickled (non-tensor) values, read with weights_only=True; anything but plain data is refused."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if not values:
        return
    try:
        with quiet_single_process():
            dcp.load(values, storage_reader=reader, planner=safe_load_planner(), no_dist=no_dist)
    except (Exception, CheckpointException) as err:  # a BaseException: DCP re-raises a rank's failure on every rank
        text = str(err)
        culprit = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        if culprit or "Weights only load failed" in text:
            raise CheckpointError(
                f"{path}: a non-tensor value (optimizer hyper-parameters, scheduler or custom state) is not plain "
                "data that torch.load(weights_only=True) accepts (numbers, strings, lists, tuples, dicts, tensors)"
                + (f": it holds {culprit.group(1)}" if culprit else "") + "; nothing was loaded. Make that "
                "state_dict() return plain data") from None
        raise CheckpointError(f"{path}: reading its non-tensor values failed, nothing was loaded: "
                              f"{text[-500:]}") from None


def load_state(state: TrainState, input_dir=None, **unused) -> dict:
    """Check everything, then load model, optimizer, schedulers, RNG and dataloader positions. Returns the marker,
    whose ``step`` and ``steps_taken`` the caller hands back to the loop and to fault handling."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    from .asynchronous import wait_pending

    wait_pending()  # the latest checkpoint may still be in flight
    path = _source(state, input_dir)
    marker = read_marker(path)
    metadata = read_dcp_metadata(path / DCP_DIR)
    model = state.the_model()
    fresh = [o for o in state.torch_optimizers() if not o.state]
    named = named_state(model, state.torch_optimizers() or None, for_load=True)  # initialises fresh optimizers
    small = _small_state(state, for_load=True, saved_scaler=bool(marker.get("loss_scaler")))
    values = {k: v for k, v in named.flat.items() if not isinstance(v, torch.Tensor)}
    values.update(small)
    tensors = {k: v for k, v in named.flat.items() if isinstance(v, torch.Tensor)}
    reader = safe_reader(path / DCP_DIR, metadata)
    no_dist = not state.distributed
    try:
        _validate(state, path, marker, named, metadata)
        _load_values(values, reader, no_dist, path)  # before any weight is overwritten
    except CheckpointError:
        for optimizer in fresh:  # refused: leave the optimizers as they were (no state yet)
            optimizer.state.clear()
        raise
    with quiet_single_process():
        dcp.load(tensors, storage_reader=reader, planner=safe_load_planner(), no_dist=no_dist)
    named.flat = {k: tensors[k] if k in tensors else values[k] for k in named.flat}  # DCP replaced the values
    named.restore()
    for i, scheduler in enumerate(state.schedulers):
        scheduler.load_state_dict(values[f"scheduler.{i}"][0])
    for i, obj in enumerate(state.custom_objects):
        obj.load_state_dict(values[f"custom.{i}"][0])
    if "loss_scaler" in values:
        state.scaler.load_state_dict(values["loss_scaler"][0])
    elif state.scaler is not None:
        logger.warning("%s holds no fp16 loss scale (saved without mixed_precision='fp16'): the scale starts at its "
                       "initial value", path)
    rank = state.process_index
    saved_world = int(marker["world_size"])
    if saved_world != state.num_processes:
        dl.warnings.warn(f"{path} was saved by {saved_world} ranks, this run has {state.num_processes}: rank r "
                         f"takes the RNG states of saved rank r mod {saved_world}", dl.CheckpointWarning, stacklevel=3)
    with safe_open(str(_rng_file(path, rank % saved_world)), "pt") as f:
        rng = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        _set_rng(rng, f.metadata())
    _restore_loaders(state, marker, rng)
    logger.info("loaded checkpoint %s (saved under %s on %d ranks)", path, marker.get("layout"), saved_world)
    return marker


def load_model_state(state: TrainState, input_dir) -> None:
    """The model's weights only, from a checkpoint ``save_state`` wrote, under this layout: the Trainer's
    load_best_model_at_end (the optimizer, schedulers, RNG and data position of the run that goes on are kept)."""
    import torch.distributed.checkpoint as dcp

    from .asynchronous import wait_pending

    wait_pending()
    path = _source(state, input_dir)
    read_marker(path)  # refuses an incomplete checkpoint (no completion marker)
    metadata = read_dcp_metadata(path / DCP_DIR)
    named = named_state(state.the_model(), None, for_load=True)
    tensors = {k: v for k, v in named.flat.items() if isinstance(v, torch.Tensor)}
    check_shard_files(path / DCP_DIR, metadata)
    expected = _all_ranks(state, {k: global_shape(v) for k, v in tensors.items()})
    check_keys(metadata, expected, MODEL, path, "model")
    with quiet_single_process():
        dcp.load(tensors, storage_reader=safe_reader(path / DCP_DIR, metadata), planner=safe_load_planner(),
                 no_dist=not state.distributed)
    named.flat = {k: tensors.get(k, v) for k, v in named.flat.items()}
    named.restore()
    logger.info("loaded the model of checkpoint %s", path)


def _restore_loaders(state: TrainState, marker: dict, rng: dict) -> None:
    loaders, saved = state.dataloaders, marker.get("dataloaders", [])
    if not loaders:
        return
    if len(saved) != len(loaders):
        dl.warnings.warn(f"the checkpoint has {len(saved)} dataloader positions, this run prepared {len(loaders)} "
                         "dataloaders: none is repositioned (iterate from the start or skip batches yourself)",
                         dl.CheckpointWarning, stacklevel=3)
        return
    for i, (loader, pos) in enumerate(zip(loaders, saved)):
        batches = dl.resume_at(pos, loader, state.dp_size, i)
        dl.restore(loader, pos, batches, rng.get(f"loader.{i}.torch"), rng.get(f"loader.{i}.generator"))
