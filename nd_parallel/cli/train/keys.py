"""What `nd-parallel train` does with each Axolotl key it does not implement itself (config.py does the rest).

- ``LOGGING``: loggers, hubs and UI keys. Accepted whatever their value, and listed once as unused.
- ``REFUSED``: keys that would change training; set to anything but their default, the run stops with one
  message that lists every such key with its alternative.
- Any other key of Axolotl's schema (schema.py): left at its default it is listed as unused, set it is
  refused (run the YAML with Axolotl and the plugin). A key Axolotl does not know either is a typo.
- ``fsdp_config``: mapped where it means what nd_parallel's FSDP2 does (``map_fsdp``), refused otherwise.
- Keys it does implement, set to a value it does not (qlora, other optimizers, fp16, ...): ``value_refusals``.
"""

from __future__ import annotations

from typing import Any

from .equivalents import offload_setting
from .multimodal import is_multimodal_class

OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit", "paged_adamw_8bit", "adamw_8bit",
              "paged_adamw_32bit", "adamw_torch_8bit", "adamw_torch_4bit", "muon", "sgd", "adagrad", "rmsprop",
              "lion_32bit", "paged_lion_32bit")
# sgd / adagrad / rmsprop: torch's, built by the Trainer; element-wise, so a shard's step is one process's.
# bitsandbytes' (built by the Trainer): on DTensor parameters each rank steps its local shards
# (nd_parallel/distributed/optimizer_8bit.py); "paged" falls back to unpaged on CPU. paged_adamw_32bit is
# bitsandbytes' AdamW with fp32 state (element-wise: a shard's step is bit-equal to one process's).
# torchao's low-bit AdamW (built by the Trainer, as in Axolotl): its states are DTensor-aware tensor subclasses.
TORCHAO_OPTIMIZERS = ("adamw_torch_8bit", "adamw_torch_4bit")
# muon: Muon + AdamW on sharded parameters (nd_parallel/distributed/muon.py), built by schedules.use_muon.
BNB_OPTIMIZERS = ("adamw_bnb_8bit", "paged_adamw_8bit", "adamw_8bit", "paged_adamw_32bit", "lion_32bit",
                  "paged_lion_32bit")
# transformers' schedules the Trainer builds (cosine_with_min_lr / warmup_stable_decay take lr_scheduler_kwargs), and
# Axolotl's own rex / one_cycle (schedules.use_alternate)
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "polynomial", "inverse_sqrt",
              "cosine_with_restarts", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay", "rex",
              "one_cycle")
ALTERNATE_SCHEDULERS = ("rex", "one_cycle")
SAVE_STRATEGIES = ("no", "steps", "epoch")

LOGGING_PREFIXES = ("wandb_", "mlflow_", "comet_", "hub_", "otel_", "swanlab_", "trackio_", "gradio_")
LOGGING = {"use_wandb", "use_mlflow", "use_comet", "use_tensorboard", "use_otel_metrics", "use_swanlab", "strict",
           "push_dataset_to_hub", "hf_use_auth_token", "debug", "is_preprocess", "eval_table_size", "ray_run_name",
           "include_tokens_per_second", "include_tkps", "profiler_steps", "logging_dir",
           "dataset_processes", "dataset_num_proc", "dataloader_num_workers", "dataloader_pin_memory",
           "dataloader_prefetch_factor", "dataloader_drop_last", "local_rank", "sample_packing_eff_est",
           "sample_packing_bin_size", "sample_packing_group_size", "tokenizer_save_jinja_files", "save_safetensors",
           "experimental_skip_move_to_device", "sdp_attention", "plugins", "ddp_timeout", "save_first_step",
           "skip_prepare_dataset", "tokenizer_use_fast", "tokenizer_legacy", "gc_steps",
           "dataset_keep_in_memory", "shuffle_before_merging_datasets",
           # housekeeping, device placement and statistics Axolotl computes itself (world_size, ddp and device are
           # overwritten from the launcher's environment there): nothing that trains changes
           "use_trackio", "hf_mlflow_log_artifacts", "profiler_steps_start", "gc_collect_steps",
           "torch_empty_cache_steps", "sample_packing_mp_start_method", "axolotl_config_path", "total_num_tokens",
           "total_supervised_tokens", "num_dataset_shards_to_save", "preprocess_iterable", "is_falcon_derived_model",
           "is_llama_derived_model", "is_mistral_derived_model", "is_qwen_derived_model", "max_memory",
           "gpu_memory_limit", "ddp", "world_size", "device",
           # placement and DDP tuning without numeric effect here (nd_parallel places by rank and builds its own DDP)
           "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "low_cpu_mem_usage",
           "device_map", "flex_attn_compile_kwargs",
           # in Axolotl's PaddleOCR-VL example but in no schema of its (Axolotl drops it): without `adapter` the run
           # is a full fine-tuning anyway
           "full_finetune"}

