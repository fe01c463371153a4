"""``axolotl train cfg.yml`` under any nd_parallel layout, pipeline parallelism and CPU ranks included.

    plugins:
      - nd_parallel.plugins.axolotl.NDParallelAxolotlPlugin
    pipeline_parallel_size: 2        # and/or dp_shard_size, tensor_parallel_size, context_parallel_size, ...

Axolotl keeps its data pipeline, model loading, adapters and trainer; the plugin hands its Trainer to the same
``NDParallelCallback`` a plain Trainer script uses (plugins/trainer/), so no parallelism logic lives here. What it
turns in Axolotl 0.19.0 (read from its source and run), each in one hook:

- ``register`` (config load, before anything distributed): CPU ranks need ``ACCELERATE_USE_CPU=true`` or each
  trains alone; accelerate must not build its own mesh (adopt_launcher_env). ``bf16: auto`` would become fp16 on
  CPU with fp16 weights (Axolotl loads them so; nd_parallel's fp16 keeps fp32 masters), so on CPU it becomes fp32.
- ``load_datasets`` (after ``normalize_config``, before the model loads): ``normalize_config`` forces
  ``device_map={"": LOCAL_RANK}``, which fails on CPU ranks ("Cannot access accelerator device"); the layout is
  read from Axolotl's size keys and ours, and Axolotl's own sizes are cleared so that its ND path
  (PARALLELISM_CONFIG_*, a mesh built on "cuda" in its model loader) stays off. Returns None: Axolotl loads the data.
- ``add_callbacks_pre_trainer``: ``NDParallelCallback`` joins the Trainer's callbacks; its ``on_init_end`` attaches
  nd_parallel to ``trainer.accelerator`` before any ``prepare`` (the optimizer already exists then and is
  re-pointed at the shards, as in Accelerate).
- ``post_train``: Axolotl's final save is ``model.save_pretrained`` on rank 0 alone, with no collective, which
  cannot gather a sharded model. The first ``post_train`` (Axolotl calls it twice) runs the collective
  ``trainer.save_model`` on every rank (full HF model or adapter, through nd_parallel's export) and turns that
  later rank-0 ``save_pretrained`` into a no-op.
"""

from __future__ import annotations

import logging
import os

from axolotl.integrations.base import BasePlugin

logger = logging.getLogger("nd_parallel")

AXOLOTL_SIZES = ("dp_shard_size", "dp_replicate_size", "tensor_parallel_size", "context_parallel_size")
OUR_KEYS = ("pipeline_parallel_size", "pp_schedule", "pp_microbatches", "pp_virtual_stages", "pp_backend",
            "pp_balance", "cp_backend", "cp_load_balance")
# Axolotl features that would parallelize or shard on their own, next to nd_parallel: refused before any rank works.
FIGHTS = {"fsdp_config": "drop fsdp_config / fsdp_version: dp_shard_size shards the model under the plugin",
          "fsdp": "drop fsdp: dp_shard_size shards the model under the plugin",
          "deepspeed": "drop deepspeed: dp_shard_size shards the model (for DeepSpeed's pipeline: pp_backend: deepspeed)",
          "sample_packing": "sample_packing: Axolotl's multipack batch sampler is not sharded by nd_parallel's "
                            "dataloader; set sample_packing: false under the plugin, or use `nd-parallel train`"}


