"""Axolotl keys with a small, local meaning that `nd-parallel train` acts on: the batch-size arithmetic, the
cosine floor and quadratic warm-up (schedules.py), model-only checkpoints, the embedding padding, peft's extra LoRA
options, the hub revision, the MoE experts kernel, quantized MoE expert tensors and exact deduplication of the data.

``AxolotlExtras`` holds them (TrainConfig inherits it); ``extra_refusals`` checks them in the config stage (into
its one message); ``model_kwargs`` / ``lora_kwargs`` / ``scheduler_args`` are what the ranks
and the Trainer receive; ``check_installed`` stops a run whose optimizer's package is missing before any rank
starts.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from nd_parallel.config import ConfigError

from . import (
    adapter_options,
    attention_options,
    diffusion,
    embeddings,
    grpo,
    lm_eval,
    load_options,
    norms,
    pose,
    prequantized,
    restarts,
    sampling,
    sparsity,
    trainer_class,
    trainer_keys,
    trigger_save,
)
from .data import mistral
from .multimodal import MultimodalOptions, multimodal_refusals
from .objective import ObjectiveOptions, objective_notes, objective_refusals
from .reward import RewardOptions, reward_refusals
from .streaming import streaming_notes, streaming_refusals

# transformers' MoE experts forwards (integrations/moe.py): the same math as the per-expert loop ("eager").
EXPERTS = ("eager", "grouped_mm", "batched_mm")


@dataclass(kw_only=True)
class AxolotlExtras(ObjectiveOptions, restarts.RestartOptions, MultimodalOptions, RewardOptions,
                    sparsity.SparsityOptions, diffusion.DiffusionOptions, grpo.GRPOOptions,
                    trainer_keys.TrainerKeyOptions, adapter_options.AdapterOptions,
                    embeddings.EmbeddingOptions, trigger_save.TriggerSaveOptions,
                    pose.PoseOptions, load_options.LoadOptions,
                    trainer_class.TrainerClassOptions, attention_options.AttentionOptions,
                    norms.NormOptions):  # lisa, relora, ...
    batch_size: int | None = None
    """Axolotl's per-rank batch, micro_batch_size x gradient_accumulation_steps: accepted where it agrees."""
    revision_of_model: str | None = None
    """Hub revision of base_model, passed to from_pretrained (a local directory has one revision)."""
    resize_token_embeddings_to_32x: bool = False
    """Grow the embeddings to the tokenizer's length rounded up to a multiple of 32 (Axolotl's meaning)."""
    mean_resizing_embeddings: bool = False
    """New embedding rows start from the old rows' mean (transformers' mean_resizing); Axolotl's default is off."""
    cosine_min_lr_ratio: float | None = None
    """lr_scheduler: cosine decays to learning_rate x this, not to 0 (transformers' cosine_with_min_lr)."""
    peft_use_rslora: bool = False
    """rsLoRA: scale the adapter by lora_alpha / sqrt(lora_r) instead of lora_alpha / lora_r (peft's use_rslora)."""
    lora_fan_in_fan_out: bool = False
    """peft's fan_in_fan_out: the adapted layers store (in, out) weights (GPT-2's Conv1D)."""
    lora_target_parameters: list[str] | None = None
    """Parameter tensors to adapt, by name suffix (peft's target_parameters: LoRA on MoE expert tensors)."""
    quantize_moe_experts: bool = False
    """Quantize the MoE's fused 3-D expert tensors as they load, to load_in_4bit's / load_in_8bit's format
    (models/quantized_experts.py: Axolotl's meaning, on any device)."""
    experts_implementation: str | None = None
    """MoE experts forward: eager, grouped_mm or batched_mm (transformers'; CUDA kernels fall back to eager)."""
    dataset_exact_deduplication: bool = False
    """Drop tokenized samples identical to an earlier one (same input_ids and labels), after mixing and before the
    evaluation split and packing, as Axolotl does (it hashes each tokenized row)."""
    save_only_model: bool = False
    """Checkpoints hold the model only (a from_pretrained directory, or the adapter): no optimizer, scheduler or RNG
    state, so they cannot be resumed (the Trainer's save_only_model)."""
    group_by_length: bool = False
    """Batches of samples of similar length (Axolotl's length-grouped sampler, over global batches: sampling.py)."""
    curriculum_sampling: bool = False
    """Train on the samples (or packed rows) in the order they are prepared, not shuffled (the Trainer's sequential
    sampler; Axolotl's meaning). Several datasets are still mixed when shuffle_merged_datasets is on, as in Axolotl."""
    sample_packing_sequentially: bool | None = None
    """Accepted as read: packing here always lays samples into rows in their order (next-fit), what true asks for."""
    float16: bool = False
    """Axolotl's fp16 weights without loss scaling: trained as fp16 mixed precision (mixed_precision)."""
    use_ray: bool = False
    """Axolotl's Ray Train launch: here nd-parallel train starts the ranks (torchrun), ray_num_workers of them."""
    ray_num_workers: int | None = None
    """With use_ray: the number of ranks when --nproc is not given (Axolotl's default 1)."""
    lr_quadratic_warmup: bool = False
    """lr_scheduler: cosine warms up as (step / warmup)^2 instead of linearly (Axolotl's
    get_cosine_schedule_with_quadratic_warmup; schedules.py)."""
    tokenizer_use_mistral_common: bool = False
    """Tokenize with the checkpoint's mistral-common tokenizer (tekken.json / tokenizer.model.v<N>), which renders
    chat_template conversations itself (data/mistral.py). Axolotl turns it on for names with "magistral"."""
    model_quantization_config: str | None = None
    """How a pre-quantized checkpoint is read: Mxfp4Config (with dequantize: true) only (prequantized.py)."""
    model_quantization_config_kwargs: dict | None = None
    """model_quantization_config's arguments: Mxfp4Config's dequantize (must be true), modules_to_not_convert."""
    qat: dict | None = None
    """Quantization-aware training: Axolotl's {activation_dtype, weight_dtype, group_size, quantize_embedding,
    fake_quant_after_n_steps}; the Linears fake-quantized after loading (nd_parallel/models/qat.py)."""


