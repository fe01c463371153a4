"""Axolotl keys about what the model computes in training and the class its config is read with: ``use_eaft``
(with ``eaft_alpha``, ``eaft_k``), ``use_onebitllms`` (1.58-bit linear layers, nd_parallel/models/bitnet.py),
``cls_model_config``, ``evaluation_strategy`` (Axolotl's old name of ``eval_strategy``) with the best-checkpoint
keys (``save_strategy: best``, ``metric_for_best_model``, ``greater_is_better``), and how a LoRA adapter
starts: ``peft: {loftq_config: {loftq_bits}}`` (LoftQ, nd_parallel/models/loftq.py); ``qat:``'s checks (its fake
quantizers: nd_parallel/models/qat.py) live here too.

EAFT weights each label token's cross-entropy by the entropy of the model's top-k prediction
(nd_parallel/distributed/eaft.py); the ranks install it as the model's loss function before the layout is applied,
so it holds under every layout. ``cls_model_config`` names a transformers config class read instead of AutoConfig
(Axolotl's ``load_model_config``), e.g. ``Gemma3TextConfig`` to train the text model of a checkpoint.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from nd_parallel.config import ConfigError
from nd_parallel.config.sources import yaml_number

from . import param_groups
from .param_groups import ParamGroupOptions


@dataclass(kw_only=True)
class ObjectiveOptions(ParamGroupOptions):
    use_eaft: bool = False
    """Entropy-aware focal training: each label token's loss weighted by its top-eaft_k entropy ** eaft_alpha."""
    eaft_alpha: float = 1.0
    """EAFT's exponent on the entropy (Axolotl's default 1.0)."""
    eaft_k: int = 20
    """EAFT's number of top logits the entropy is taken over (Axolotl's default 20)."""
    cls_model_config: str | None = None
    """A transformers config class read instead of AutoConfig (e.g. Gemma3TextConfig), Axolotl's meaning."""
    use_onebitllms: bool = False
    """BitNet b1.58 training: every Linear but lm_head with ternary weights and 8-bit activations (straight-through)."""
    llama4_linearized_experts: bool = False
    """Llama 4's routed experts as one nn.Linear per expert and projection (nd_parallel/models/llama4_linear.py), so
    that load_in_4bit quantizes them and LoRA can target them (experts.gate_projs.N), Axolotl's meaning."""
    model_revision: str | None = None
    """Axolotl's alias of revision_of_model (read as it when that is not set)."""
    peft_layers_to_transform: int | list[int] | None = None
    """LoRA on these decoder-layer indices only (peft's layers_to_transform)."""
    peft_layers_pattern: str | list[str] | None = None
    """The name of the layer list layers_to_transform counts in (peft's layers_pattern, e.g. layers)."""
    lora_rank_pattern: dict | None = None
    """Module-name pattern -> rank, overriding lora_r there (peft's rank_pattern)."""
    lora_alpha_pattern: dict | None = None
    """Module-name pattern -> alpha, overriding lora_alpha there (peft's alpha_pattern)."""
    peft_init_lora_weights: bool | str | None = None
    """How LoRA starts (peft's init_lora_weights): true (A Kaiming, B 0), false (both random: not an identity
    start), or gaussian."""
    auto_resume_from_checkpoints: bool = False
    """Resume from output_dir's latest checkpoint when resume_from_checkpoint is unset (read as it: auto)."""
    noisy_embedding_alpha: float | None = None
    """Axolotl's older name of neftune_noise_alpha (read as it)."""
    neftune_noise_alpha: float | None = None
    """NEFTune: uniform noise of magnitude alpha / sqrt(length x hidden) on the input embeddings in training
    (cli/train/neftune.py; noisy_embedding_alpha is Axolotl's older name)."""
    peft_use_dora: bool = False
    """DoRA (peft's use_dora): each adapted weight split into a magnitude vector and a direction that LoRA updates."""
    peft: dict | None = None
    """Axolotl's peft block: {loftq_config: {loftq_bits: 4 | 8}} starts LoRA with LoftQ (the base replaced by its
    quantized round trip, the adapter by the SVD of the difference)."""
    evaluation_strategy: str | None = None
    """Axolotl's deprecated name of eval_strategy: read as eval_strategy when that is not set (Axolotl's rule)."""
    metric_for_best_model: str | None = None
    """The evaluation metric that picks the best checkpoint (save_strategy: best, early_stopping_patience): loss."""
    greater_is_better: bool | None = None
    """Whether a larger metric_for_best_model is better (the Trainer's default for a loss: false)."""
    do_causal_lm_eval: bool = False
    """At each evaluation, generation metrics on the evaluation split (lm_eval.py: sacrebleu, chrf, ter, perplexity)."""
    eval_causal_lm_metrics: list[str] | None = None
    """The metrics do_causal_lm_eval computes (default: Axolotl's sacrebleu, ter, chrf; comet is not loaded)."""
    eval_max_new_tokens: int | None = None
    """Tokens generated per evaluation prompt, and perplexity's window (Axolotl's default 128)."""


