"""Axolotl's LISA (``lisa_*``), ReLoRA (``relora*``) and jagged LR restarts (``jagged_restart_*``) in
`nd-parallel train`, with Axolotl 0.19's meaning: the callbacks are plugins/trainer/lisa.py and relora.py, the
schedule is schedules.JaggedRestarts.

``RestartOptions`` holds the keys (TrainConfig inherits it); ``refusals`` checks them in the config stage (Axolotl's
validators plus what is not implemented here); ``check_layout`` refuses DeepSpeed's pipeline engine, which builds its
own layer modules; ``callbacks`` builds the two callbacks on each rank once the Trainer exists.
"""

from __future__ import annotations

from dataclasses import dataclass

PRUNE_METHODS = ("magnitude", "random", "reset")
# ReLoRA prunes Adam's exp_avg / exp_avg_sq (Axolotl's keys for a non-8-bit Adam); bitsandbytes' optimizers keep
# their moments as state1 / state2, quantized per rank's shard here (distributed/optimizer_8bit.py)
# AdamW's exp_avg / exp_avg_sq, or bitsandbytes' state1 / state2 (relora.prune_moments)
RELORA_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit", "paged_adamw_8bit", "adamw_8bit",
                     "paged_adamw_32bit")


@dataclass(kw_only=True)
class RestartOptions:
    lisa_n_layers: int | None = None
    """LISA: how many decoder layers train at a time (the others frozen); with lisa_step_interval."""
    lisa_step_interval: int | None = None
    """LISA: draw new layers before step 0, step 1 and every multiple of this many optimizer steps."""
    lisa_layers_attribute: str = "model.layers"
    """LISA: the attribute path of the decoder layers, also the prefix of their parameters' names."""
    relora: bool = False
    """ReLoRA: merge the LoRA adapter into the base and start it again every jagged_restart_steps steps."""
    relora_prune_ratio: float | None = None
    """Share of the adapter's Adam moments zeroed at each restart (default 0.9; 0.999 for method reset)."""
    relora_prune_method: str = "magnitude"
    """magnitude (the smallest zeroed), random, or reset (random at 0.999 unless relora_prune_ratio is set)."""
    relora_cpu_offload: bool = False
    """Form each merge's delta on the CPU (Axolotl's "merge on cpu", a device memory saving; the same numbers)."""
    jagged_restart_steps: int | None = None
    """Restart period in optimizer steps: ReLoRA's merges, and the LR's warm-up / anneal around each restart."""
    jagged_restart_warmup_steps: int | None = None
    """Steps of linear LR warm-up after each restart (Axolotl's default 10)."""
    jagged_restart_anneal_steps: int | None = None
    """Steps of linear LR anneal before each restart (Axolotl's default 1)."""


def _count(d: dict, key: str, low: int) -> list[str]:
    value = d.get(key)
    if value is None or value is False and key != "jagged_restart_steps":  # Axolotl's "or <default>": false = unset
        d.pop(key, None)
        return []
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        return [f"{key}={value!r}: write an integer >= {low}"]
    return []


def refusals(d: dict) -> list[str]:
    """The keys above in the YAML mapping `d` (normalised in place); refusal lines."""
    out = []
    for key, low in (("lisa_n_layers", 1), ("lisa_step_interval", 1), ("jagged_restart_steps", 1),
                     ("jagged_restart_warmup_steps", 0), ("jagged_restart_anneal_steps", 0)):
        out += _count(d, key, low)
    for key in ("relora", "relora_cpu_offload"):
        if d.get(key) is not None and not isinstance(d[key], bool):
            out.append(f"{key}={d[key]!r}; use true or false")
    if d.get("lisa_layers_attribute") is not None and not isinstance(d["lisa_layers_attribute"], str):
        out.append(f"lisa_layers_attribute={d['lisa_layers_attribute']!r}: write the layers' path, e.g. model.layers")
    out += _lisa(d)
    if d.get("relora") is True:
        out += _relora(d)
    return out


def _lisa(d: dict) -> list[str]:
    n, every = d.get("lisa_n_layers"), d.get("lisa_step_interval")
    if n is None and every is None:
        return []
    if n is None or every is None:  # Axolotl attaches LISA only with both: one alone would silently do nothing
        given, missing = ("lisa_n_layers", "lisa_step_interval") if every is None else ("lisa_step_interval",
                                                                                         "lisa_n_layers")
        return [f"{given} without {missing}: LISA needs both (how many layers train, how often they change); set "
                f"{missing} or drop {given}"]
    if d.get("adapter"):
        return [f"lisa_n_layers with adapter={d['adapter']!r}: LISA trains whole decoder layers of the model "
                "(full fine-tuning; Axolotl's LISA cannot find the layers inside a PEFT model either); drop adapter"]
    return []