def model_kind_refusals(d: dict, layout) -> list[str]:
    """The config stage's refusals for a vision-language model (multimodal.py) or a reward model (reward.py)."""
    return multimodal_refusals(d, layout) + reward_refusals(d, layout) + lm_eval.refusals(d, layout) + \
        diffusion.refusals(d, layout)


def extra_refusals(d: dict) -> list[str]:
    """Check the keys above in the YAML mapping `d` (and set what they imply, in place); refusal lines."""
    out = streaming_refusals(d) + objective_refusals(d) + sampling.refusals(d)  # streamed entry; EAFT; grouping
    out += trainer_keys.refusals(d)  # load_best_model_at_end, early_stopping_patience, cosine_constant_lr_ratio
    out += adapter_options.refusals(d) + embeddings.refusals(d)  # peft's pass-through options, shrink_embeddings
    out += trigger_save.refusals(d) + pose.refusals(d) + load_options.refusals(d)  # dynamic_checkpoint, ...
    out += trainer_class.refusals(d) + attention_options.refusals(d) + norms.refusals(d)
    for key in ("resize_token_embeddings_to_32x", "mean_resizing_embeddings", "peft_use_rslora", "lora_fan_in_fan_out",
                "bfloat16", "float16", "dataset_exact_deduplication", "quantize_moe_experts", "save_only_model",
                "lr_quadratic_warmup", "tokenizer_use_mistral_common", "group_by_length"):
        if d.get(key) is not None and not isinstance(d[key], bool):
            out.append(f"{key}={d[key]!r}; use true or false")
    out += mistral.config_refusals(d) if d.get("tokenizer_use_mistral_common") in (None, True) else []
    if d.pop("bfloat16", None) is True:  # Axolotl: bf16 or bfloat16 -> bf16 weights and autocast, i.e. bf16: true
        if d.get("bf16") is False:
            out.append("bfloat16=True with bf16=False: keep one (bfloat16: true means bf16: true)")
        d["bf16"] = True
    out += _half_precision(d)
    out += _batch_size(d)
    workers = d.get("ray_num_workers")
    if d.get("use_ray") and workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                                     or workers < 1):
        out.append(f"ray_num_workers={workers!r}: write an integer >= 1 (the number of ranks)")
    ratio = d.get("cosine_min_lr_ratio")
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            out.append(f"cosine_min_lr_ratio={ratio!r}: write a number between 0 and 1 (the floor as a share of "
                       "learning_rate)")
        elif d.get("lr_scheduler", "cosine") not in ("cosine", "rex"):
            out.append(f"cosine_min_lr_ratio with lr_scheduler={d['lr_scheduler']!r}: the floor applies to the "
                       "cosine and rex schedules only (Axolotl ignores it otherwise); set lr_scheduler: cosine or "
                       "drop it")
    out += _schedule_and_saves(d)
    targets = d.get("lora_target_parameters")
    if targets is not None:
        if isinstance(targets, str):
            d["lora_target_parameters"] = targets = [targets]
        if not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
            out.append(f"lora_target_parameters={targets!r}; write a list of parameter names, e.g. "
                       "[mlp.experts.gate_up_proj, mlp.experts.down_proj]")
        elif d.get("adapter") not in ("lora", "qlora"):
            out.append("lora_target_parameters without adapter: lora; set adapter: lora or drop it")
        elif targets and d.get("lora_dropout"):  # Axolotl's rule: peft's ParamWrapper refuses dropout
            out.append(f"lora_dropout={d['lora_dropout']!r} with lora_target_parameters: LoRA on parameter tensors "
                       "cannot apply dropout (peft refuses it, and so does Axolotl); set lora_dropout: 0")
    out += _moe_quantization(d) + prequantized.refusals(d) + restarts.refusals(d) + sparsity.refusals(d)
    impl = d.get("experts_implementation")
    if impl is not None and not isinstance(impl, str):
        out.append(f"experts_implementation={impl!r}: write one of {', '.join(EXPERTS)}")
    return out