# Fused CUDA/Triton kernels of the same computation: accepted with one line each, not applied. The last two are
# Axolotl's kernels newer than 0.19 (DeepSeek-V4, GLM-5's sparse attention).
KERNEL_KEYS = ("flash_attn_cross_entropy", "flash_attn_rms_norm", "flash_attn_fuse_mlp", "use_kernels",
               "lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel", "fused_attn_kernel",
               "use_dsv4_kernels", "use_glm_dsa_kernels")

_PLUGIN = "run the YAML with Axolotl and the nd_parallel plugin (docs/axolotl.md)"
REFUSED = {
    "gptq": "GPTQ checkpoints need gptqmodel's kernels (no CPU wheel; it builds with CUDA) and are not loaded here: "
            "train the unquantized checkpoint, or QLoRA on it (adapter: qlora, load_in_4bit: true)",
    "gptq_disable_exllama": "belongs to gptq (GPTQ checkpoints), not loaded here: drop it with gptq",
    "s2_attention": "shifted-sparse attention (LongLoRA): Axolotl 0.19 refuses it too (no longer supported); drop it "
                    "(full attention, attn_implementation: sdpa)",
    # deprecated: Axolotl 0.19's schema refuses these as well
    "rope_scaling": "Axolotl 0.19 refuses it too: write it under model_config (overrides of the model's config)",
    "rpo_alpha": "removed from TRL (Axolotl 0.19 refuses it too): RPO is the sigmoid loss plus an SFT term, write "
                 "dpo_loss_type: [sigmoid, sft] with dpo_loss_weights: [1.0, <rpo_alpha>]",
    "dpo_use_logits_to_keep": "removed from TRL (Axolotl 0.19 refuses it too): drop it",
    "dpo_generate_during_eval": "removed from TRL (Axolotl 0.19 refuses it too): drop it",
    "dpo_norm_loss": "no longer in TRL (Axolotl 0.19 refuses it too); dpo_loss_type: sigmoid_norm is the "
                     "length-normalized sigmoid loss",
    "relora_steps": "Axolotl's older name, which 0.19 no longer reads: write jagged_restart_steps",
    "max_packed_sequence_len": "no longer supported (Axolotl 0.19 refuses it too): use sample_packing: true with "
                               "sequence_len",
    # Axolotl keys newer than 0.19 found in its examples (kernels and llm-compressor plugins)
    "nvfp4_merge_aware": "NVFP4 fake-quantized training of a pre-quantized NVFP4 checkpoint's experts is not "
                         "supported (pre-quantized NVFP4 checkpoints are not loaded): use the unquantized checkpoint "
                         "with adapter: lora",
    "nvfp4_merge_aware_start_step": "belongs to nvfp4_merge_aware (NVFP4 fake-quantized training), not supported",
    "dsv4_fp4_grouped_mode": "FP4 grouped expert kernels for a pre-quantized checkpoint are not supported (such "
                             "checkpoints are not loaded): use the unquantized checkpoint",
    # FP8 matmuls (torchao's Float8Linear, torch._scaled_mm) exist on CUDA GPUs with FP8 tensor cores only
    "fp8": "FP8 training runs its matmuls on CUDA FP8 tensor cores (compute capability >= 8.9, torchao's "
           "Float8Linear), which CPU ranks do not have, and nd-parallel train does not apply it on GPUs either (not "
           "checked without one): train in bf16 (drop fp8 and fp8_enable_fsdp_float8_all_gather; bf16: auto), or "
           + _PLUGIN,
    "fp8_config": "belongs to fp8 (torchao's Float8Linear settings), not applied: drop it with fp8",
    "fp8_enable_fsdp_float8_all_gather": "belongs to fp8 (FSDP2 all-gathers the FP8 weights), not applied: drop it "
                                         "with fp8",
    "eval_sample_packing": None,  # implemented; listed so that falsy values are not reported as unused
}