def layout_from_cfg(cfg, world: int | None = None):
    """nd_parallel's ParallelismConfig from Axolotl's size keys and the plugin's keys (None = not set). Ranks the
    sizes leave over become replicas (DDP), as in a plain multi-rank Axolotl run; dp_shard_size: -1 takes them
    as shards instead."""
    import math

    from nd_parallel.config import ConfigError, ParallelismConfig

    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    given = {k: cfg.get(k) for k in (*AXOLOTL_SIZES, *OUR_KEYS) if cfg.get(k) is not None}
    source = "Axolotl config (nd_parallel plugin)"
    config = ParallelismConfig.from_dict({"dp_shard_size": 1, **given}, source=source)
    if config.dp_shard_size == -1:
        return config.resolve(world)
    used = math.prod(config.sizes.values())
    if world % used:
        raise ConfigError(f"the Axolotl config's sizes ({config.describe()}) use {used} ranks, which does not divide "
                          f"the {world} launched; launch a multiple of {used} ranks or change the sizes")
    if world != used and "dp_replicate_size" not in given:
        config = ParallelismConfig.from_dict({"dp_shard_size": 1, **given, "dp_replicate_size": world // used},
                                             source=source)
    return config


class NDParallelAxolotlPlugin(BasePlugin):
    def __init__(self):
        super().__init__()
        self.config = None
        self.trainer = None
        self.models = []
        self.saved = False

    def get_input_args(self) -> str:
        return "nd_parallel.plugins.axolotl.args.NDParallelArgs"

    def register(self, cfg: dict):
        import torch

        from nd_parallel.accelerate.launcher_env import adopt_launcher_env

        adopt_launcher_env()
        if not torch.cuda.is_available() and cfg.get("bf16", "auto") == "auto":
            cfg["bf16"] = False  # Axolotl 0.19 resolves auto to fp16 on CPU and then loads fp16 weights, which
            # nd_parallel's fp16 (fp32 master weights) refuses for full fine-tuning; fp32 as nd-parallel train does
            cfg.setdefault("fp16", False)

    def load_datasets(self, cfg, preprocess: bool = False):
        import torch

        from nd_parallel.accelerate.launcher_env import adopt_launcher_env
        from nd_parallel.config import ConfigError

        fights = [f"{k}: {why}" for k, why in FIGHTS.items() if cfg.get(k)]
        if fights:
            raise ConfigError("Axolotl settings that fight the nd_parallel plugin:\n  - " + "\n  - ".join(fights))
        self.config = layout_from_cfg(cfg)
        for key in AXOLOTL_SIZES:  # Axolotl's own ND path (accelerate's ParallelismConfig) stays off
            cfg[key] = 1 if key != "dp_shard_size" else None
        adopt_launcher_env()  # prepare_optim_env may have set ACCELERATE_USE_PARALLELISM_CONFIG since register
        if not torch.cuda.is_available():
            cfg.device_map = None  # normalize_config's {"": LOCAL_RANK} names an accelerator CPU ranks lack
        logger.info("nd_parallel plugin: layout %s", self.config.describe())
        return None

    def add_callbacks_pre_trainer(self, cfg, model):
        from nd_parallel.accelerate.launcher_env import adopt_launcher_env
        from nd_parallel.plugins.trainer import NDParallelCallback

        adopt_launcher_env()
        self.models.append(model)
        return [NDParallelCallback(self.config)]

    def post_trainer_create(self, cfg, trainer):
        self.trainer = trainer
        keep_axolotl_loss(trainer)

    def post_train(self, cfg, model):
        if self.saved or self.trainer is None:
            return
        self.saved = True
        self.trainer.save_model(cfg.output_dir)  # collective on every rank: nd_parallel's export writes on rank 0
        for m in {id(m): m for m in (*self.models, model, self.trainer.model)}.values():
            m.save_pretrained = _already_saved  # Axolotl's rank-0-only save would write one rank's shards


def keep_axolotl_loss(trainer) -> None:
    """Axolotl 0.19's loss, on every layout. Its trainer sets ``model_accepts_loss_kwargs = False`` when the model's
    forward does not name ``num_items_in_batch`` (Llama, Qwen, ...): each micro-batch's loss is then its own
    token mean, divided by the accumulation steps in ``training_step`` after the forward. A pipeline schedule runs
    backward inside the forward, before that division (and the divided tensor has no gradient to run it again).
    So the same scaling goes in as a count: ``num_items_in_batch = GA x this micro-batch's label tokens`` (loss.py
    adds it over the dp ranks), which gives the micro-batch's global token mean / GA -- the number and gradients of
    plain Axolotl, computed inside the model on every layout -- and the Trainer's division is switched off."""
    if trainer.model_accepts_loss_kwargs:  # the Trainer passes the step's own count already (plugins/trainer/adopt.py)
        return
    from nd_parallel.distributed.loss import count_label_tokens

    trainer.model_accepts_loss_kwargs = True
    original = trainer.compute_loss

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training and "labels" in inputs:
            steps = getattr(trainer, "current_gradient_accumulation_steps", trainer.args.gradient_accumulation_steps)
            num_items_in_batch = steps * int(count_label_tokens(inputs["labels"]))
        return original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    trainer.compute_loss = compute_loss


def _already_saved(*args, **kwargs) -> None:
    logger.info("nd_parallel plugin: the final model was already written by the collective save in post_train")