def _schedule_and_saves(d: dict) -> list[str]:
    """lr_quadratic_warmup applies to Axolotl's cosine only (it ignores it otherwise, and drops a cosine floor for it
    with a warning): both refused here rather than silently changed. save_only_model checkpoints cannot be resumed,
    so resume_from_checkpoint: auto would silently start afresh at every restart: refused."""
    out = []
    if d.get("lr_quadratic_warmup") is True:
        if d.get("lr_scheduler", "cosine") != "cosine":
            out.append(f"lr_quadratic_warmup with lr_scheduler={d['lr_scheduler']!r}: the quadratic warm-up is "
                       "Axolotl's cosine schedule's (it ignores it otherwise); set lr_scheduler: cosine or drop it")
        if d.get("cosine_min_lr_ratio") is not None:
            out.append("lr_quadratic_warmup with cosine_min_lr_ratio: Axolotl then runs the quadratic warm-up and "
                       "drops the floor (with a warning); keep one of them")
    if d.get("save_only_model") is True and d.get("resume_from_checkpoint") == "auto":
        out.append("save_only_model with resume_from_checkpoint: auto (or auto_resume_from_checkpoints): model-only "
                   "checkpoints cannot be resumed, so every restart would start from step 0; drop one of them")
    return out


def _moe_quantization(d: dict) -> list[str]:
    """quantize_moe_experts: Axolotl's rules (an adapter, a 4-bit or 8-bit base, not lora_target_linear). LoRA on
    the quantized expert tensors themselves (lora_target_parameters) trains: models/peft.py's
    ``lora_on_parametrized_experts`` fixes peft's matching, order, proxy removal and caching on them."""
    if d.get("quantize_moe_experts") is not True:
        return []
    out = []
    if d.get("adapter") not in ("lora", "qlora"):
        out.append("quantize_moe_experts=True without an adapter: the quantized experts are frozen; set adapter: "
                   "qlora with load_in_4bit (or adapter: lora with load_in_8bit)")
    if not (d.get("load_in_4bit") or d.get("load_in_8bit")):
        out.append("quantize_moe_experts=True without load_in_4bit or load_in_8bit: the experts take the base's "
                   "format; set load_in_4bit: true with adapter: qlora (or load_in_8bit with adapter: lora)")
    if d.get("lora_target_linear"):
        out.append("quantize_moe_experts=True with lora_target_linear (Axolotl's rule too): name the layers with "
                   "lora_target_modules")
    return out


