"""`rl: grpo` / `rl: gdpo` in `nd-parallel train`: TRL's GRPOTrainer (what Axolotl 0.19 runs for both) with
NDParallelCallback, on prompts a user transform (``datasets[].type: module.function``) makes, scored by the user's
reward functions (``trl.reward_funcs``), with Axolotl's meaning of the ``trl:`` block.

Axolotl's meaning, key by key: ``trl.beta`` (else ``rl_beta``), ``num_generations``, ``max_completion_length``,
``temperature`` / ``top_p`` / ``top_k`` / ``min_p`` / ``repetition_penalty``, ``reward_weights``, ``scale_rewards``,
``loss_type``, ``mask_truncated_completions``, ``num_iterations``, ``epsilon`` / ``epsilon_high``,
``importance_sampling_level``, ``multi_objective_aggregation`` (``rl: gdpo`` defaults it to ``normalize_then_sum``:
each reward normalized within its group before the weighted sum, and refuses ``sum_then_normalize``),
``generation_batch_size``, ``sync_ref_model`` / ``ref_model_*``, ``log_completions`` / ``num_completions_to_print``:
GRPOConfig's arguments of the same name. ``generation_kwargs`` and ``chat_template_kwargs`` are read by Axolotl's
async trainer only, not by the GRPOTrainer it runs: unused, one line (read with ``async_prefetch``).
``async_prefetch`` / ``prefetch_depth``: each step's completions sampled by the policy of an earlier step, exactly
that many steps behind (grpo_async.py). A reward function is ``module.function``
imported as Axolotl imports it (the working directory first, then the YAML's folder, here), or a local reward-model
directory; a dataset transform ``module.function`` is called as Axolotl calls it (``function(cfg, dataset_idx=i)``
returns a row function, or ``(row function, map kwargs)``; ``tokenizer=`` is passed when the row function takes it)
and must give each row a ``prompt`` (a string or a list of chat messages); the other columns reach the reward
functions as keyword arguments. The parent runs the transforms and checks every import before any rank starts.

What this adds to TRL so that a layout trains as one process does (grpo_rank.py): completions are sampled with keyed
noise (``KeyedSampling``): each token of each row of a generation batch is the Gumbel-max sample of the same warped
distribution transformers samples from, with the noise drawn from a generator keyed by (seed, generation round, the
row's place in the global generation batch, the token's position in the completion), not torch's global generator,
whose draws depend on how many rows each rank holds. One process and every data-parallel layout so sample the same
completions of the same prompts, and the rewards, advantages and updates follow (TRL gathers the rewards and sums
its dapo / grpo / dr_grpo losses as over the global batch; ``bnpo`` normalizes per micro-batch, in TRL too).

Layouts: FSDP2 / HSDP / DDP (generation runs the whole model on each rank; transformers keeps the ranks of a sharded
model in step). Tensor, pipeline, context and expert parallelism are refused, as are a custom ``rollout_func``, the
async trainer's other settings (streaming scoring, replay buffers, ...) and sample packing; ``use_vllm`` generates
with transformers. Evaluation (``val_set_size``) generates with the
same keyed sampling: its losses and rewards equal one process's too.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .data.sources import names_function as is_transform
from .data.sources import suggest
from .keys import model_splits

RL = ("grpo", "gdpo", "ebft")  # ebft: GRPO with ebft.py's feature-matching reward
# trl: keys passed to GRPOConfig under the same name (Axolotl's GRPOStrategy.set_training_args_kwargs)
ARGS = ("num_generations", "max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
        "reward_weights", "scale_rewards", "loss_type", "mask_truncated_completions", "num_iterations", "epsilon",
        "epsilon_high", "importance_sampling_level", "multi_objective_aggregation", "generation_batch_size",
        "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps", "log_completions",
        "num_completions_to_print")
READ_HERE = ("beta", "reward_funcs", "use_vllm", "generation_kwargs", "chat_template_kwargs", "async_prefetch",
             "prefetch_depth", "use_data_producer")  # the async three: grpo_async.py
# Axolotl's keys that need what this path does not have: the fix for each
REFUSED = {"rollout_func": "a custom rollout replaces the keyed sampling that keeps layouts equal; drop it, or run the "
                           "YAML with Axolotl",
           "use_liger_loss": "Liger's fused GRPO loss is a Triton kernel; drop it (the same loss runs without it)",
           "reward_processing_classes": "reward models here use their own tokenizer; drop it"}
# read by Axolotl 0.19's async GRPO and EBFT trainers, not by the GRPOTrainer it runs for rl: grpo / gdpo
UNREAD = ("generation_kwargs", "chat_template_kwargs")
VLLM_NOTE = ("trl.use_vllm: vLLM generates from a CUDA server (vllm_server_host / port); here transformers generates "
             "on each rank, sampling the same distribution with keyed noise (no server to start; vllm: and vllm_* "
             "unused)")
VLLM = ("vllm_mode", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_guided_decoding_regex",
        "vllm_enable_sleep_mode", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
        "vllm_importance_sampling_cap", "vllm_sync_interval", "vllm_lora_sync")
ASYNC = ("streaming_partial_batch", "streaming_min_groups", "off_policy_mask_threshold",
         "use_bias_correction_kl", "reward_num_workers", "replay_buffer_size", "replay_recompute_logps",
         "reroll_start_fraction", "reroll_max_groups", "skip_zero_advantage_batches")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclass(kw_only=True)
class GRPOOptions:
    trl: dict | None = None
    """Axolotl's trl: block (rl: grpo / gdpo / ebft): GRPOConfig's generation, reward and loss settings (grpo.py)."""
    vllm: dict | None = None
    """Axolotl's vllm: block: vLLM's server settings, unused (transformers generates here; one line says so)."""
    ebft: dict | None = None
    """rl: ebft's block (feature_layers, embed_method, use_whitening, alignment_coef, diversity_coef): ebft.py."""
    import_dirs: list[str] = field(default_factory=list)
    """Where the reward functions' and transforms' modules are imported from: the working directory, then the
    YAML's folder (set by the parent, not a YAML key)."""


