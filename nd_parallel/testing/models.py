"""Tiny HF causal LMs and a small byte-level text data set, built locally (no hub).

Used by the demo, the benchmarks and the parity tests: a model is built from a config, saved to a
directory and loaded back with ``from_pretrained``, the way a user's checkpoint would be.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

IGNORE_INDEX = -100
PAD_ID = 0
VOCAB = 256  # byte-level: token id = byte value; 0 doubles as padding

# Small enough for 8 gloo ranks on 2 cores; 4 heads and 2 kv heads so tp=2 splits both.
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    attention_dropout=0.0,
)

FAMILIES = {
    "llama": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=False),
    "mistral": dict(tie_word_embeddings=False, sliding_window=None),
    "gemma": dict(tie_word_embeddings=True, pad_token_id=PAD_ID),
    # Families whose defaults do not build at TINY's sizes or in 2 layers (found training Axolotl's examples, issue 19)
    "gptj": dict(rotary_dim=8),  # its default rotary_dim (64) is wider than the tiny head (16)
    # A 3:1 linear / full-attention hybrid: 2 default layers are both linear, and the cache then fails
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=64),
    # MLA decompresses one key and value per query head: as many kv heads as heads; 4 experts in one routing group
    "deepseek_v2": dict(num_key_value_heads=4, topk_group=1, n_group=1, num_experts_per_tok=2, n_routed_experts=4,
                        moe_intermediate_size=32, first_k_dense_replace=1),
    "glm4_moe_lite": dict(num_key_value_heads=4, topk_group=1, n_group=1, num_experts_per_tok=2, n_routed_experts=4,
                          moe_intermediate_size=32, first_k_dense_replace=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32),  # its default layer_types is None, which the model indexes
    # No kv-shared layers (the default shares 15 of 35: none would produce a cache in 2), per-layer sizes for 2
    "gemma3n_text": dict(num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"], laurel_rank=8,
                         altup_num_inputs=2, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
                         activation_sparsity_pattern=[0.0, 0.0], intermediate_size=[128, 128]),
    # DBRX's checkpoints carry rope_theta and clip_qkv (8) in attn_config; its default config has neither, which
    # its attention reads (transformers 5)
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=256, attn_config=dict(kv_n_heads=2, rope_theta=1e4,
                 clip_qkv=8.0), ffn_config=dict(moe_num_experts=4, moe_top_k=2, ffn_hidden_size=32)),
}


def tiny_config(family: str, **overrides):
    from transformers import CONFIG_MAPPING, AutoConfig

    kwargs = {**TINY, **FAMILIES.get(family, {}), **overrides}
    # A size some configs derive and cannot take (falcon's head_dim is a read-only property of hidden / heads).
    derived = {k for k in kwargs if isinstance(getattr(CONFIG_MAPPING[family], k, None), property)
               and getattr(CONFIG_MAPPING[family], k).fset is None}
    config = AutoConfig.for_model(family, **{k: v for k, v in kwargs.items() if k not in derived})
    if getattr(config, "pad_token_id", None) is not None and config.pad_token_id >= VOCAB:
        config.pad_token_id = PAD_ID  # some families default to an id of their full-size vocabulary
    return config


def save_tiny_model(family: str, directory: str | Path, seed: int = 0, **overrides) -> Path:
    """Build a randomly initialised tiny model of ``family`` and save it as a HF checkpoint."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:  # families without an SDPA path (e.g. Gemma2's soft-capped attention)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    directory = Path(directory)
    model.save_pretrained(directory)
    return directory


_WORDS = (
    "pipeline tensor context shard replicate gradient stage layer token batch rank mesh ring attention "
    "optimizer loss parameter sequence vocabulary embedding norm head device schedule bubble"
).split()


def make_text(n_lines: int, seed: int = 0) -> list[str]:
    """Deterministic pseudo-sentences; enough structure for a tiny model's loss to fall."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))) + "." for _ in range(n_lines)]


def encode(text: str) -> list[int]:
    return [b or 1 for b in text.encode("utf-8")]  # keep 0 free for padding


def make_samples(n: int, seq_len: int, seed: int = 0, min_len: int | None = None, packed: bool = False,
                 left_pad: bool = False) -> list[dict]:
    """``n`` right-padded samples of ``seq_len`` tokens with varying real lengths (labels -100 on padding).

    ``packed=True``: each sample is several documents back to back, told apart by position ids that restart
    at 0 (no attention_mask, the format of transformers' DataCollatorWithFlattening); a document's first token
    is not a label, so no document learns to predict the next one. ``left_pad=True`` puts the padding first.
    """
    rng = random.Random(seed)
    min_len = min_len or max(2, seq_len // 3)
    stream = [t for line in make_text(4 * n, seed) for t in encode(line + " ")]
    if packed:
        return _packed_samples(n, seq_len, stream, rng)
    samples, pos = [], 0
    for i in range(n):
        length = seq_len if i % 4 == 0 else rng.randint(min_len, seq_len)
        ids = stream[pos : pos + length]
        pos += length
        pad = seq_len - len(ids)
        sample = {"input_ids": ids + [PAD_ID] * pad, "labels": ids + [IGNORE_INDEX] * pad,
                  "attention_mask": [1] * len(ids) + [0] * pad}
        if left_pad:
            sample = {k: v[len(ids):] + v[: len(ids)] for k, v in sample.items()}
        samples.append({k: torch.tensor(v) for k, v in sample.items()})
    return samples


def _packed_samples(n: int, seq_len: int, stream: list[int], rng: random.Random) -> list[dict]:
    samples, pos = [], 0
    for _ in range(n):
        ids, positions, labels = [], [], []
        while len(ids) < seq_len:
            length = min(rng.randint(2, max(2, seq_len // 2)), seq_len - len(ids))
            doc = stream[pos : pos + length]
            pos += length
            ids += doc
            positions += list(range(length))
            labels += [IGNORE_INDEX] + doc[1:]
        samples.append({"input_ids": torch.tensor(ids), "labels": torch.tensor(labels),
                        "position_ids": torch.tensor(positions)})
    return samples


def write_mamba_ssm(hf_dir: str | Path, out: Path):
    """A transformers Mamba checkpoint written back in mamba_ssm's format (its config keys, pytorch_model.bin, the
    embedding under its own name, the vocabulary unpadded), as state-spaces/mamba-* checkpoints are; returns the
    model it loaded."""
    import json

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    c = model.config
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({  # vocab_size: 3 below the padded size, padded back to it
        "d_model": c.hidden_size, "n_layer": c.num_hidden_layers, "vocab_size": c.vocab_size - 3,
        "pad_vocab_size_multiple": 8, "rms_norm": True, "residual_in_fp32": True,
        "fused_add_norm": True, "tie_embeddings": c.tie_word_embeddings,
        "ssm_cfg": {"d_state": c.state_size, "d_conv": c.conv_kernel, "expand": c.expand,
                    "dt_rank": c.time_step_rank, "conv_bias": c.use_conv_bias, "bias": c.use_bias}}))
    state = {("backbone.embedding.weight" if k == "backbone.embeddings.weight" else k): v
             for k, v in model.state_dict().items()}
    torch.save(state, out / "pytorch_model.bin")
    return model