def _batch_size(d: dict) -> list[str]:
    """Axolotl reads gradient_accumulation_steps or batch_size // micro_batch_size, but its schema fills
    gradient_accumulation_steps: 1 first, so a batch_size that disagrees with micro_batch_size x
    gradient_accumulation_steps changes only its step-count estimate there: trained the same way here, with one line
    (``batch_note``). Refused: a value that is not a count, and one that disagrees with an explicit
    gradient_accumulation_steps."""
    size, accumulation = d.get("batch_size"), d.get("gradient_accumulation_steps")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        return [f"batch_size={size!r} must be an integer >= 1 (micro_batch_size x gradient_accumulation_steps)"]
    if accumulation is not None and batch_note(d):  # Axolotl's check_gas_bsz refuses the two together
        return [f"batch_size={size} with gradient_accumulation_steps={accumulation}: they disagree (micro_batch_size x "
                f"gradient_accumulation_steps = {(d.get('micro_batch_size') or 1) * accumulation}); keep one "
                "(Axolotl refuses both set)"]
    return []


def batch_note(d: dict) -> str | None:
    """The line for a batch_size that disagrees with micro_batch_size x gradient_accumulation_steps (_batch_size)."""
    size, micro = d.get("batch_size"), d.get("micro_batch_size") or 1
    accumulation = d.get("gradient_accumulation_steps")
    if not isinstance(size, int) or isinstance(size, bool) or not isinstance(micro, int) or not isinstance(
            accumulation or 1, int) or size == micro * (accumulation or 1):
        return None
    fix = f"gradient_accumulation_steps: {size // micro}" if size % micro == 0 else "gradient_accumulation_steps"
    return (f"batch_size={size}: not used for training, as in Axolotl 0.19 (its gradient_accumulation_steps defaults "
            f"to 1 before batch_size is read): the batch per rank is micro_batch_size x gradient_accumulation_steps = "
            f"{micro * (accumulation or 1)}; set {fix} for a batch of {size}")


def model_kwargs(t: AxolotlExtras) -> dict[str, Any]:
    """from_pretrained's extra arguments: the hub revision, the experts forward (a CUDA kernel only on CUDA)."""
    import torch

    out: dict[str, Any] = {}
    if t.revision_of_model:
        out["revision"] = t.revision_of_model
    impl = t.experts_implementation
    if impl in EXPERTS and (impl == "eager" or torch.cuda.is_available()):
        out["experts_implementation"] = impl
    return out


def attention_for(base_model: str, impl: str, extra: dict[str, Any]) -> str:
    """SDPA becomes eager where the model class has no SDPA path (Gemma2's soft-capped attention), as transformers'
    own default does: SDPA is what a CUDA kernel asked for without CUDA becomes (equivalents.attention), and a model
    that cannot run it stopped every rank at load."""
    if impl != "sdpa":
        return impl
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = extra.get("config") or AutoConfig.from_pretrained(
        base_model, **{k: extra[k] for k in ("trust_remote_code", "revision") if k in extra})
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # remote code: the class is not known before loading; keep the request
        return impl
    return impl if getattr(model_class, "_supports_sdpa", True) else "eager"


