"""A tiny config for any causal-LM model type of the installed transformers, built from its default config.

Every size field is shrunk (hidden, heads, kv heads, head dims, intermediate, vocabulary, experts, MLA ranks,
windows, convolution kernels, state sizes), the structure kept: per-layer type lists keep one layer of each kind,
a MoE model keeps its dense first layers as one dense layer before the sparse ones, MLA keeps its q/kv LoRA ranks.
Used by the model sweep (tests and ``benchmarks/sweep_models.py``); nothing here knows a model by name.
"""

from __future__ import annotations

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16

# field -> tiny value; applied where the default config has an int there (None stays None: "absent" is structure).
SIZES = {
    "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN, "n_embed": HIDDEN, "dim": HIDDEN, "embed_dim": HIDDEN,
    "emb_dim": HIDDEN, "input_embedding_size": HIDDEN, "output_embedding_size": HIDDEN,  # XLM; RemBERT's decoupled
    "num_attention_heads": HEADS, "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "num_kv_heads": KV_HEADS, "n_kv_heads": KV_HEADS, "multi_query_group_num": KV_HEADS,
    "head_dim": HEAD_DIM, "kv_channels": HEAD_DIM, "global_head_dim": HEAD_DIM,
    "intermediate_size": 128, "ffn_hidden_size": 128, "n_inner": 128, "ffn_dim": 128, "d_ff": 128, "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "vocab_size": 256, "max_position_embeddings": 256, "n_positions": 256, "seq_length": 256,
    # mixture of experts: 4 experts (ep 2 holds two per rank), top 2, narrow experts
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "top_k": 2, "moe_k": 2,
    "moe_intermediate_size": 32, "expert_intermediate_size": 32, "shared_expert_intermediate_size": 64,
    "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "zero_expert_num": 2,  # LongCat's identity experts: 256 of them beside 4 real ones leave the real ones unused
    # multi-head latent attention
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16, "index_head_dim": 16, "index_n_heads": 4,  # sparse-attention indexer (DSA)
    # windows shorter than the sweep's sequence, so a window crosses a shard boundary
    "sliding_window": 8, "attention_window": 8, "window_size": 8,
    # short convolutions, state-space and linear-attention sizes
    "conv_kernel": 4, "conv_L_cache": 3, "d_conv": 4, "mamba_d_conv": 4, "linear_conv_kernel_dim": 4,
    "state_size": 8, "mamba_d_state": 8, "ssm_state_size": 8, "d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16,
    # expand 1: hidden * expand = ssm heads (4) * head dim (16), as mamba2 and the hybrids require
    "mamba_n_groups": 1, "n_groups": 1, "mamba_expand": 1, "expand": 1, "time_step_rank": 8, "mamba_d_ssm": HIDDEN,
    "rotary_dim": HEAD_DIM // 2,  # partial rotary stays partial
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "block_size": 16, "chunk_size": 16,
    # periodic layer kinds (an attention / expert layer every period layers, from offset): both kinds in 2 layers
    "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
}
# Per-layer counts that must stay within the tiny depth.
DEPTH_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers")
# Fields naming how many leading layers stay dense in a MoE: one dense layer keeps that structure.
DENSE_PREFIX = ("first_k_dense_replace", "first_dense_layers", "num_dense_layers", "moe_layer_start_index")
SPECIAL_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
               "cls_token_id", "mask_token_id", "unk_token_id")


def _layer_kinds(values: list, depth: int) -> list[int]:
    """Indices of the layers to keep: the first of every kind, then the next ones, ``depth`` or more in all."""
    keep = []
    for i, v in enumerate(values):
        if v not in [values[j] for j in keep]:
            keep.append(i)
    keep += [i for i in range(len(values)) if i not in keep][: max(0, depth - len(keep))]
    return sorted(keep)


def _shrink(config_dict: dict, depth: int) -> dict:
    """Overrides for one (text) config's dict: every size field shrunk, per-layer lists cut to their kinds."""
    out = {}
    for key, value in config_dict.items():
        if key in SIZES and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = min(value, SIZES[key]) if key in ("conv_kernel", "d_conv", "conv_L_cache", "rotary_dim") \
                else SIZES[key]
    layers = next((config_dict[k] for k in DEPTH_FIELDS if isinstance(config_dict.get(k), int)), None)
    if layers:
        out.update(_shrink_depth(config_dict, layers, depth))
    if isinstance(out.get("qk_rope_head_dim"), int) and "head_dim" in config_dict:
        # MLA: head_dim names the rotary part (deepseek) or the whole query/key head (nope + rope), as the default
        rope_only = config_dict["head_dim"] == config_dict["qk_rope_head_dim"]
        out["head_dim"] = out["qk_rope_head_dim"] + (0 if rope_only else out.get("qk_nope_head_dim", 0))
    if isinstance(config_dict.get("kv_lora_rank"), int) and "num_key_value_heads" in out:
        # MLA decompresses one key and value per query head (kv_b_proj), so num_key_value_heads only sets the
        # grouping factor repeat_kv applies: a kv count below the head count repeats keys that need none.
        out["num_key_value_heads"] = out.get("num_attention_heads", HEADS)
    if config_dict.get("head_dim", 0) is None and isinstance(out.get("num_attention_heads"), int):
        out["head_dim"] = HEAD_DIM  # some defaults leave it unset although their attention reads it
    if any(k in out for k in ("num_local_experts", "num_experts", "n_routed_experts")) and \
            config_dict.get("num_experts_per_tok", 0) is None:
        out["num_experts_per_tok"] = 2
    for key in SPECIAL_IDS:  # ids of the full vocabulary
        if isinstance(config_dict.get(key), int) and config_dict[key] >= SIZES["vocab_size"]:
            out[key] = 0 if key == "pad_token_id" else 1
    return out