@contextlib.contextmanager
def importable(dirs: list[str]):
    """``dirs`` in front of sys.path while a user module is imported (Axolotl imports them by name)."""
    saved = list(sys.path)
    sys.path[:0] = [d for d in dirs if d not in sys.path]
    try:
        yield
    finally:
        sys.path[:] = saved


def _builtin() -> dict:
    """Axolotl's own record transforms of its RL trainers (used when no module of that name is importable)."""
    from .data.ebft_types import TRANSFORMS

    return TRANSFORMS


def user_dirs(path) -> list[str]:
    """Where a YAML's user modules are imported from: the working directory (as Axolotl imports them), then the
    YAML's folder."""
    return list(dict.fromkeys([os.getcwd(), str(Path(path).resolve().parent)]))


def load_function(name: str, dirs: list[str]):
    """The function ``module.function`` (``package.module.function``) from ``dirs`` or installed packages, else one
    of Axolotl's built-in transforms of that name; raises ImportError / AttributeError with the reason."""
    module, _, attr = name.rpartition(".")
    try:
        with importable(dirs):
            found = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name == module and name in _builtin():  # Axolotl tries the user's module first, then its own
            return _builtin()[name]
        raise
    fn = getattr(found, attr, None)
    if not callable(fn):
        raise AttributeError(f"module {module!r} ({getattr(found, '__file__', '?')}) has no function {attr!r}")
    return fn


def _import_problem(what: str, name: str, dirs: list[str]):
    """(the function, None) or (None, the refusal line naming ``what`` and why its import failed)."""
    try:
        return load_function(name, dirs), None
    except Exception as err:  # the user's module: any import error, named
        return None, f"{what}={name!r} cannot be imported from {', '.join(dirs)}: {err}"


def module_file(name: str, dirs: list[str]) -> str | None:
    """The file of ``name``'s module (for the data cache's fingerprint), or None."""
    with importable(dirs):
        spec = importlib.util.find_spec(name.rpartition(".")[0])
    return spec.origin if spec is not None and spec.origin and os.path.isfile(spec.origin) else None