def objective_refusals(d: dict) -> list[str]:
    """Check the keys above in the YAML mapping ``d`` (in place: evaluation_strategy becomes eval_strategy)."""
    out = []
    if d.get("auto_resume_from_checkpoints") is True and not d.get("resume_from_checkpoint"):
        d["resume_from_checkpoint"] = "auto"  # the latest complete checkpoint in output_dir, if any (Axolotl's)
    if d.get("noisy_embedding_alpha") and d.get("neftune_noise_alpha"):  # Axolotl's check_neftune
        out.append("noisy_embedding_alpha and neftune_noise_alpha are both set: keep neftune_noise_alpha (the other "
                   "is its older name)")
    for alias, key in (("evaluation_strategy", "eval_strategy"), ("model_revision", "revision_of_model"),
                       ("noisy_embedding_alpha", "neftune_noise_alpha")):
        old = d.pop(alias, None)  # Axolotl's other names
        if old is not None and d.get(key) is None:
            d[key] = old
    out += _lora_patterns(d)
    alpha = d.get("neftune_noise_alpha")
    if alpha is not None:
        d["neftune_noise_alpha"] = alpha = yaml_number(alpha)
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0):
        out.append(f"neftune_noise_alpha={alpha!r}: write a number > 0 (the NEFTune paper uses 5)")
    if d.get("use_eaft") is not None and not isinstance(d["use_eaft"], bool):
        out.append(f"use_eaft={d['use_eaft']!r}; use true or false")
    alpha, k = d.get("eaft_alpha"), d.get("eaft_k")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha < 0):
        out.append(f"eaft_alpha={alpha!r}: write a number >= 0 (the exponent on the entropy; Axolotl's default 1.0)")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        out.append(f"eaft_k={k!r}: write an integer >= 1 (top logits the entropy is taken over; Axolotl's default 20)")
    if d.get("use_eaft") is True:
        out += _eaft_combinations(d)
    out += _onebitllms(d) + _peft(d) + _qat(d) + param_groups.refusals(d)
    if d.get("peft_use_dora") not in (None, True, False):
        out.append(f"peft_use_dora={d['peft_use_dora']!r}; use true or false")
    elif d.get("peft_use_dora") and d.get("relora"):
        out.append("peft_use_dora with relora: a restart merges plain LoRA deltas (B @ A); DoRA's magnitude vector "
                   "has no merge there; drop one")
    if d.get("llama4_linearized_experts") not in (None, True, False):
        out.append(f"llama4_linearized_experts={d['llama4_linearized_experts']!r}; use true or false")
    out += _best_checkpoint(d)
    name = d.get("cls_model_config")
    if name is not None and _config_class(name) is None:
        out.append(f"cls_model_config={name!r} is not a transformers config class; write one such as "
                   "Gemma3TextConfig or LlamaConfig, or drop it (AutoConfig reads the checkpoint's own)")
    return out


BEST_METRICS = ("loss", "eval_loss")  # what the evaluation here reports (callbacks.EVAL_LOG_FILE)


def _best_checkpoint(d: dict) -> list[str]:
    """save_strategy: best (the Trainer's: a checkpoint at each evaluation that improves metric_for_best_model), with
    Axolotl's rule (it needs metric_for_best_model) and what would save nothing or fail after training started: no
    evaluation, or a metric the evaluation does not report."""
    out, metric, better = [], d.get("metric_for_best_model"), d.get("greater_is_better")
    if metric is not None and metric not in BEST_METRICS:
        out.append(f"metric_for_best_model={metric!r}: the evaluation reports the loss only; use "
                   f"metric_for_best_model: loss (or eval_loss)")
    if better is not None and not isinstance(better, bool):
        out.append(f"greater_is_better={better!r}; use true or false")
    if d.get("save_strategy") == "best":
        if metric is None:
            out.append("save_strategy=best without metric_for_best_model (Axolotl's rule): set metric_for_best_model: "
                       "loss")
        if not evaluates(d):
            out.append("save_strategy=best without an evaluation: a checkpoint is saved when an evaluation improves "
                       "metric_for_best_model, so none would be; set val_set_size (e.g. 0.05) and eval_steps")
    return out


