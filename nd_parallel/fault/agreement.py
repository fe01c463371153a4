"""Agreement at prepare: every rank must run the same job. Different YAMLs on two nodes, another checkpoint, a
different dataset or library version otherwise surface much later as a hang or a silent divergence.

Each rank hashes a few fields, one ``all_gather_object`` of the hashes compares them (before the first collective of
``prepare``), and when some differ every rank gathers the values of the first such field and raises the same error:
which field, which ranks hold what, the first entries that differ.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist


class AgreementError(RuntimeError):
    """Ranks were started with different settings; the message names the field and what differs."""


def _model_config(model) -> dict:
    from nd_parallel.models.peft import base_of

    hf = base_of(model)
    config = getattr(hf, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return {"class": type(hf).__name__}
    data = config.to_dict()
    for volatile in ("transformers_version", "_name_or_path"):  # differ between equal models copied elsewhere
        data.pop(volatile, None)
    return data


def fields_of(config, objects, versions: dict[str, str] | None = None) -> dict[str, object]:
    """The values every rank must agree on, as plain JSON-able data (field name -> value)."""
    import transformers

    from nd_parallel.version import __version__

    models = [o for o in objects if isinstance(o, torch.nn.Module)]
    loaders = [o for o in objects if isinstance(o, torch.utils.data.DataLoader)]
    return {
        "parallelism config": config.to_dict(),
        "model config": [_model_config(m) for m in models],
        "trainable parameters": [sorted(f"{n}{tuple(p.shape)}" for n, p in m.named_parameters() if p.requires_grad)
                                 for m in models],
        "dataloader length": [len(d) if hasattr(d, "__len__") else None for d in loaders],
        "versions": versions or {"nd_parallel": __version__, "torch": torch.__version__,
                                 "transformers": transformers.__version__},
    }


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _diff(a, b, path: str = "") -> str:
    """The first place two JSON values differ: 'num_hidden_layers: 2 vs 4'."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if a.get(key, "<absent>") != b.get(key, "<absent>"):
                return _diff(a.get(key, "<absent>"), b.get(key, "<absent>"), f"{path}{key}.")
    if isinstance(a, list) and isinstance(b, list):
        if len(a) == len(b):
            for x, y in zip(a, b):
                if x != y:
                    return _diff(x, y, path)
        only_a, only_b = [x for x in a if x not in b][:3], [y for y in b if y not in a][:3]
        if only_a or only_b:
            return f"{path.rstrip('.') or 'entries'}: only in the first {only_a}, only in the second {only_b}"
    return f"{path.rstrip('.') or 'value'}: {json.dumps(a, default=str)[:120]} vs {json.dumps(b, default=str)[:120]}"


def check(fields: dict[str, object], group=None) -> None:
    """Raise AgreementError on every rank when any field differs between ranks (a collective)."""
    mine = {name: _digest(value) for name, value in fields.items()}
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    for name in fields:
        holders: dict[str, list[int]] = {}
        for rank, digests in enumerate(gathered):
            holders.setdefault(digests.get(name), []).append(rank)
        if len(holders) == 1:
            continue
        values = [None] * dist.get_world_size(group)  # every rank takes this branch: the hashes are the same
        dist.all_gather_object(values, fields[name], group=group)
        (_, ranks_a), (_, ranks_b) = sorted(holders.items(), key=lambda kv: kv[1][0])[:2]
        raise AgreementError(
            f"ranks disagree on the {name}: ranks {_ranks(ranks_a)} vs ranks {_ranks(ranks_b)} "
            f"({_diff(values[ranks_a[0]], values[ranks_b[0]])}). Every rank must be started with the same YAML, "
            "model, data and library versions; compare them on the nodes of those ranks")


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks[:8])) + (f",... ({len(ranks)})" if len(ranks) > 8 else "")