def _reward_refusals(funcs: Any, weights: Any, dirs: list[str]) -> list[str]:
    if not isinstance(funcs, list) or not funcs or not all(isinstance(f, str) for f in funcs):
        return [f"trl.reward_funcs={funcs!r}: write a list of reward functions (module.function, e.g. "
                "rwd.correctness_reward, in a module of the working directory) or local reward-model directories"]
    out = []
    for i, name in enumerate(funcs):
        if os.path.isdir(name) and os.path.isfile(os.path.join(name, "config.json")):
            continue  # a reward model: TRL loads it as a sequence classifier
        if not is_transform(name):
            out.append(f"trl.reward_funcs[{i}]={name!r} is neither module.function nor a local model directory")
            continue
        fn, problem = _import_problem(f"trl.reward_funcs[{i}]", name, dirs)
        if problem:
            out.append(problem)
        elif len(inspect.signature(fn).parameters) < 2:  # Axolotl's rule
            out.append(f"trl.reward_funcs[{i}]={name!r} takes fewer than 2 arguments; a reward function takes "
                       "(prompts, completions, **kwargs) and returns one float per completion")
    if weights is not None and (not isinstance(weights, list) or len(weights) != len(funcs)):
        out.append(f"trl.reward_weights={weights!r}: write one number per reward function ({len(funcs)})")
    return out


def _block_refusals(block: dict, rl: str) -> list[str]:
    out = []
    for key, value in block.items():
        if key in REFUSED and value not in (None, False):
            out.append(f"trl.{key}={value!r}: {REFUSED[key]}")
        elif key in ASYNC and value not in (None, False):
            out.append(f"trl.{key}={value!r}: a setting of Axolotl's async GRPO trainer; drop it")
        elif key not in ARGS and key not in READ_HERE and key not in REFUSED and key not in VLLM + ASYNC:
            out.append(f"unknown key trl.{key}; {suggest(key, [*ARGS, *READ_HERE])}")
    depth = block.get("prefetch_depth")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        out.append(f"trl.prefetch_depth={depth!r}: write an integer >= 1 (optimizer steps the sampler runs behind; "
                   "Axolotl's default 1)")
    generations = block.get("num_generations", 8)  # TRL's default
    if isinstance(generations, bool) or not isinstance(generations, int) or generations < 2:
        out.append(f"trl.num_generations={generations!r}: GRPO compares at least 2 completions of each prompt; "
                   "write an integer >= 2")
    how = block.get("multi_objective_aggregation")
    if how is not None and how not in AGGREGATIONS:
        out.append(f"trl.multi_objective_aggregation={how!r}; use one of {', '.join(AGGREGATIONS)}")
    if rl == "gdpo" and how == "sum_then_normalize":  # Axolotl's check_gdpo
        out.append("trl.multi_objective_aggregation='sum_then_normalize' is GRPO's; with rl: gdpo drop it (gdpo "
                   "normalizes each reward first) or set rl: grpo")
    return out


def refusals(d: dict, layout, path) -> list[str]:
    """The config stage's refusal lines for rl: grpo / gdpo / ebft; sets import_dirs in ``d``."""
    rl, block = d.get("rl"), d.get("trl") if d.get("trl") is not None or d.get("rl") != "ebft" else {}
    if not isinstance(block, dict):
        return [f"trl={block!r} with rl: {rl}: write the trl: block with reward_funcs (module.function names) "
                "and the generation settings (num_generations, max_completion_length, ...)"]
    dirs = user_dirs(path)
    d["import_dirs"] = dirs
    out = _block_refusals(block, rl)
    if rl == "ebft":  # the reward is feature matching (ebft.py); Axolotl ignores reward_funcs there
        from . import ebft

        out += ebft.refusals(d)
    else:
        out += _reward_refusals(block.get("reward_funcs"), block.get("reward_weights"), dirs)
    for i, entry in enumerate(d.get("datasets") or []):
        kind = entry.get("type") if isinstance(entry, dict) else None
        if rl == "ebft" and kind in _builtin():
            continue
        if kind is not None and not is_transform(kind):
            out.append(f"datasets[{i}].type={kind!r} with rl: {rl}: GRPO reads prompts; name a transform "
                       "(type: module.function returning {'prompt': ...}) or leave type out for records that have "
                       "a prompt column")
        elif kind is not None:
            problem = _import_problem(f"datasets[{i}].type", kind, dirs)[1]
            if problem:
                out.append(problem)
    splits = model_splits(layout)
    if splits:
        out.append(f"rl: {rl} with {splits}: completions (rollouts) are generated with the whole model on each "
                   "rank; use dp_shard_size / dp_replicate_size")
    if d.get("sample_packing"):
        out.append(f"sample_packing=True with rl: {rl}: prompts and their completions are not packed; drop it")
    return out


