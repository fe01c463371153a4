"""The tables that `nd-parallel demo | train | export` print, and the byte counts that go into them.

`local_state_bytes` runs on every rank (rank.py gathers it); the rest runs in the parent once rank 0's results
are back. Nothing here imports torch at module level: the parent prints a table long after the ranks are gone.
"""

from __future__ import annotations

import math
from pathlib import Path


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def loss_lines(losses: list[float], per_line: int = 10) -> list[str]:
    return [f"{i + 1}-{min(i + per_line, len(losses))}:".ljust(7) + " ".join(f"{x:.4f}" for x in losses[i:i + per_line])
            for i in range(0, len(losses), per_line)]


def memory_lines(ranks: list[dict], unsharded: int) -> list[str]:
    """One line per rank; the share of one unsharded process when that is known (0: no safetensors)."""
    lines = []
    for r, b in enumerate(info["bytes"] for info in ranks):
        total = b["params"] + b["optimizer"]
        share = f" ({100 * total / unsharded:.1f}% of unsharded)" if unsharded else ""
        lines.append(f"rank {r}: {human_bytes(b['params'])} params + {human_bytes(b['optimizer'])} AdamW = "
                     f"{human_bytes(total)}" + share)
    return lines


def table(title: str, rows: list[tuple[str, str | list[str]]]) -> str:
    """The title, underlined, then one key column and one value column; a list value takes several lines."""
    width = max(len(k) for k, _ in rows) + 2
    out = [title, "-" * len(title)]
    for key, value in rows:
        values = value if isinstance(value, list) else [value]
        out += [(key if i == 0 else "").ljust(width) + v for i, v in enumerate(values)]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------- byte counts
def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP/TP): only this rank's shard is real
    return t.numel() * t.element_size()


def local_state_bytes(optimizer) -> dict[str, int]:
    """Bytes this rank holds for trained parameters and AdamW moments, measured on the real (sharded) tensors."""
    import torch

    opt = getattr(optimizer, "optimizer", optimizer)
    params = list({id(p): p for g in opt.param_groups for p in g["params"]}.values())
    moments = [v for p in params for k, v in opt.state.get(p, {}).items() if k != "step" and torch.is_tensor(v)]
    return {"params": sum(map(_local_bytes, params)), "optimizer": sum(map(_local_bytes, moments))}


def checkpoint_numel(model_dir: str) -> int:
    """Parameters of a checkpoint, from its safetensors headers (a tied weight is stored once)."""
    from safetensors import safe_open

    total = 0
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (no __iter__)
    return total


def unsharded_bytes(n_params: int) -> int:
    """One process's fp32 parameters plus AdamW's two moments: the 100% the per-rank lines compare with."""
    return 3 * 4 * n_params
