"""Streamed data under the layouts: the test YAML tests/axolotl_configs/smollm2_pretrain_streaming.yml (Axolotl's
pretraining_dataset, packed pretraining windows, reinit_weights) under FSDP2 and CP2, and `streaming: true` on an
alpaca file (packed) under FSDP2, each trained on 2 CPU ranks, equal one process on the same global batches.

As in test_train_yaml_parity.py: for FSDP2 the reference's micro_batch_size is doubled (its one rank takes both dp
ranks' rows); the stream is read for the same global batches, so both read the same rows. Compared: the streamed
rows, every train_log.jsonl loss (rtol 1e-5) and the saved model (atol 1e-5). One 2-rank launch, one process for
the references.
"""

from pathlib import Path

import pytest
import torch
import yaml

from tests.distributed.train_yaml_helpers import (
    jobs_for,
    logged,
    run_jobs,
    saved_tensors,
    write_model_and_data,
    write_yaml,
)

CONFIGS = Path(__file__).resolve().parent.parent / "axolotl_configs"
LAYOUT_KEYS = ("fsdp_version", "fsdp_config", "dp_shard_size", "context_parallel_size")


def _variants(data) -> dict[str, tuple[dict, int]]:
    pretrain = yaml.safe_load((CONFIGS / "smollm2_pretrain_streaming.yml").read_text())
    pretrain |= {"base_model": data["model"],
                 "pretraining_dataset": [{**pretrain["pretraining_dataset"][0], "path": data["text"]}]}
    plain = {k: v for k, v in pretrain.items() if k not in LAYOUT_KEYS}
    pretraining_only = ("pretraining_dataset", "reinit_weights", "pretrain_multipack_attn")
    sft = {**{k: v for k, v in plain.items() if k not in pretraining_only},
           "datasets": [{"path": data["alpaca"], "type": "alpaca"}], "sequence_len": 160, "dp_shard_size": 2}
    return {"pretrain-fsdp2": (pretrain, 2), "pretrain-cp2": ({**plain, "context_parallel_size": 2}, 1),
            "sft-fsdp2": (sft, 2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_streaming")
    data = write_model_and_data(root, n=96)
    parallel, refs = [], []
    for name, (cfg, dp) in _variants(data).items():
        parallel.append(write_yaml(root / f"{name}.yaml", {**cfg, "output_dir": str(root / name)}))
        ref = {k: v for k, v in cfg.items() if k not in LAYOUT_KEYS}
        ref |= {"output_dir": str(root / f"{name}-ref"), "micro_batch_size": cfg["micro_batch_size"] * dp}
        refs.append(write_yaml(root / f"{name}-ref.yaml", ref))
    ref_jobs, jobs = jobs_for(refs, root / "work", 1), jobs_for(parallel, root / "work", 2)
    run_jobs(ref_jobs, root / "work", 1)
    run_jobs(jobs, root / "work", 2)
    return root, {j.name: j for j in ref_jobs + jobs}


@pytest.mark.parametrize("name", ["pretrain-fsdp2", "pretrain-cp2", "sft-fsdp2"])
def test_streamed_run_matches_one_process(runs, name):
    import datasets

    root, jobs = runs
    rows, ref_rows = (datasets.load_from_disk(str(Path(jobs[n].prepared) / "train")) for n in (name, f"{name}-ref"))
    dp = jobs[name].layout.dp_size  # max_steps 2 x 2 accumulated x micro_batch_size 1 x dp rows, no more
    assert rows["input_ids"] == ref_rows["input_ids"] and len(rows) == 4 * dp
    got, ref = root / name, root / f"{name}-ref"
    losses, ref_losses = [r["loss"] for r in logged(got)], [r["loss"] for r in logged(ref)]
    assert [r["step"] for r in logged(got)] == [1, 2]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    tensors, ref_tensors = saved_tensors(got), saved_tensors(ref)
    assert set(tensors) == set(ref_tensors) and tensors
    worst = max((tensors[k] - v).abs().max().item() for k, v in ref_tensors.items())
    print(f"{name}: losses {losses} vs {ref_losses}, saved-tensor diff {worst:.2e}")
    assert worst <= 1e-5


def test_reinit_weights_starts_from_a_random_init(runs):
    """reinit_weights: the first loss is that of an untrained model (near ln(vocab)). The test checkpoint is a random
    tiny model too, so this cannot tell reinit from loading: tests/unit/test_streaming.py proves the seeded init and
    that no weight file is read; here the streamed run under FSDP2 trains from it."""
    import math

    from transformers import AutoConfig

    root, jobs = runs
    vocab = AutoConfig.from_pretrained(jobs["pretrain-fsdp2"].train.base_model).vocab_size
    first = logged(root / "pretrain-fsdp2")[0]["loss"]
    assert abs(first - math.log(vocab)) < 0.5, (first, math.log(vocab))