def extras_notes(d: dict) -> list[str]:
    """The lines printed for the keys above that are read other than as written (none when all are as written)."""
    notes = (experts_note(d.get("experts_implementation")), batch_note(d), half_precision_note(d), ray_note(d))
    more = (embeddings.notes, attention_options.notes, norms.notes, streaming_notes, objective_notes, lm_eval.note,
            sparsity.notes, diffusion.notes, grpo.notes, sampling.note)
    return [note for note in notes if note] + [line for read in more for line in read(d)]


def mixed_precision(bf16, fp16: bool = False, float16: bool = False) -> str:
    """Accelerate's mixed_precision for the YAML's ``bf16``, ``fp16`` and ``float16``, in Axolotl's resolve_dtype
    order: bf16: true, then fp16: true (over "auto"), then "auto" (bf16 only on GPUs that support it: on CPU ranks
    bf16 matmuls are slower than fp32; Axolotl's auto -> fp16 fallback is not taken: write fp16: true for it), then
    float16: true (fp16, see half_precision_note)."""
    import torch

    if bf16 is True:
        return "bf16"
    if fp16:
        return "fp16"
    if bf16 == "auto" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp16" if float16 else "no"


def _half_precision(d: dict) -> list[str]:
    """fp16 / float16 as Axolotl's resolve_dtype reads them (mixed_precision decides: bf16: true, then fp16: true,
    then bf16: auto on a bf16 GPU, then float16: true). float16 (Axolotl: fp16 weights, no autocast, no loss scaling)
    trains as fp16 mixed precision (half_precision_note says why). Refusal lines: none (every combination has
    Axolotl's meaning)."""
    if d.get("bf16") is True and d.get("fp16"):
        d["fp16"] = False  # Axolotl: "if cfg.bf16: cfg.fp16 = False"
    return []


def ray_note(d: dict) -> str | None:
    """use_ray: what starts the ranks here (ranks.resolve_train_layout reads ray_num_workers)."""
    if not d.get("use_ray"):
        return None
    return (f"use_ray: nd-parallel train starts the ranks itself (torchrun), not Ray Train: ray_num_workers="
            f"{d.get('ray_num_workers') or 1} ranks unless --nproc says otherwise, the same training; Ray's cluster "
            "scheduling is not used (several machines: --nnodes)")


def half_precision_note(d: dict) -> str | None:
    """The line printed when fp16 / float16 are read other than as written."""
    if d.get("bf16") is True and (d.get("fp16") is True or d.get("float16") is True):
        key = "fp16" if d.get("fp16") is True else "float16"
        return f"{key}: true with bf16: true: bf16 mixed precision is used, as in Axolotl"
    if d.get("float16") is True and mixed_precision(d.get("bf16", "auto")) == "bf16":  # auto on a bf16 GPU
        return "float16: true with bf16: auto on a GPU with bf16: bf16 mixed precision is used, as in Axolotl"
    if d.get("float16") is True and not d.get("fp16"):
        return ("float16: true (in Axolotl: weights loaded in fp16, no autocast, no loss scaling) trains as fp16: "
                "true here: fp16 compute over fp32 master weights with dynamic loss scaling. Weights kept in fp16 "
                "would lose AdamW's updates (an update below 2**-11 of a weight rounds away; eps=1e-8 is 0 in fp16)")
    return None


def experts_note(impl: str | None) -> str | None:
    """The one line printed for an experts_implementation the ranks do not use as written."""
    import torch

    cuda = torch.cuda.is_available()
    if impl is None or impl == "eager" or (impl in EXPERTS and cuda):
        return None
    why = "a CUDA kernel (no CUDA device)" if impl in EXPERTS else "a kernel of Axolotl's kernels plugin"
    return f"experts_implementation: {impl} is {why}; the experts run transformers' eager forward, the same math"


