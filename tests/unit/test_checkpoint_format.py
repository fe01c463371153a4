"""Checkpoint pieces that need no model: the safetensors writer, the metadata reader, retention, positions."""

import json
import os
import pickle
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from nd_parallel.checkpoint import CheckpointError, CheckpointWarning
from nd_parallel.checkpoint.dataloader import resume_at
from nd_parallel.checkpoint.export.writer import Entry, ShardedWriter, natural_key, plan_files
from nd_parallel.checkpoint.format import (
    MARKER,
    apply_total_limit,
    auto_checkpoints,
    publish,
    read_dcp_metadata,
    temp_sibling,
)


def test_streamed_safetensors_read_back_bit_exact(tmp_path):
    tensors = {
        "a.weight": torch.randn(5, 3),
        "b.bias": torch.randn(7).to(torch.bfloat16),
        "c.count": torch.tensor(3, dtype=torch.int64),  # 0-d
        "d.empty": torch.zeros(0, 4),
        "e.mask": torch.tensor([True, False, True]),
        "f.half": torch.randn(2, 2).half().t(),  # not contiguous
    }
    entries = [Entry(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    writer = ShardedWriter(tmp_path, entries, max_shard_size=10**9)
    for k, v in tensors.items():
        writer.write(k, v)
    assert writer.close() == ["model.safetensors"]
    back = load_file(str(tmp_path / "model.safetensors"))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    header_len = int.from_bytes((tmp_path / "model.safetensors").read_bytes()[:8], "little")
    assert header_len % 8 == 0


def test_sharded_files_and_index(tmp_path):
    tensors = {f"layers.{i}.w": torch.full((10, 10), float(i)) for i in range(5)}  # 400 bytes each
    entries = [Entry(k, (10, 10), torch.float32) for k in tensors]
    (tmp_path / "model-00001-of-00009.safetensors").write_bytes(b"stale")  # an earlier export's file
    writer = ShardedWriter(tmp_path, entries, max_shard_size=900)
    for k, v in tensors.items():
        writer.write(k, v)
    names = writer.close()
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (tmp_path / "model-00001-of-00009.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2000
    assert index["weight_map"]["layers.4.w"] == names[2]
    for k, v in tensors.items():
        assert torch.equal(load_file(str(tmp_path / index["weight_map"][k]))[k], v)


def test_writer_refuses_out_of_order(tmp_path):
    writer = ShardedWriter(tmp_path, [Entry("a", (2,), torch.float32), Entry("b", (2,), torch.float32)], 10**9)
    with pytest.raises(RuntimeError, match="expected"):
        writer.write("b", torch.zeros(2))


def test_plan_and_order():
    entries = [Entry(n, (100,), torch.float32) for n in ("x", "y", "z")]  # 400 bytes each
    assert [[e.name for e in f] for f in plan_files(entries, 800)] == [["x", "y"], ["z"]]
    assert [[e.name for e in f] for f in plan_files(entries, 100)] == [["x"], ["y"], ["z"]]  # too big: alone
    names = ["model.layers.10.w", "model.layers.2.w", "lm_head.weight", "model.layers.1.w"]
    assert sorted(names, key=natural_key) == ["lm_head.weight", "model.layers.1.w", "model.layers.2.w",
                                              "model.layers.10.w"]


def test_dcp_metadata_reader_refuses_code(tmp_path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "x": {"lr": 0.1, "betas": (0.9, 0.99)}}, checkpoint_id=str(tmp_path),
                 no_dist=True)
    meta = read_dcp_metadata(tmp_path)  # a real one loads
    assert set(meta.state_dict_metadata) == {"w", "x.lr", "x.betas"}
    witness = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {witness}",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="not a valid DCP metadata file.*refusing"):
        read_dcp_metadata(tmp_path)
    assert not witness.exists()
    (tmp_path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata is missing"):
        read_dcp_metadata(tmp_path)


def _fake_checkpoint(path):
    path.mkdir(parents=True)
    (path / MARKER).write_text("{}")


def test_retention_counts_complete_checkpoints_only(tmp_path):
    for i in (0, 1, 2, 10):
        _fake_checkpoint(tmp_path / f"checkpoint_{i}")
    (tmp_path / "checkpoint_11").mkdir()  # no marker: not complete, never counted or deleted
    (tmp_path / ".checkpoint_12.incomplete").mkdir()
    assert [p.name for p in auto_checkpoints(tmp_path)] == ["checkpoint_0", "checkpoint_1", "checkpoint_2",
                                                           "checkpoint_10"]
    removed = apply_total_limit(tmp_path, 2)
    assert [p.name for p in removed] == ["checkpoint_0", "checkpoint_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint_12.incomplete", "checkpoint_10", "checkpoint_11",
                                                          "checkpoint_2"]
    assert apply_total_limit(tmp_path, None) == []


def test_publish_replaces_atomically(tmp_path):
    final = tmp_path / "ckpt"
    _fake_checkpoint(final)
    (final / "old").write_text("1")
    tmp = temp_sibling(final)
    assert tmp.name == ".ckpt.incomplete"
    _fake_checkpoint(tmp)
    (tmp / "new").write_text("2")
    publish(tmp, final)
    assert sorted(p.name for p in final.iterdir()) == [MARKER, "new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_position_converted_when_dp_changes():
    class Loader:  # what resume_at reads from a prepared loader
        def __init__(self, per_step):
            self.total_batch_size = per_step

    saved = {"epoch": 1, "batches": 3, "dp_size": 4, "samples_per_step": 8}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resume_at(saved, Loader(8), 4, 0) == 3  # same layout: silent
        assert not caught
        assert resume_at(saved, Loader(4), 2, 0) == 6  # 24 samples = 6 steps of 4
        assert resume_at(saved, Loader(16), 8, 0) == 1  # 24 samples = 1.5 steps of 16: 8 samples seen again
    messages = [str(w.message) for w in caught]
    assert all(issubclass(w.category, CheckpointWarning) for w in caught)
    assert "resumes at batch 6 of that epoch" in messages[0] and "exactly where" in messages[0]
    assert "resumes at batch 1 of that epoch" in messages[1] and "8 samples already seen are seen again" in messages[1]


def test_two_stages_on_one_rank_keep_hf_names_and_fill_both_tied_copies():
    """A V-shaped schedule puts the first and the last stage (embedding and its tied head copy) on one rank:
    the merged view has HF names only, saves the tied weight once, and a load fills both copies."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from nd_parallel.checkpoint.names import named_state
    from nd_parallel.distributed.pipeline import _untie
    from nd_parallel.distributed.pipeline.split import split_stages
    from nd_parallel.distributed.pipeline.stage import make_stage_module
    from nd_parallel.models.hf import model_parts
    from nd_parallel.testing.models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=4))
    names = set(model.state_dict())
    parts = model_parts(model)
    specs = split_stages(parts, 4)
    assert _untie(model)
    stages = [make_stage_module(model, parts, specs[i], 4) for i in (0, 3)]  # pp rank 0 of ZBV over 2 ranks
    pipe = SimpleNamespace(stages=stages)
    opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=1e-3)
    saved = named_state(pipe, opt)
    model_keys = {k[len("model."):] for k in saved.flat if k.startswith("model.")}
    assert model_keys == {n for n in names if n.startswith(("model.embed", "model.layers.0.", "model.layers.3.",
                                                             "model.norm"))}  # lm_head: the embedding's copy
    assert all(not k.startswith("optim.state.lm_head") for k in saved.flat)
    loading = named_state(pipe, opt, for_load=True)
    new = torch.randn_like(loading.flat["model.model.embed_tokens.weight"])
    loading.flat["model.model.embed_tokens.weight"].copy_(new)
    loading.restore()
    head, embed = stages[1].lm_head.weight, stages[0].model.embed_tokens.weight
    assert head is not embed and torch.equal(head, new) and torch.equal(embed, new)
