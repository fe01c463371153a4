"""peft's LoRA options that Axolotl 0.19 passes through as they are (loaders/adapter.py):

- ``peft_trainable_token_indices``: LoraConfig's trainable_token_indices: besides LoRA, only these rows of the input
  embeddings (and of a tied lm_head) train, as a delta peft keeps beside the frozen table; a list (the
  ``embed_tokens`` layer) or a mapping of embedding-layer names to lists;
- ``peft_layer_replication``: LoraConfig's layer_replication, ``[[start, end), ...]``: the decoder stack rebuilt from
  these ranges of the original layers, the copies sharing their base weights, each with its own LoRA;
- ``peft_ensure_weight_tying``: LoraConfig's ensure_weight_tying (an adapter on a tied embedding / lm_head pair
  stays tied);
- ``peft_autocast_adapter_dtype``: get_peft_model's autocast_adapter_dtype (adapter weights in fp32 over a bf16 /
  fp16 base). The ranks load fp32 master weights, so the adapter is fp32 either way; passed as written.

Under which layouts each is checked: ``check_layout``.
"""

from __future__ import annotations

from dataclasses import dataclass

from nd_parallel.config import ConfigError


@dataclass(kw_only=True)
class AdapterOptions:
    peft_trainable_token_indices: list[int] | dict | None = None
    """Token ids whose input-embedding rows train beside LoRA (peft's trainable_token_indices): a list for
    embed_tokens, or a mapping of embedding-layer names to lists."""
    peft_layer_replication: list | None = None
    """Rebuild the decoder stack from these [start, end) ranges of its layers, copies sharing base weights, each with
    its own LoRA (peft's layer_replication)."""
    peft_ensure_weight_tying: bool | None = None
    """Keep adapters on tied input / output embeddings tied (peft's ensure_weight_tying)."""
    peft_autocast_adapter_dtype: bool | None = None
    """Adapter weights in fp32 over a half-precision base (get_peft_model's autocast_adapter_dtype; the ranks' base
    is fp32 master weights, so the adapter is fp32 either way)."""


def _ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)


def refusals(d: dict) -> list[str]:
    out = []
    tokens, ranges = d.get("peft_trainable_token_indices"), d.get("peft_layer_replication")
    if tokens is not None and not (_ids(tokens) or isinstance(tokens, dict) and tokens and all(
            isinstance(k, str) and _ids(v) for k, v in tokens.items())):
        out.append(f"peft_trainable_token_indices={tokens!r}: write a list of token ids, or a mapping of embedding "
                   "layer names to lists of token ids (e.g. {embed_tokens: [0, 5]})")
    if ranges is not None and not (isinstance(ranges, list) and ranges and all(
            isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                 for x in r) and 0 <= r[0] < r[1] for r in ranges)):
        out.append(f"peft_layer_replication={ranges!r}: write a list of [start, end) layer ranges, e.g. "
                   "[[0, 4], [2, 6]]")
    for key in ("peft_ensure_weight_tying", "peft_autocast_adapter_dtype"):
        if d.get(key) is not None and not isinstance(d[key], bool):
            out.append(f"{key}={d[key]!r}; use true or false")
    used = [k for k in ("peft_trainable_token_indices", "peft_layer_replication", "peft_ensure_weight_tying")
            if d.get(k) is not None]
    if used and d.get("adapter") not in ("lora", "qlora"):
        out.append(f"{', '.join(used)} without adapter: lora: they are LoRA options (peft's LoraConfig); set "
                   "adapter: lora or drop them")
    return out


def lora_config_kwargs(t: AdapterOptions) -> dict:
    out = {}
    if t.peft_trainable_token_indices:
        out["trainable_token_indices"] = t.peft_trainable_token_indices
    if t.peft_layer_replication:
        out["layer_replication"] = [tuple(r) for r in t.peft_layer_replication]
    if t.peft_ensure_weight_tying is not None:
        out["ensure_weight_tying"] = t.peft_ensure_weight_tying
    return out


def peft_model_kwargs(t: AdapterOptions) -> dict:
    return {} if t.peft_autocast_adapter_dtype is None else {"autocast_adapter_dtype": t.peft_autocast_adapter_dtype}


def check_layout(t: AdapterOptions, layout, path) -> None:
    """Trainable token rows: a delta over the whole embedding table, which TP and EP split and PP places on the
    first stage apart from a tied lm_head; FSDP2 / DDP / CP hold it whole per rank or sharded by rows as any
    parameter. Replicated layers share their base weights between decoder layers: FSDP2 shards the layers that share
    as one group (distributed/fsdp.sharing_groups); TP / EP split and PP places them per layer."""
    split = {name: getattr(layout, name, 1) for name in ("tp_size", "ep_size", "pp_size")}
    split = {name: size for name, size in split.items() if size > 1}
    if t.peft_trainable_token_indices and split:
        raise ConfigError(f"{path}: peft_trainable_token_indices with {_sizes(split)}: the trainable rows are a delta "
                          "over the whole embedding table, which these split or place apart from a tied lm_head; use "
                          "dp_shard_size / dp_replicate_size / context_parallel_size for this run")
    if t.peft_layer_replication and split:
        raise ConfigError(f"{path}: peft_layer_replication with {_sizes(split)}: the replicated layers share their "
                          "base weights, which TP / EP split per layer and PP places on different stages; use "
                          "dp_shard_size (FSDP2 shards the sharing layers as one group), dp_replicate_size or "
                          "context_parallel_size for this run")


def _sizes(split: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in split.items())