def generation_settings(kwargs: dict | None) -> tuple[dict, list[int], list[str]]:
    """trl.generation_kwargs (vLLM SamplingParams in Axolotl's EBFT) for transformers' generate: (the
    GenerationConfig settings, stop_token_ids as extra end tokens, the keys without a transformers meaning)."""
    from transformers import GenerationConfig

    kwargs, known = dict(kwargs or {}), GenerationConfig()
    stop = list(kwargs.pop("stop_token_ids", None) or [])
    dropped = sorted(k for k in kwargs if not hasattr(known, k))
    return {k: v for k, v in kwargs.items() if k not in dropped}, stop, dropped


def notes(d: dict) -> list[str]:
    """Lines for what this path reads other than as written."""
    from . import ebft

    if ebft.strided(d):  # TRL is not used: ebft_strided.py
        return ebft.notes(d)
    out = []
    block = d.get("trl") if isinstance(d.get("trl"), dict) else {}
    if block.get("use_vllm"):
        out.append(VLLM_NOTE)
    elif d.get("vllm"):
        out.append("vllm: Axolotl reads this block only with trl.use_vllm: true; unused (transformers generates)")
    unread = [k for k in block if block[k] is not None and (k in VLLM and not block.get("use_vllm") or k in UNREAD
                                                            and not reads_generation_kwargs(d["rl"], block))]
    if block.get("async_prefetch"):
        out.append(f"trl.async_prefetch: each step's completions are sampled (and their old log-probs read) by the "
                   f"policy at the start of the step {block.get('prefetch_depth') or 1} before it, exactly (Axolotl: "
                   "a background thread, at least that far behind); vLLM's importance-sampling correction is 1 here "
                   "(the sampler is the trained model) and not applied")
    elif block.get("use_data_producer"):
        out.append("trl.use_data_producer: Axolotl's producer protocol without async_prefetch generates in step, "
                   "as here; no other effect")
    for key in unread:
        why = "read by Axolotl's async GRPO trainer only" if key in UNREAD else "read only with use_vllm: true"
        out.append(f"trl.{key}: {why}, not by the GRPOTrainer Axolotl 0.19 runs; unused here too")
    if d.get("rl") == "ebft":
        out += ebft.notes(d)
        dropped = generation_settings(block.get("generation_kwargs"))[2]
        out += [f"trl.generation_kwargs.{k}: a vLLM sampling setting without a transformers generate meaning; not "
                "applied" for k in dropped]
    if d.get("rl") in RL:
        out.append(f"rl: {d['rl']}: completions are sampled with noise keyed by (seed, round, row, position), so "
                   "every data-parallel layout samples what one process samples (not torch's global generator)")
    return out


def reads_generation_kwargs(rl: str, block: dict) -> bool:
    """Axolotl's EBFT and async GRPO trainers pass trl.generation_kwargs / chat_template_kwargs; its sync GRPO not."""
    return rl == "ebft" or bool(block.get("async_prefetch") or block.get("use_data_producer"))