def evaluates(d: dict) -> bool:
    """Whether the YAML mapping ``d`` evaluates during training: a held-out split or test_datasets, and not switched
    off (Axolotl's evals_per_epoch: 0 without eval_steps, or eval_strategy: no)."""
    no_evals = d.get("evals_per_epoch") == 0 and d.get("eval_steps") is None
    held_out = d.get("val_set_size") or d.get("test_datasets")
    return bool(held_out) and not no_evals and d.get("eval_strategy") != "no"


def best_args(t: ObjectiveOptions) -> dict[str, Any]:
    """TrainingArguments for the keys above (save_strategy itself is passed as written)."""
    out: dict[str, Any] = {}
    if t.metric_for_best_model is not None:
        out["metric_for_best_model"] = t.metric_for_best_model
    if t.greater_is_better is not None:
        out["greater_is_better"] = t.greater_is_better
    return out


def objective_notes(d: dict) -> list[str]:
    """Lines for EAFT's memory cost (the full logits of each micro-batch are held) and Liger's DPO kernel."""
    out = []
    if d.get("use_eaft") is True:
        out.append("use_eaft: each token's loss is weighted by its top-k entropy, computed from the full logits: the "
                   "chunked loss (loss_chunk_size) stands aside and each micro-batch's [tokens, vocab] logits are "
                   "held")
    types = d.get("dpo_loss_type")
    if "sft" in ([types] if isinstance(types, str) else types or []):
        out.append("dpo_loss_type sft: TRL averages the SFT term over each micro-batch's chosen tokens, so with "
                   "data parallelism it weighs each rank's tokens apart (the other DPO losses are per pair)")
    if d.get("dpo_use_liger_kernel"):
        out.append("dpo_use_liger_kernel: Liger's fused DPO loss is a Triton kernel; the same loss runs without it")
    return out


def _eaft_combinations(d: dict) -> list[str]:
    out = []
    if d.get("rl"):
        out.append(f"use_eaft with rl={d['rl']!r}: EAFT weights the supervised cross-entropy; the preference "
                   "trainers compute their own losses: drop one of them")
    chunk = d.get("loss_chunk_size")
    if chunk not in (None, 0, "auto"):
        out.append(f"use_eaft with loss_chunk_size={chunk!r}: EAFT's weights come from each token's full logits, "
                   "which the chunked loss never holds; drop loss_chunk_size (or set 0)")
    if d.get("liger_fused_linear_cross_entropy"):
        out.append("use_eaft with liger_fused_linear_cross_entropy: the fused kernel never forms the logits EAFT "
                   "weighs; drop one of them")
    return out


def _qat(d: dict) -> list[str]:
    """``qat:`` checked as QATOptions reads it (pairs, group sizes); not on a bitsandbytes base, which is quantized
    already (QAT fake-quantizes full-precision weights)."""
    if d.get("qat") in (None, {}):
        d.pop("qat", None)
        return []
    from nd_parallel.models.qat import QATOptions

    try:
        QATOptions.from_dict(d["qat"])
    except ConfigError as err:
        return [f"qat: {err}"]
    if importlib.util.find_spec("torchao") is None:
        return ["qat: torchao's fake quantizers are not installed: pip install 'nd_parallel[qat]' (torchao)"]
    if d.get("load_in_4bit") or d.get("load_in_8bit"):
        return ["qat with load_in_4bit / load_in_8bit: the base is quantized by bitsandbytes already, and QAT "
                "fake-quantizes full-precision weights; drop one of them"]
    return []


def _onebitllms(d: dict) -> list[str]:
    value = d.get("use_onebitllms")
    if value is None or value is False:
        return []
    if value is not True:
        return [f"use_onebitllms={value!r}; use true or false"]
    out = []
    if d.get("adapter"):  # Axolotl's rule (check_onebitllms_lora)
        out.append(f"use_onebitllms with adapter={d['adapter']!r}: 1.58-bit training trains the full weights (Axolotl "
                   "refuses LoRA/QLoRA with it too); drop adapter")
    if d.get("load_in_4bit") or d.get("load_in_8bit") or d.get("qat"):
        out.append("use_onebitllms with load_in_4bit / load_in_8bit / qat: the linear layers are ternary-quantized "
                   "already; drop the other quantization")
    return out