def _per_layer(value, layers: int) -> bool:
    """A list with one entry per layer (a kind name or flag each), as ``layer_types``."""
    return isinstance(value, list) and len(value) == layers and all(isinstance(v, (str, bool, float)) for v in value)


def _layer_indices(key: str, value) -> bool:
    """A list of layer indices (``full_attn_idxs``, ``mlp_only_layers``...), not one entry per layer."""
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) and not isinstance(v, bool)
                                                            for v in value) and ("idx" in key or "layers" in key)


def _per_layer_dict(value) -> bool:
    """A dict of per-layer overrides keyed by layer index (``per_layer_config``)."""
    return isinstance(value, dict) and bool(value) and all(
        (isinstance(k, int) or (isinstance(k, str) and k.isdigit())) and isinstance(v, dict) for k, v in value.items())


def _shrink_depth(config_dict: dict, layers: int, depth: int) -> dict:
    """Depth ``depth`` (or one layer of each kind, if more), per-layer lists and layer-index lists cut to match."""
    out = {}
    # a layer's kind is its entry in every per-layer list together (attention kind x dense/sparse MLP...)
    lists = [v for v in config_dict.values() if _per_layer(v, layers)]
    kinds = list(zip(*lists)) if lists else None
    keep = _layer_kinds(kinds, depth) if kinds and layers > depth else list(range(min(depth, layers)))
    new_index = {old: new for new, old in enumerate(keep)}
    for key, value in config_dict.items():
        if _per_layer(value, layers):
            out[key] = [value[i] for i in keep]
        elif key in SIZES and isinstance(value, list) and len(value) == layers:  # a size per layer
            out[key] = [SIZES[key]] * len(keep)
        elif _layer_indices(key, value):
            out[key] = [new_index[i] for i in value if i in new_index]
        elif _per_layer_dict(value):  # {"02": {overrides of layer 2}, ...}: kept layers, their sizes shrunk too
            out[key] = {(f"{new_index[int(i)]:0{len(i)}d}" if isinstance(i, str) else new_index[i]):
                        {**v, **_shrink(v, depth)} for i, v in value.items() if int(i) in new_index}
        elif key in DEPTH_FIELDS and isinstance(value, int):
            out[key] = len(keep)
        elif key in DENSE_PREFIX and isinstance(value, int) and value > 0:
            out[key] = 1
    if config_dict.get("mlp_only_layers"):
        out["mlp_only_layers"] = [0]  # a dense first layer stays dense, the next sparse
    return out


# The default config of some types holds one layer kind only, although the model's checkpoints mix several; these
# give the tiny model the structure its checkpoints have (test input, not a decision about the model).
STRUCTURE = {"lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
             # Bamba's and GraniteMoeHybrid's defaults have no attention layer at all, and then fail in one
             # process (their cache asks an attention layer for the sequence length); their checkpoints mix both.
             "bamba": dict(attn_layer_indices=[1]),
             "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"])}


def _no_drops(config_dict: dict) -> dict:
    """Random drops (dropout, ``*_pdrop``, layerdrop, drop_path_rate) off: they would differ between one process
    and the ranks."""
    return {k: 0.0 for k, v in config_dict.items() if "drop" in k and isinstance(v, float) and v > 0}


def tiny_sweep_config(model_type: str, depth: int = 2, **overrides):
    """``AutoConfig.for_model(model_type)`` with every size shrunk, dropout off; raises if it cannot be built."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    kwargs = {**_shrink(default.to_dict(), depth), **_no_drops(default.to_dict())}
    for key in default.sub_configs or {}:
        sub = getattr(default, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            kwargs[key] = {**sub.to_dict(), **_shrink(sub.to_dict(), depth), **_no_drops(sub.to_dict())}
    kwargs.update({**STRUCTURE.get(model_type, {}), **overrides})
    config = AutoConfig.for_model(model_type, **kwargs)
    _check_consistent(config)
    return config


def _check_consistent(config) -> None:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ValueError(f"tiny config has {heads} heads and {kv} kv heads")