def lora_kwargs(t: AxolotlExtras) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if t.peft_use_rslora:
        out["use_rslora"] = True
    if t.lora_fan_in_fan_out:
        out["fan_in_fan_out"] = True
    if t.lora_target_parameters:
        out["target_parameters"] = list(t.lora_target_parameters)
    return out


def scheduler_args(t: Any) -> dict[str, Any]:
    """TrainingArguments for the cosine floor: Axolotl's get_cosine_schedule_with_min_lr is
    (1 - ratio) * 0.5 * (1 + cos(pi * progress)) + ratio after a linear warm-up, which is transformers'
    cosine_with_min_lr with min_lr_rate = ratio (num_cycles 0.5)."""
    if t.cosine_min_lr_ratio is None or t.lr_scheduler != "cosine":
        return {}
    return {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": t.cosine_min_lr_ratio}}


_OPTIMIZER_PACKAGES = {"adamw_torch_8bit": "torchao", "adamw_torch_4bit": "torchao", "adamw_bnb_8bit": "bitsandbytes",
                       "paged_adamw_8bit": "bitsandbytes", "adamw_8bit": "bitsandbytes",
                       "paged_adamw_32bit": "bitsandbytes", "lion_32bit": "bitsandbytes",
                       "paged_lion_32bit": "bitsandbytes"}


def check_installed(optimizer: str, path) -> None:
    """Refuse, before any rank starts, an optimizer whose package is not installed."""
    package = _OPTIMIZER_PACKAGES.get(optimizer)
    if package and importlib.util.find_spec(package) is None:
        raise ConfigError(f"{path}: optimizer={optimizer!r} is built from {package}, which is not installed: "
                          f"pip install {package}, or use optimizer: adamw_torch")


def check_layout(t: AxolotlExtras, layout, path) -> None:
    """LoRA on parameter tensors is checked under data parallelism (FSDP2, DDP) and CP only: under TP, EP and PP
    the experts are split or placed by nd_parallel, and peft's parametrization of them is not checked there yet.
    Quantized expert tensors (quantize_moe_experts) have no TP / EP split; PP holds them per stage."""
    split = {name: getattr(layout, name, 1) for name in ("tp_size", "ep_size", "pp_size")}
    split = {name: size for name, size in split.items() if size > 1}
    if t.quantize_moe_experts and (split.get("tp_size") or split.get("ep_size")):
        sizes = ", ".join(f"{k}={v}" for k, v in split.items() if k != "pp_size")
        raise ConfigError(f"{path}: quantize_moe_experts with {sizes}: tensor and expert parallelism split the "
                          "expert tensors, which have no split for packed bitsandbytes blocks; use dp_shard_size "
                          "(FSDP2: the quantized experts replicated), context_parallel_size or "
                          "pipeline_parallel_size")
    if t.qat and split.get("tp_size"):
        raise ConfigError(f"{path}: qat with tp_size={split['tp_size']}: a row-wise TP shard sees a slice of each "
                          "token's features, so per-token activation scales and MX/NVFP4 blocks would be computed on "
                          "partial rows; use dp_shard_size (FSDP2 fake-quantizes the whole all-gathered weight), "
                          "context_parallel_size or pipeline_parallel_size")
    if t.use_onebitllms and split.get("tp_size"):  # models/bitnet.py: per-tensor weight and per-token scales
        raise ConfigError(f"{path}: use_onebitllms with tp_size={split['tp_size']}: a TP shard would take the weight "
                          "scale over its slice and each token's activation scale over part of its features; use "
                          "dp_shard_size, context_parallel_size or pipeline_parallel_size")
    if t.lora_target_parameters and split:
        sizes = ", ".join(f"{k}={v}" for k, v in split.items())
        raise ConfigError(f"{path}: lora_target_parameters with {sizes}: LoRA on parameter tensors is checked under "
                          "FSDP2 / DDP only; use dp_shard_size for this run, or adapt the linear layers only "
                          "(lora_target_modules) under this layout")