def _relora(d: dict) -> list[str]:
    out = []
    if not d.get("jagged_restart_steps"):
        out.append("relora: true without jagged_restart_steps: set how many steps lie between restarts (Axolotl "
                   "requires it too)")
    adapter = d.get("adapter")
    if adapter not in ("lora", "qlora"):
        out.append(f"relora with adapter={adapter!r}: ReLoRA restarts a LoRA adapter; set adapter: lora (or qlora on "
                   "a 4-bit base)")
    method = d.get("relora_prune_method") or "magnitude"
    if method not in PRUNE_METHODS:
        out.append(f"relora_prune_method={method!r}: use one of {', '.join(PRUNE_METHODS)}")
    ratio = d.get("relora_prune_ratio")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1):
        out.append(f"relora_prune_ratio={ratio!r}: write a share between 0 and 1")
    if (d.get("optimizer") or "adamw_torch") not in RELORA_OPTIMIZERS:
        out.append(f"relora with optimizer={d['optimizer']!r}: the restarts prune Adam's moments; use one of "
                   f"{', '.join(RELORA_OPTIMIZERS)}")
    if d.get("lora_target_parameters"):
        out.append("relora with lora_target_parameters: the restart merges LoRA on Linear layers only; adapt the "
                   "linear layers (lora_target_modules) or drop relora")
    if d.get("lora_modules_to_save"):  # checkpoint/export/adapter.py: the merged save covers LoRA layers only
        out.append(f"relora with lora_modules_to_save={d['lora_modules_to_save']!r}: a ReLoRA run ends by saving "
                   "the merged model, whose export merges LoRA layers, not trained copies of whole modules; drop "
                   "lora_modules_to_save (LoRA on those modules via lora_target_modules is merged), or drop relora")
    if d.get("flash_attn_fuse_mlp"):  # Axolotl's rule
        out.append("relora with flash_attn_fuse_mlp: Axolotl refuses fused modules with ReLoRA; drop "
                   "flash_attn_fuse_mlp")
    return out


def check_layout(t: RestartOptions, layout, path) -> None:
    """DeepSpeed's pipeline engine builds its own layer modules: LISA's and ReLoRA's parameters are not there. And
    lisa_n_layers against a local checkpoint's layer count (the ranks' LISACallback would refuse it after loading)."""
    from nd_parallel.config import ConfigError

    uses = [k for k, on in (("lisa_n_layers", t.lisa_n_layers), ("relora", t.relora)) if on]
    quantized = t.relora and (getattr(t, "load_in_4bit", False) or getattr(t, "load_in_8bit", False))
    if quantized and (layout.tp_size > 1 or layout.ep_size > 1):
        raise ConfigError(f"{path}: relora on a quantized base with tensor / expert parallelism: a restart quantizes "
                          "each merged float weight again, whole, and TP / EP hold slices of the quantized codes; "
                          "use dp_shard_size / dp_replicate_size / pipeline_parallel_size, or an unquantized base")
    if uses and layout.pp_size > 1 and layout.pp_backend == "deepspeed":
        raise ConfigError(f"{path}: {uses[0]} with pp_backend='deepspeed': DeepSpeed's engine builds its own layer "
                          "modules, whose parameters LISA / ReLoRA do not reach; use pp_backend: torch")
    total = _decoder_layers(getattr(t, "base_model", None)) if t.lisa_layers_attribute == "model.layers" else None
    if t.lisa_n_layers and total is not None and t.lisa_n_layers > total:
        raise ConfigError(f"{path}: lisa_n_layers={t.lisa_n_layers}: {t.base_model} has {total} decoder layers "
                          f"(num_hidden_layers); choose between 1 and {total}")


def _decoder_layers(source) -> int | None:
    """num_hidden_layers of a local checkpoint's config.json (None: no local config, or no such integer)."""
    import json
    import os

    config = os.path.join(source, "config.json") if isinstance(source, str) else None
    if config is None or not os.path.isfile(config):
        return None
    with open(config) as f:
        total = json.load(f).get("num_hidden_layers")
    return total if isinstance(total, int) and not isinstance(total, bool) else None


def callbacks(t: RestartOptions, trainer) -> list:
    """On every rank, after the Trainer exists: LISA's and ReLoRA's callbacks, where the YAML asks for them."""
    out = []
    if t.lisa_n_layers and t.lisa_step_interval:
        from nd_parallel.plugins.trainer.lisa import LISACallback

        out.append(LISACallback(trainer, t.lisa_n_layers, t.lisa_step_interval, t.lisa_layers_attribute))
    if t.relora:
        from nd_parallel.plugins.trainer.relora import ReLoRACallback

        out.append(ReLoRACallback(trainer, t.jagged_restart_steps, t.relora_prune_method, t.relora_prune_ratio,
                                  t.relora_cpu_offload, float_master(t)))
    return out


def float_master(t):
    """A quantized base's float weights for ReLoRA's restarts (plugins/trainer/relora_quantized.py), else None."""
    if not (t.relora and (t.load_in_4bit or t.load_in_8bit)):
        return None
    from nd_parallel.plugins.trainer.relora_quantized import FloatMaster

    return FloatMaster(t.base_model, t.output_dir)


def save_relora(t, trainer, tokenizer) -> None:
    """Axolotl saves a ReLoRA run merged: the restarts' merges and the last adapter. On a float base the adapter is
    merged into the model (merge_and_unload); on a quantized one the float weights are (relora_quantized.py)."""
    master = float_master(t)
    if master is None:
        trainer.accelerator.save_model(trainer.model_wrapped, t.output_dir, merge_adapter=True)
    else:
        from nd_parallel.plugins.trainer.relora import merged_floats
        from nd_parallel.plugins.trainer.relora_quantized import save_merged

        step = trainer.state.global_step + 1  # after every restart's folder
        merged_floats(trainer.model_wrapped, master, step)
        save_merged(master, step, trainer.accelerator.unwrap_model(trainer.model_wrapped).config, t.output_dir)
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(t.output_dir)