def batch_problem(cfg, dp: int) -> str | None:
    """TRL's rule, checked before any rank starts: a generation batch holds whole groups of num_generations."""
    block = cfg.trl or {}
    if cfg.rl == "ebft" and (cfg.ebft or {}).get("mode") == "strided":  # its rollouts are per document, per rank
        return None
    generations = block.get("num_generations", 8)
    batch = block.get("generation_batch_size") or cfg.micro_batch_size * dp * cfg.gradient_accumulation_steps
    if cfg.rl == "ebft" and (cfg.micro_batch_size * cfg.gradient_accumulation_steps) % generations:
        return (f"rl: ebft scores each prompt group on one rank: micro_batch_size {cfg.micro_batch_size} x "
                f"gradient_accumulation_steps {cfg.gradient_accumulation_steps} (a rank's completions per generation) "
                f"is not a multiple of trl.num_generations={generations}; change one")
    if batch % generations:
        return (f"the generation batch ({batch} completions: micro_batch_size {cfg.micro_batch_size} x {dp} "
                f"data-parallel ranks x gradient_accumulation_steps {cfg.gradient_accumulation_steps}, or "
                f"trl.generation_batch_size) is not a multiple of trl.num_generations={generations}; change one")
    return None


# ------------------------------------------------------------------------------------------------- data
class Settings(dict):
    """Axolotl's cfg as a transform sees it: keys as attributes, None where unset (its DictDefault)."""

    def __getattr__(self, name):
        value = self.get(name)
        return Settings(value) if isinstance(value, dict) and not isinstance(value, Settings) else value


def settings(cfg) -> Settings:
    import dataclasses

    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    values["datasets"] = [Settings(dataclasses.asdict(s)) for s in cfg.datasets]
    return Settings(values)


def prompts(raw, spec, index: int, cfg, tokenizer, where: str):
    """The entry's rows after its transform (Axolotl's RL loader: fn(cfg, dataset_idx=i) -> row function or (row
    function, map kwargs)); each must have a prompt."""
    from nd_parallel.config import ConfigError

    ds = raw
    if is_transform(spec.type):
        try:
            made = load_function(spec.type, cfg.import_dirs)(settings(cfg), dataset_idx=index)
        except Exception as err:
            raise ConfigError(f"{where}: the transform {spec.type!r} failed: {type(err).__name__}: {err}") from None
        fn, kwargs = made if isinstance(made, tuple) else (made, {})
        kwargs = dict(kwargs or {})
        if kwargs.get("remove_columns") == "__all__":
            kwargs["remove_columns"] = list(raw.column_names)
        elif "remove_columns" in kwargs:
            kwargs["remove_columns"] = [c for c in kwargs["remove_columns"] if c in raw.column_names]
        if "tokenizer" in inspect.signature(fn).parameters:
            import functools

            fn = functools.partial(fn, tokenizer=tokenizer)
        try:
            ds = raw.map(fn, desc=f"{spec.type} on {spec.path}", **kwargs)
        except Exception as err:
            raise ConfigError(f"{where}: the transform {spec.type!r} failed on a record: {type(err).__name__}: "
                              f"{err}") from None
    from . import ebft

    if ebft.strided({"rl": cfg.rl, "ebft": cfg.ebft}):  # tokenized documents (ebft_strided.py), nothing else
        if "input_ids" not in ds.column_names:
            raise ConfigError(f"{where}: rows have no 'input_ids' after {spec.type or 'no transform'} (columns: "
                              f"{', '.join(ds.column_names)}); ebft mode: strided trains on tokenized documents: use "
                              "type: ebft_pretrain.transform or ebft_strided_structured.transform, or a transform "
                              "returning input_ids (and labels)")
        ds = ds.select_columns([c for c in ds.column_names if c in ("input_ids", "labels", "prompt_length")])
        return ds, f"{where}: {len(raw)} records -> {len(ds)} documents ({spec.type or 'as given'})"
    if "prompt" not in ds.column_names:
        raise ConfigError(f"{where}: rows have no 'prompt' after {spec.type or 'no transform'} (columns: "
                          f"{', '.join(ds.column_names)}); GRPO generates from each row's prompt: return "
                          "{'prompt': [...messages...], ...} from the transform")
    return ds, f"{where}: {len(raw)} records -> {len(ds)} prompts ({spec.type or 'as given'})"