# Keys in Axolotl's own examples that Axolotl does not read (not in its schema, which drops unknown keys): accepted,
# as they change nothing there either, with one line saying what the author probably meant.
UNREAD = {"eta_min": "not an Axolotl key: Axolotl drops it and its cosine decays to 0, as here; for a floor write "
                     "cosine_min_lr_ratio: <eta_min / learning_rate>",
          "adam_eps": "not an Axolotl key: Axolotl drops it and AdamW keeps the Trainer's epsilon 1e-8, as here; for "
                      "another epsilon write adam_epsilon: <value>",
          "test_value": "not an Axolotl key (no Axolotl code reads it): Axolotl drops it, and it changes nothing here",
          "torch_dtype": "not an Axolotl key: Axolotl drops it; the weights' dtype follows bf16 / fp16 / float32 there "
                         "and here",
          # in Axolotl's schema, read by none of its 0.19 code
          "dpo_beta": "deprecated: Axolotl 0.19 warns and reads rl_beta instead, as here; write rl_beta",
          "lr_div_factor": "in Axolotl's schema, read by none of its 0.19 code (its one_cycle schedule is not built)",
          "max_prompt_len": "in Axolotl's schema, read by none of its 0.19 code",
          "ple_cpu_offload": "in Axolotl's schema, read by none of its 0.19 code",
          "default_system_message": "Axolotl 0.19 writes it into the chatml template in place of 'You are a "
                                    "helpful assistant.', a sentence its chatml template does not have: no effect "
                                    "there, none here",
          "chunked_cross_entropy": "the loss is computed in sequence chunks already (loss_chunk_size, default auto: "
                                   "the same values, the full logits never held)",
          "chunked_cross_entropy_num_chunks": "not read: the chunk size is loss_chunk_size (tokens per chunk; "
                                              "default auto)",
          # kernels, compilers and loaders of the same math (memory or speed only): the numbers are the same
          "ring_attn_func": "ring-flash-attn's CUDA kernel variant for Axolotl's sequence parallelism; "
                            "context_parallel_size runs nd_parallel's own ring attention here, the same attention",
          "heads_k_stride": "ring-flash-attn's K-head stride (how its CUDA kernel groups heads); nd_parallel's ring "
                            "passes whole K/V blocks, the same attention",
          "sdpa_varlen": "a CUDA varlen kernel for packed rows; packed rows attend within their own samples here "
                         "through a block-diagonal mask, the same attention",
          "large_head_attention": "a kernel choice for head_dim > 256 (Triton flash or SDPA); SDPA here, the same "
                                  "attention",
          "flash_attn_d512": "Axolotl's deprecated switch for a Triton kernel (large_head_attention: auto); SDPA "
                             "here, the same attention",
          "flash_optimum": "BetterTransformer's fused kernels (optimum) of the same computation; not applied",
          "torch_compile_options": "inductor flags for torch_compile; not passed on (the same math, kernels tuned "
                                   "otherwise)",
          "deepcompile": "DeepSpeed's compiler for its ZeRO engine (deepspeed: jsons map onto FSDP2 here); not "
                         "applied, the same math",
          "embeddings_skip_upcast": "memory only: Axolotl then keeps a PEFT run's embeddings in half precision; the "
                                    "ranks here hold fp32 master weights, and a frozen embedding's values are the "
                                    "checkpoint's either way",
          "qlora_sharded_model_loading": "memory only (answer.ai's sharded QLoRA loading for FSDP): the ranks here "
                                         "quantize tensor by tensor as they load, never holding the whole model",
          "float32": "read by Axolotl 0.19 in its sharded QLoRA loader only; the weights' dtype follows bf16 / fp16 "
                     "there and here (the ranks' master weights are fp32)",
          "layer_offloading": "memory only (parameters moved to host memory between uses; the same numbers): not "
                              "applied here; with dp_shard_size, fsdp_offload_params does it (FSDP2's "
                              "CPUOffloadPolicy)",
          # read with another optimizer only: Axolotl passes them to CAME / Dion / Q-GaLore / GaLore, whose optimizer
          # values are refused here with the alternative; with this run's optimizer they change nothing there either
          **{k: "read by Axolotl with optimizer: came_pytorch only (refused here); no effect with this run's "
                "optimizer, there either" for k in ("adam_beta3", "adam_epsilon2")},
          **{k: "read by Axolotl with optimizer: dion only (refused here); no effect with this run's optimizer, "
                "there either" for k in ("dion_lr", "dion_momentum", "dion_rank_fraction", "dion_rank_multiple_of")},
          **{k: "read by Axolotl with optimizer: q_galore_adamw8bit only (refused here); no effect with this run's "
                "optimizer, there either" for k in (
              "qgalore_cos_threshold", "qgalore_gamma_proj", "qgalore_proj_bits", "qgalore_proj_group_size",
              "qgalore_proj_quant", "qgalore_proj_type", "qgalore_queue_size", "qgalore_rank", "qgalore_scale",
              "qgalore_update_proj_gap")},
          "optim_target_modules": "read by GaLore / APOLLO / Q-GaLore optimizers only (refused here); no effect with "
                                  "this run's optimizer, there either",
          # placement, launching and merging: training is the same
          "lora_on_cpu": "placement only (Axolotl loads the adapter on the CPU to merge it); CPU ranks hold it on "
                         "the host already, GPU ranks place by rank; training is the same",
          "merge_lora": "read by axolotl merge-lora, not by training; merge the saved adapter afterwards (peft's "
                        "merge_and_unload())",
          "merge_method": "belongs to axolotl merge-lora (not run by training)",
          "dpo_padding_free": "TRL turns padding_free off in Axolotl 0.19's version too (it falls back to padded "
                              "batches, with a warning): no effect there, none here",
          "quantization": "read by axolotl quantize (post-training quantization of the saved model), not by "
                          "training; training is the same (quantization-aware training is qat:)",
          "torchdistx_path": "read by Axolotl with optimizer: adamw_anyprecision only (refused here); no effect with "
                             "this run's optimizer, there either",
          "fsdp_final_state_dict_type": "deprecated and read by no Axolotl 0.19 code (it reads "
                                        "fsdp_config.final_state_dict_type, mapped here); the final model here is "
                                        "saved whole (FULL_STATE_DICT)",
          "resources_per_worker": "Ray's per-worker resources: nd-parallel train starts its own ranks (use_ray), one "
                                  "accelerator each (or one CPU process); training is the same",
          "auto_find_batch_size": "the Trainer's retry with half the batch after a CUDA out-of-memory error; not "
                                  "applied (a layout's global batch is fixed): without such an error training is the "
                                  "same; on one, lower micro_batch_size",
          "multipack_real_batches": "packing here lays micro_batch_size rows of sequence_len each (what true means); "
                                    "each sample's loss is the same either way, only which samples share a step "
                                    "differs",
          # logging, not training
          "generate_samples": "Axolotl's sample generation for the logs is not run here (training is the same)",
          **{k: "belongs to generate_samples (not run here)" for k in (
              "num_generation_samples", "generation_max_new_tokens", "generation_temperature", "generation_top_k",
              "generation_top_p", "generation_prompt_ratio", "generation_do_sample")},
          # an evaluation, not training
          "do_bench_eval": "Axolotl's multiple-choice benchmark at each evaluation is not run here (training is the "
                           "same); evaluate the saved model afterwards",
          "bench_dataset": "belongs to do_bench_eval (not run here)", "bench_split": "belongs to do_bench_eval"}


