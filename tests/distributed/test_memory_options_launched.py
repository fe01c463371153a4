"""Memory options under layouts: every option on at once under FSDP2 (CPUOffloadPolicy, tiled MLP, activation
offloading) and PP2 (full checkpointing with its inputs offloaded, tiled MLP) matches one process without them, at
the parity tolerances (loss and grad norm rtol 1e-5, parameters atol 1e-5; measured <= 3e-7). One 2-rank launch of
the parity worker; on CPU the offloads move nothing, so this proves they compose with each layout's hooks."""

import pytest
import torch

from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, RunResult, compare, train_reference

SAMPLES = {"n": 16, "seq_len": 32, "seed": 1}
RECIPE = {"steps": 3}
TILES = {"tiled_mlp": True, "tiled_mlp_num_shards": 2, "activation_offloading": True}
ROWS = {"fsdp2": ({"dp_shard_size": 2, "fsdp_offload_params": True, **TILES}, 2),
        "pp2": ({"pp_size": 2, "activation_checkpointing": "full", **TILES}, 1)}


@pytest.fixture(scope="module")
def launched(launch_worker, tiny_model):
    runs = [["llama", name, layout, name, SAMPLES] for name, (layout, _) in ROWS.items()]
    return launch_worker("memory_2r", "tests/distributed/parity_worker.py", 2,
                         {"models": {"llama": tiny_model("llama")}, "recipe": RECIPE, "runs": runs})


@pytest.mark.parametrize("name", list(ROWS))
def test_memory_options_match_one_process_without_them(launched, tiny_model, name):
    ref = train_reference(tiny_model("llama"), make_samples(**SAMPLES), ROWS[name][1], Recipe(**RECIPE))
    got = torch.load(launched / f"{name}.pt")
    diff = compare(ref, RunResult(got["losses"], got["norms"], got["state"]))
    assert diff["loss_rel"] <= 1e-5 and diff["norm_rel"] <= 1e-5 and diff["param_abs"] <= 1e-5, diff
    assert got["rank_spread"] == 0.0