def _peft(d: dict) -> list[str]:
    value = d.get("peft")
    if value in (None, {}):
        d.pop("peft", None)
        return []
    loftq = value.get("loftq_config") if isinstance(value, dict) else None
    if not (isinstance(value, dict) and set(value) <= {"loftq_config"} and isinstance(loftq, dict)
            and set(loftq) <= {"loftq_bits"} and loftq.get("loftq_bits", 4) in (4, 8)):
        return [f"peft={value!r}: Axolotl's peft block holds loftq_config: {{loftq_bits: 4}} (or 8); write that, or "
                "drop it"]
    if d.get("adapter") != "lora" or d.get("load_in_4bit") or d.get("load_in_8bit") or d.get("lora_model_dir"):
        return ["peft.loftq_config: LoftQ starts a new LoRA adapter on an unquantized base (it quantizes the base "
                "itself); set adapter: lora without load_in_4bit / load_in_8bit / lora_model_dir, or drop it"]
    if d.get("lora_target_parameters"):
        return ["peft.loftq_config with lora_target_parameters: LoftQ initializes LoRA on Linear layers only; drop "
                "one of them"]
    missing = [p for p in ("bitsandbytes", "scipy") if importlib.util.find_spec(p) is None]
    if missing:  # peft's LoftQ quantizes with bitsandbytes and requires scipy
        return [f"peft.loftq_config needs {' and '.join(missing)}, not installed: pip install 'nd_parallel[loftq]'"]
    return []


def adapter_kwargs(t: ObjectiveOptions) -> dict:
    """LoraConfig arguments for ``peft``: DoRA, LoftQ's initialization (peft's LoftQConfig; loftq_iter 1, as
    Axolotl)."""
    out = {"use_dora": True} if t.peft_use_dora else {}
    for key, name in (("peft_layers_to_transform", "layers_to_transform"), ("peft_layers_pattern", "layers_pattern"),
                      ("lora_rank_pattern", "rank_pattern"), ("lora_alpha_pattern", "alpha_pattern"),
                      ("peft_init_lora_weights", "init_lora_weights")):
        if getattr(t, key) is not None:
            out[name] = getattr(t, key)
    loftq = (t.peft or {}).get("loftq_config")
    if loftq is None:
        return out
    from peft import LoftQConfig

    return {**out, "init_lora_weights": "loftq", "loftq_config": LoftQConfig(loftq_bits=loftq.get("loftq_bits", 4))}


def _config_class(name: Any):
    import transformers

    if not isinstance(name, str) or not name.isidentifier():
        return None
    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig) else None


def config_kwargs(t: ObjectiveOptions, source: str, extra: dict) -> dict:
    """``{"config": ...}`` for from_pretrained when cls_model_config names the class; {} otherwise."""
    if not t.cls_model_config:
        return {}
    trust = {"trust_remote_code": extra["trust_remote_code"]} if "trust_remote_code" in extra else {}
    revision = {"revision": t.revision_of_model} if getattr(t, "revision_of_model", None) else {}  # as Axolotl's
    return {"config": _config_class(t.cls_model_config).from_pretrained(source, **trust, **revision)}


def config_overrides(extra: dict, overrides: dict | None) -> None:
    """Axolotl's ``model_config`` overrides, for from_pretrained's keyword arguments ``extra``: set on the config
    object when one is passed (base_model_config, cls_model_config), as Axolotl sets them on the config it loads;
    passed as keywords otherwise. from_pretrained applies keywords to a config it reads itself only: given a config
    object it hands them to the model's __init__, which fails (``unexpected keyword argument``) on every rank."""
    if extra.get("config") is None:
        extra.update(overrides or {})
        return
    for key, value in (overrides or {}).items():
        setattr(extra["config"], key, value)


def install_loss(t: ObjectiveOptions, model) -> None:
    """BitNet layers and EAFT as the model's loss function (before the adapter and the layout)."""
    if t.use_onebitllms:
        from nd_parallel.models.bitnet import to_bitnet

        layers = to_bitnet(model)
        if os.environ.get("RANK", "0") == "0":
            print(f"[nd_parallel] use_onebitllms: {len(layers)} linear layers train as 1.58-bit (ternary weights, "
                  "8-bit activations; lm_head unchanged)", flush=True)
    if t.use_eaft:
        from nd_parallel.distributed.eaft import use_eaft_loss

        use_eaft_loss(model, alpha=t.eaft_alpha, k=t.eaft_k)