def is_logging(key: str) -> bool:
    return key in LOGGING or key.startswith(LOGGING_PREFIXES)


def is_default(key: str, value: Any, defaults: dict) -> bool:
    """True when `value` changes nothing: null, false, empty, or Axolotl's own default for `key`."""
    return value in (None, False, "", [], {}) or (key in defaults and value == defaults[key])


# ----------------------------------------------------------------------------------------------- fsdp_config
# fsdp_config key (without Axolotl's older "fsdp_" prefix) -> {value: None (same as ours) | str (refusal)}.
# A key listed with "*" accepts any value: it tunes FSDP1 internals that FSDP2 does not have, without numeric effect.
_ANY = "*"
FSDP_KEYS = {
    "reshard_after_forward": {True: None, False: "nd_parallel reshards each decoder layer after its forward "
                                                 "(FSDP2's default, least memory); drop reshard_after_forward: false"},
    "offload_params": {False: None, True: None},  # True: equivalents.offload_setting (refused where unavailable)
    "cpu_offload_pin_memory": {_ANY: None},
    "state_dict_type": {"FULL_STATE_DICT": None, "SHARDED_STATE_DICT": None},  # checkpoints sharded, final full
    "final_state_dict_type": {"FULL_STATE_DICT": None},
    "auto_wrap_policy": {"TRANSFORMER_BASED_WRAP": None,
                         "SIZE_BASED_WRAP": "nd_parallel shards per decoder layer; use TRANSFORMER_BASED_WRAP"},
    "transformer_layer_cls_to_wrap": {_ANY: None},  # the model's own decoder-layer class is always the unit
    "sharding_strategy": {"FULL_SHARD": None,
                          "HYBRID_SHARD": "set dp_replicate_size and dp_shard_size instead (HSDP)",
                          "SHARD_GRAD_OP": "ZeRO-2 is not implemented; use FULL_SHARD (dp_shard_size)",
                          "NO_SHARD": "use dp_replicate_size (DDP) instead"},
    "cpu_ram_efficient_loading": {_ANY: None}, "sync_module_states": {_ANY: None}, "use_orig_params": {_ANY: None},
    "limit_all_gathers": {_ANY: None}, "backward_prefetch": {_ANY: None}, "forward_prefetch": {_ANY: None},
    "version": {1: None, "1": None, 2: None, "2": None},  # FSDP1's full sharding runs as FSDP2: the same math
    "activation_checkpointing": {False: None, True: None},  # mapped to gradient_checkpointing by the caller
}


