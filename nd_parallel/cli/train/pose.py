"""PoSE (positional skip-wise training; Axolotl's ``use_pose``): train a longer context than the samples hold by
giving each training sample position ids with random skips, up to ``pose_max_context_len``.

A sample is cut into chunks, before each token listed in ``pose_split_on_token_ids`` or, without them, into
``pose_num_chunks`` (default 2) equal chunks; every chunk but the first starts after a random skip, drawn from what
is left of ``pose_max_context_len - length``. ``add_pose_position_ids`` is Axolotl 0.19's function of the same name
in its draws and their order (tests/unit/test_pose.py runs both on the same random state): here each sample's
draws come from a generator keyed by (seed, its index), not the process's global one, so the positions are the
same whoever prepares the data. As in Axolotl the training split is then sorted by its last position (which only a
sequential sampler keeps), and the evaluation split gets skips too unless eval_sample_packing is false. Positions
restart at 0 only at a sample's start, so packed rows, the ring attention (CP) and pipeline stages still see each
sample as one document.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(kw_only=True)
class PoseOptions:
    use_pose: bool = False
    """PoSE: training samples get position ids with random skips up to pose_max_context_len (Axolotl's meaning)."""
    pose_max_context_len: int | None = None
    """The context length PoSE trains for: the last position id of a sample stays below it."""
    pose_split_on_token_ids: list[int] | None = None
    """Skip only right before these token ids (e.g. each turn's start); without them: pose_num_chunks chunks."""
    pose_num_chunks: int | None = None
    """Equal chunks a sample is cut into when no split token ids are given (Axolotl's default 2)."""


def refusals(d: dict) -> list[str]:
    keys = [k for k in ("pose_max_context_len", "pose_split_on_token_ids", "pose_num_chunks") if d.get(k) is not None]
    if d.get("use_pose") is None or d.get("use_pose") is False:
        return [f"{', '.join(keys)} without use_pose: true; set use_pose or drop them"] if keys else []
    out = [] if d["use_pose"] is True else [f"use_pose={d['use_pose']!r}; use true or false"]
    longest, chunks, split = d.get("pose_max_context_len"), d.get("pose_num_chunks"), d.get("pose_split_on_token_ids")
    if isinstance(longest, bool) or not isinstance(longest, int) or longest < 1:
        out.append(f"pose_max_context_len={longest!r}: write the context length to train for (an integer, e.g. "
                   "16384; Axolotl needs it too)")
    elif isinstance(d.get("sequence_len"), int) and longest < d["sequence_len"]:
        out.append(f"pose_max_context_len={longest} is below sequence_len={d['sequence_len']}: PoSE trains a "
                   "context longer than the samples; raise it")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        out.append(f"pose_num_chunks={chunks!r}: write an integer >= 1")
    if split is not None and not (isinstance(split, list) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in split)):
        out.append(f"pose_split_on_token_ids={split!r}: write a list of token ids")
    if d.get("rl") or d.get("streaming") or d.get("pretraining_dataset"):
        out.append("use_pose with rl or streamed data: PoSE's positions are given to the supervised samples prepared "
                   "before training; drop it")
    return out


def add_pose_position_ids(input_ids: list[int], rng: random.Random, max_context_len: int,
                          split_on_token_ids: list[int] | None = None, chunks: int = 2) -> list[int]:
    """One sample's position ids (see the module docstring): Axolotl's draws, in its order, from `rng`."""
    left = max_context_len - len(input_ids)
    if split_on_token_ids:
        splits = [i for i, token in enumerate(input_ids) if token in split_on_token_ids]
    else:
        step = len(input_ids) // chunks
        splits = [i * step for i in range(1, chunks)]
    splits.append(len(input_ids))
    if splits[0] < 2:  # a first cut this close to the start is dropped (Axolotl's rule)
        splits = splits[1:]
    positions, start, skipped = [], 0, 0
    for end in splits:
        skip = rng.randint(0, left) if start != 0 and left else 0
        left -= skip
        skipped += skip
        positions.extend(range(start + skipped, end + skipped))
        start = end
    return positions


def pose_fn(cfg):
    """A batched `map` function (with_indices=True) adding position_ids and Axolotl's sequence_len column."""
    def add(batch, indices):
        out = {"position_ids": [], "sequence_len": []}
        for i, ids in zip(indices, batch["input_ids"]):
            rng = random.Random(cfg.seed * 1_000_003 + i)  # this sample's draws, whoever prepares the data
            positions = add_pose_position_ids(ids, rng, cfg.pose_max_context_len, cfg.pose_split_on_token_ids,
                                              cfg.pose_num_chunks or 2)
            out["position_ids"].append(positions)
            out["sequence_len"].append(positions[-1] if positions else 0)
        return out

    return add


def apply(train, evals, cfg):
    """The training split with PoSE positions, sorted by its last position; the evaluation split too unless
    eval_sample_packing is false (Axolotl's rule)."""
    if not cfg.use_pose:
        return train, evals
    train = train.map(pose_fn(cfg), batched=True, with_indices=True, desc="PoSE position ids").sort("sequence_len")
    if evals is not None and cfg.eval_sample_packing is not False:
        evals = evals.map(pose_fn(cfg), batched=True, with_indices=True, desc="PoSE position ids (eval)")
    if evals is not None and "sequence_len" in evals.column_names:
        evals = evals.remove_columns("sequence_len")
    return train.remove_columns("sequence_len"), evals
