"""The parity matrix: every layout trains exactly like one process on the same global batches.

One torchrun launch per world size runs every (family, layout) of that size; each pair is then its own
test case comparing loss per step (rtol 1e-5), the global gradient norm per step (rtol 1e-5) and every
parameter after the last step (atol 1e-5) with a single-process reference. The data has right padding, so
data-parallel ranks hold different numbers of label tokens in every step.
"""

import json

import pytest
import torch

from nd_parallel.launch import launch
from nd_parallel.parity import Recipe, RunResult, compare, train_reference
from nd_parallel.toy import make_samples

WORKER = "tests/distributed/parity_worker.py"
RECIPE = dict(steps=5, per_rank_batch=2, lr=1e-3)
SAMPLES = dict(n=48, seq_len=24)
LOSS_RTOL = NORM_RTOL = 1e-5
PARAM_ATOL = 1e-5

# world size -> layout name -> ParallelismConfig kwargs
LAYOUTS = {
    2: {
        "ddp2": dict(dp_replicate_size=2),
        "fsdp2": dict(dp_shard_size=2),
        "tp2": dict(tp_size=2),
    },
    4: {
        "hsdp2x2": dict(dp_replicate_size=2, dp_shard_size=2),
        "fsdp2_tp2": dict(dp_shard_size=-1, tp_size=2),
        "ddp2_tp2": dict(dp_replicate_size=2, tp_size=2),
    },
    8: {
        "hsdp2x2_tp2": dict(dp_replicate_size=2, dp_shard_size=2, tp_size=2),
    },
}
# llama: tied embeddings; qwen3: per-head q/k norms (replicated_with_grad_allreduce); mistral: untied;
# gemma: tied, scaled embeddings and a padding_idx inside the vocab-sharded embedding.
FAMILIES = {2: ["llama", "qwen3", "mistral", "gemma"], 4: ["llama", "qwen3", "mistral", "gemma"],
            8: ["llama", "qwen3", "mistral"]}
CASES = [(w, f, name) for w, layouts in LAYOUTS.items() for f in FAMILIES[w] for name in layouts]


def _dp(layout: dict, world: int) -> int:
    tp = layout.get("tp_size", 1)
    shard = layout.get("dp_shard_size", 1)
    replicate = layout.get("dp_replicate_size", 1)
    if shard == -1:
        shard = world // (tp * replicate)
    return replicate * shard


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory):
    """world size -> directory of rank-0 results, launched lazily once per world size."""
    done = {}

    def get(world):
        if world not in done:
            out = tmp_path_factory.mktemp(f"parity{world}")
            spec = {
                "models": {f: tiny_models[f] for f in FAMILIES[world]},
                "layouts": LAYOUTS[world],
                "recipe": RECIPE,
                "samples": SAMPLES,
            }
            (out / "spec.json").write_text(json.dumps(spec))
            launch(WORKER, world, [str(out), str(out / "spec.json")], timeout=900, capture=True)
            done[world] = out
        return done[world]

    return get


@pytest.fixture(scope="module")
def references(tiny_models):
    cache = {}
    samples = make_samples(**SAMPLES)

    def get(family, dp):
        if (family, dp) not in cache:
            cache[family, dp] = train_reference(tiny_models[family], samples, dp, Recipe(**RECIPE))
        return cache[family, dp]

    return get


@pytest.mark.parametrize("world,family,layout", CASES, ids=[f"{w}r-{f}-{n}" for w, f, n in CASES])
def test_layout_matches_single_process(world, family, layout, runs, references):
    saved = torch.load(runs(world) / f"{family}__{layout}.pt", weights_only=True)
    run = RunResult(saved["losses"], saved["norms"], saved["state"])
    ref = references(family, _dp(LAYOUTS[world][layout], world))
    diff = compare(ref, run)
    print(f"{world} ranks {family} {layout}: {diff}")
    assert saved["rank_spread"] == 0.0, "the reported loss differs between ranks"
    assert diff["loss_rel"] <= LOSS_RTOL, (diff, run.losses, ref.losses)
    assert diff["norm_rel"] <= NORM_RTOL, (diff, run.norms, ref.norms)
    assert diff["param_abs"] <= PARAM_ATOL, diff
    # Training moved the weights: parity of a run that changed nothing would prove nothing.
    assert ref.losses[-1] < ref.losses[0]