def map_fsdp(version: Any, fsdp_config: Any) -> tuple[dict, list[tuple[str, str]]]:
    """(settings to apply, [(key=value, why refused)]) for Axolotl's fsdp_version / fsdp_config."""
    refused, settings = [], {}
    if version not in (None, 1, "1", 2, "2"):  # FSDP1's full sharding runs as FSDP2 (fully_shard): the same math
        refused.append((f"fsdp_version={version!r}", "use fsdp_version: 2 (or 1: run as FSDP2, the same math)"))
    if fsdp_config is None:
        return settings, refused
    if not isinstance(fsdp_config, dict):
        return settings, [(f"fsdp_config={fsdp_config!r}", "write a mapping, e.g. {reshard_after_forward: true}")]
    for raw, value in fsdp_config.items():
        key = raw.removeprefix("fsdp_")
        rules = FSDP_KEYS.get(key)
        if rules is None:
            refused.append((f"fsdp_config.{raw}", f"not an FSDP2 setting nd_parallel maps; drop it (known: "
                            f"{', '.join(sorted(FSDP_KEYS))})"))
            continue
        why = rules.get(_ANY, rules.get(value, f"use one of {', '.join(map(repr, rules))}"))
        if why is not None:
            refused.append((f"fsdp_config.{raw}={value!r}", why))
        elif key == "activation_checkpointing" and value:
            settings["gradient_checkpointing"] = True
        elif key == "offload_params" and value:
            setting, why = offload_setting(f"fsdp_config.{raw}=True")
            settings.update(setting)
            if why:
                refused.append((f"fsdp_config.{raw}=True", why.split(": ", 1)[1]))
    return settings, refused


