"""The model sweep's parts that need no ranks: the tiny-config builder and how a cell's outcome is decided."""

import pytest

from nd_parallel.testing.parity import RunResult
from nd_parallel.testing.sweep import _verdict
from nd_parallel.testing.tiny_configs import tiny_sweep_config


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "lfm2", "qwen3_next", "gpt_oss"])
def test_tiny_config_shrinks_sizes_and_keeps_structure(model_type):
    from transformers import AutoConfig

    full, tiny = AutoConfig.for_model(model_type), tiny_sweep_config(model_type)
    assert tiny.hidden_size == 64 and tiny.vocab_size == 256
    assert tiny.num_attention_heads % tiny.num_key_value_heads == 0
    kinds = getattr(full, "layer_types", None)
    if kinds:  # hybrids keep one layer of each kind (lfm2 gains the conv layers its default config lacks)
        assert set(kinds) <= set(tiny.layer_types) and len(tiny.layer_types) == tiny.num_hidden_layers
    if getattr(full, "kv_lora_rank", None):  # MLA keeps its ranks
        assert tiny.kv_lora_rank == 16 and tiny.qk_rope_head_dim == 8
    for field in ("num_experts", "num_local_experts", "n_routed_experts"):
        if isinstance(getattr(full, field, None), int):
            assert getattr(tiny, field) == 4 and tiny.num_experts_per_tok == 2


def test_embedding_widths_under_other_names_are_shrunk_too():
    """XLM's emb_dim and RemBERT's decoupled embedding sizes: left at 2048 / 1664, the reference's fp32 grad norm
    was 6e-4 off the exact one, more than the sweep's rtol; hybrids keep an attention layer (bamba, GraniteMoeHybrid
    fail in one process without one)."""
    assert tiny_sweep_config("xlm").emb_dim == 64
    rembert = tiny_sweep_config("rembert")
    assert rembert.input_embedding_size == rembert.output_embedding_size == 64
    assert "full_attention" in tiny_sweep_config("granitemoehybrid").layer_types
    assert tiny_sweep_config("bamba").attn_layer_indices == [1]


@pytest.mark.parametrize("model_type", ["minicpm3", "deepseek_v3"])
def test_mla_tiny_model_runs_with_padding(model_type):
    """MLA decompresses a key/value per query head: kv heads below the head count made repeat_kv double the keys
    ("4 vs 8" in sdpa with an attention mask) before the builder kept them equal."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_sweep_config(model_type)
    assert config.num_key_value_heads == config.num_attention_heads
    torch.manual_seed(0)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    ids = torch.randint(0, 256, (2, 8))
    assert torch.isfinite(AutoModelForCausalLM.from_config(config)(ids, attention_mask=mask, labels=ids).loss)


def test_layer_kinds_combine_every_per_layer_list_and_random_drops_are_off():
    from transformers import AutoConfig

    full, tiny = AutoConfig.for_model("kimi_linear"), tiny_sweep_config("kimi_linear")
    # kinds are (attention, mlp) pairs: the tiny model keeps full attention although mlp_layer_types comes first
    assert set(tiny.layer_types) == set(full.layer_types) and set(tiny.mlp_layer_types) == set(full.mlp_layer_types)
    bart = tiny_sweep_config("bart")  # layerdrop skips layers at random in training
    assert bart.decoder_layerdrop == bart.encoder_layerdrop == bart.dropout == 0.0
    assert bart.decoder_attention_heads == 4 and bart.decoder_layers == 2


def _error(message, ours=True, issued=0):
    return {"error": message, "ours": ours, "issued": issued, "where": "..."}


def test_a_refusal_needs_the_same_own_error_on_every_rank_before_any_collective():
    assert _verdict([_error("ValueError: no"), _error("ValueError: no")], None, None)["outcome"] == "refused"
    for views in ([_error("ValueError: no"), _error("ValueError: other")],  # ranks disagree
                  [_error("ValueError: no", issued=3), _error("ValueError: no", issued=3)],  # after collectives
                  [_error("KeyError: x", ours=False), _error("KeyError: x", ours=False)],  # not ours
                  [_error("ValueError: no"), {"losses": [1.0], "norms": [1.0]}]):  # one rank trained
        assert _verdict(views, None, None)["outcome"] == "crash", views


def test_a_cell_matches_only_within_every_tolerance():
    import torch

    ref = RunResult([2.0, 1.5], [1.0, 0.9], {"w": torch.zeros(3)})
    same = {"losses": [2.0, 1.5], "norms": [1.0, 0.9]}
    assert _verdict([same, same], ref, {"w": torch.zeros(3)})["outcome"] == "match"
    assert _verdict([same, same], ref, {"w": torch.full((3,), 2e-5)})["outcome"] == "differs"
    off = {"losses": [2.0, 1.5 * (1 + 3e-5)], "norms": [1.0, 0.9]}
    assert _verdict([off, off], ref, {"w": torch.zeros(3)})["outcome"] == "differs"
    assert _verdict([same, off], ref, {"w": torch.zeros(3)})["outcome"] == "differs"  # ranks report different losses