@contextlib.contextmanager
def llama4_experts(t: ObjectiveOptions):
    """Around the ranks' from_pretrained: a linearized checkpoint loads into linearized experts (the class swapped
    while transformers builds the model); yields what to run on the loaded model (a fused checkpoint's split)."""
    if not t.llama4_linearized_experts:
        yield lambda model: None
        return
    from nd_parallel.models.llama4_linear import checkpoint_experts, linearize_experts, linearized_class

    def split(model):
        count = linearize_experts(model)
        if count and os.environ.get("RANK", "0") == "0":
            print(f"[nd_parallel] llama4_linearized_experts: {count} layers' fused experts split into Linears",
                  flush=True)

    if checkpoint_experts(t.base_model, getattr(t, "revision_of_model", None)) == "linearized":  # hub: its cache
        with linearized_class():
            yield lambda model: None
    else:
        yield split


def check_llama4_experts(t: ObjectiveOptions, source: str, layout, path) -> None:
    """llama4_linearized_experts against the local checkpoint, before any rank starts: a Llama 4 model; a fused
    checkpoint is split after loading in full precision only; the experts' Linears have no TP / EP split."""
    if not t.llama4_linearized_experts or not os.path.isfile(os.path.join(source, "config.json")):
        return
    from nd_parallel.models.llama4_linear import checkpoint_experts

    kind = checkpoint_experts(source)
    if kind is None:
        raise ConfigError(f"{path}: llama4_linearized_experts with base_model {source}: it holds no Llama 4 expert "
                          "tensors (experts.gate_up_proj or experts.gate_projs.N); drop the key for this model")
    if kind == "fused" and t.load_in_4bit or kind == "fused" and t.load_in_8bit:
        raise ConfigError(f"{path}: llama4_linearized_experts with load_in_4bit / load_in_8bit on {source}, whose "
                          "experts are stored fused (experts.gate_up_proj): they would load unquantized before the "
                          "split; point base_model at a linearized checkpoint (keys experts.gate_projs.N), or train "
                          "without quantization")
    split = {k: getattr(layout, k) for k in ("tp_size", "ep_size") if getattr(layout, k, 1) > 1}
    if split:
        raise ConfigError(f"{path}: llama4_linearized_experts with {', '.join(f'{k}={v}' for k, v in split.items())}: "
                          "the per-expert Linears have no tensor- or expert-parallel plan; use dp_shard_size, "
                          "pipeline_parallel_size or context_parallel_size")


def _lora_patterns(d: dict) -> list[str]:
    out = []
    layers = d.get("peft_layers_to_transform")
    if layers is not None and not (isinstance(layers, int) and not isinstance(layers, bool) or isinstance(
            layers, list) and layers and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)):
        out.append(f"peft_layers_to_transform={layers!r}: write a layer index or a list of them")
    for key in ("lora_rank_pattern", "lora_alpha_pattern"):
        value = d.get(key)
        if value is not None and not (isinstance(value, dict) and all(isinstance(k, str) and isinstance(
                v, (int, float)) and not isinstance(v, bool) and v > 0 for k, v in value.items())):
            out.append(f"{key}={value!r}: write a mapping of module-name patterns to numbers > 0")
    init = d.get("peft_init_lora_weights")
    if init is not None and init not in (True, False, "gaussian"):
        out.append(f"peft_init_lora_weights={init!r}: true, false or gaussian start the adapter here; {init!r} "
                   "(PiSSA / OLoRA / EVA / CorDA) rewrites the base weights or reads data before training: use "
                   "LoftQ (peft: {loftq_config: ...}) or drop it")
    return out


def check_dora_layout(t: ObjectiveOptions, layout, path) -> None:
    """DoRA's magnitude is the norm of each whole adapted weight: tensor parallelism holds slices of it. NEFTune's
    scale and keyed noise read whole rows: TP and CP split the embedding output."""
    if t.neftune_noise_alpha and (layout.tp_size > 1 or layout.cp_size > 1):
        raise ConfigError(f"{path}: neftune_noise_alpha with tensor / context parallelism: the noise is drawn per "
                          "whole row of the embedding output, which TP / CP split; use dp_shard_size / "
                          "dp_replicate_size / pipeline_parallel_size, or drop it")
    if t.peft_use_dora and layout.tp_size > 1:
        raise ConfigError(f"{path}: peft_use_dora with tensor_parallel_size={layout.tp_size}: DoRA normalizes each "
                          "whole adapted weight, which TP splits; use dp_shard_size / dp_replicate_size / "
                          "pipeline_parallel_size / context_parallel_size, or plain LoRA under TP")