def model_splits(layout) -> str:
    """'tp_size=2, pp_size=2': the sizes above 1 of the parallelisms that split a model's forward (TP, PP, CP, EP),
    for a refusal of a feature that needs the whole model in each rank's forward; '' when none does (or no layout)."""
    sizes = {k: getattr(layout, k, 1) for k in ("tp_size", "pp_size", "cp_size", "ep_size")} if layout else {}
    return ", ".join(f"{k}={v}" for k, v in sizes.items() if v > 1)


def wrap_classes(fsdp_config: Any) -> list[str]:
    """The class names fsdp_config's (fsdp_)transformer_layer_cls_to_wrap gives: a comma-separated string, as
    Accelerate reads it, or a list."""
    if not isinstance(fsdp_config, dict):
        return []
    value = fsdp_config.get("transformer_layer_cls_to_wrap", fsdp_config.get("fsdp_transformer_layer_cls_to_wrap"))
    names = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else []
    return [str(n).strip() for n in names if str(n).strip()]


def value_refusals(d: dict) -> list[str]:
    """Implemented keys set to a value that is not (qlora, other optimizers, ...)."""
    out = []
    out += _quantization_refusals(d)
    if (d.get("optimizer") or "adamw_torch") not in OPTIMIZERS:  # an empty value is the default, as in Axolotl
        out.append(f"optimizer={d['optimizer']!r}: use one of {', '.join(OPTIMIZERS)}")
    if (d.get("lr_scheduler") or "cosine") not in SCHEDULERS:
        out.append(f"lr_scheduler={d['lr_scheduler']!r}: use one of {', '.join(SCHEDULERS)}")
    if d.get("bf16", "auto") not in (True, False, "auto"):
        out.append(f"bf16={d['bf16']!r}; use true, false or auto")
    for key, allowed in (("save_strategy", (*SAVE_STRATEGIES, "best")), ("eval_strategy", SAVE_STRATEGIES)):
        if d.get(key) not in (None, *allowed):  # best: a checkpoint at each new best evaluation (objective.py)
            out.append(f"{key}={d[key]!r}: use one of {', '.join(allowed)}")
    model_type = d.get("model_type")
    causal = model_type in (None, "AutoModelForCausalLM") or str(model_type).endswith("ForCausalLM")
    reward = d.get("reward_model") or d.get("process_reward_model")  # reward.py checks its heads
    if model_type == "MambaLMHeadModel":  # mamba_ssm's class (Axolotl's examples/mamba): transformers' port trains
        from nd_parallel.models.mamba_ssm_checkpoint import is_mamba_ssm, problems

        source = str(d.get("base_model") or "")
        if is_mamba_ssm(source):
            out += [f"model_type='MambaLMHeadModel' with {source}: {why}" for why in problems(source)]
    elif not causal and not is_multimodal_class(model_type) and not reward:  # multimodal.py: needs a processor
        out.append(f"model_type={model_type!r}: only causal LMs train here; use AutoModelForCausalLM")
    return out


def map_memory_keys(d: dict) -> list[str]:
    """Axolotl's memory keys onto ParallelismConfig's memory options (config/memory.py), in place; refusals.

    ``gradient_checkpointing: offload`` = checkpointing + its inputs offloaded to host memory;
    ``activation_offloading: true | legacy | hidden_states`` = saved activations in host memory (with checkpointing
    the checkpointed inputs, which is what hidden_states means); ``tiled_mlp_use_original_mlp: false`` asks for
    a generic Llama MLP instead of the model's own, which nd_parallel never substitutes.
    """
    out = []
    if d.get("gradient_checkpointing") == "offload":
        d["gradient_checkpointing"] = True
        d.setdefault("activation_offloading", True)
    elif d.get("gradient_checkpointing") == "offload_disk":
        out.append("gradient_checkpointing='offload_disk': offloading to disk is not implemented; use "
                   "gradient_checkpointing: offload (host memory)")
    offload = d.get("activation_offloading")
    if offload in ("legacy", "hidden_states"):
        d["activation_offloading"] = True
    elif offload == "disk":
        out.append("activation_offloading='disk': offloading to disk is not implemented; use activation_offloading: "
                   "true (host memory)")
    if d.pop("tiled_mlp_use_original_mlp", True) is False:
        out.append("tiled_mlp_use_original_mlp=False: the model's own MLP is always the one tiled; drop it")
    return out


BNB_4BIT = {"bnb_4bit_quant_type": ("nf4", "fp4"), "bnb_4bit_use_double_quant": (True, False),
            "bnb_4bit_compute_dtype": ("bfloat16", "float32", "float16"),
            "bnb_4bit_quant_storage": ("uint8", "bfloat16", "float32")}


def _quantization_refusals(d: dict) -> list[str]:
    """adapter / load_in_4bit / bnb_config_kwargs: Axolotl's rules (qlora needs load_in_4bit; load_in_4bit needs
    qlora), and the bitsandbytes settings we pass on."""
    out, adapter, four = [], d.get("adapter"), bool(d.get("load_in_4bit"))
    if adapter not in (None, "lora", "qlora"):
        out.append(f"adapter={adapter!r}: use adapter: lora, qlora (with load_in_4bit) or none")
    elif adapter == "qlora" and not four:
        out.append("adapter='qlora' without load_in_4bit: true; QLoRA trains on a 4-bit base: set load_in_4bit: true "
                   "(or adapter: lora for an unquantized base)")
    elif four and adapter != "qlora":
        out.append(f"load_in_4bit=True with adapter={adapter!r}: a 4-bit base trains only through an adapter, and "
                   "Axolotl's rule names it qlora: set adapter: qlora")
    eight, tp = bool(d.get("load_in_8bit")), d.get("tensor_parallel_size") or 1
    if eight and (four or adapter != "lora"):
        out.append(f"load_in_8bit=True with adapter={adapter!r}{' and load_in_4bit' if four else ''}: an 8-bit base "
                   "trains through a LoRA adapter: set adapter: lora (or load_in_4bit with adapter: qlora, not both)")
    if eight and isinstance(tp, int) and tp > 1:
        out.append(f"load_in_8bit=True with tensor_parallel_size={tp}: an 8-bit base has no tensor-parallel split; "
                   "use dp_shard_size or pipeline_parallel_size, or load_in_4bit with adapter: qlora under TP")
    kwargs = d.get("bnb_config_kwargs") or {}
    if not isinstance(kwargs, dict):
        return out + [f"bnb_config_kwargs={kwargs!r}: write a mapping, e.g. {{bnb_4bit_quant_type: nf4}}"]
    for key, value in kwargs.items():
        if key not in BNB_4BIT:
            out.append(f"bnb_config_kwargs.{key}: not a 4-bit setting nd_parallel passes on; use "
                       f"{', '.join(BNB_4BIT)}")
        elif str(value).removeprefix("torch.") not in map(str, BNB_4BIT[key]):
            out.append(f"bnb_config_kwargs.{key}={value!r}: use one of {', '.join(map(str, BNB_4BIT[key]))}")
    if kwargs and not four:
        out.append("bnb_config_kwargs without load_in_4bit: true: set load_in_4bit (adapter: qlora) or drop it")
    return out