"""Checkpoints: exact resume, resharding between every pair of layouts, HF export.

One tiny Llama (2 layers, tied embeddings: the hard case for PP) trains under each layout of LAYOUTS on its
own shuffled order of right-padded samples, then saves (``accelerator.save_state``). The launches, in order:

    1 rank    in this process: save
    2 ranks   save   (fsdp2, pp2): N steps, save_state [+ save_model], N more steps of the same run
    4 ranks   save   (hsdp2x2, fsdp2_tp2, pp2_fsdp2)
    2 ranks   load   fresh processes: resume each layout's own checkpoint for N steps; then load *every*
                     checkpoint under every 2-rank layout and gather the full state
    4 ranks   load   the same for the 4-rank layouts
    1 rank    in this process: load every checkpoint

What is compared (all bit-exact, ``torch.equal`` / ``==``, because a checkpoint moves bytes, not math):
- resume: the N losses after load in fresh processes equal steps N+1..2N of the run that saved (which went
  on after saving, so saving is also shown not to disturb a run);
- the checkpoint read back offline equals the full state gathered at save time (model and optimizer);
- after loading under any layout, the full state gathered there equals the checkpoint, and the scheduler
  state equals the saved one;
- a changed number of data-parallel ranks warns about the dataloader position;
- save_model output and `nd-parallel export` of a checkpoint load with from_pretrained to the same weights
  and logits.

Adding a layout (e.g. CP2) is one line in LAYOUTS.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from nd_parallel.fault.launch import launch

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "checkpoint_worker.py")
STEPS = 4  # N: the resumed half; 24 samples make the 2-rank and 4-rank runs cross an epoch end
SAMPLES = dict(n=24, seq_len=16)


def L(world, export=None, resume=False, never_saved=False, **config):
    return {"world": world, "config": config, "resume": resume, "export": export, "never_saved": never_saved}


# name -> world size, ParallelismConfig kwargs, exact-resume test?, save_model max_shard_size (None: no export)
LAYOUTS = {
    "1r": L(1, resume=True, never_saved=True),
    "fsdp2": L(2, resume=True, dp_shard_size=2),
    "pp2": L(2, resume=True, export="100KB", pp_size=2),  # tied weight on both stages; several files + index
    "hsdp2x2": L(4, dp_replicate_size=2, dp_shard_size=2),
    "fsdp2_tp2": L(4, resume=True, export="10GB", dp_shard_size=2, tp_size=2),
    "pp2_fsdp2": L(4, pp_size=2, dp_shard_size=2),
    "cp2": L(2, resume=True, cp_size=2),
    # two stages per rank (virtual stages): names and both tied copies come from two stage modules on one rank
    "pp2_interleaved": L(2, resume=True, pp_size=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2),  # sequence split: weights sharded over cp, the RNG and data shared
}
for _i, _layout in enumerate(LAYOUTS.values()):
    _layout["shift"] = 3 * _i
NAMES = list(LAYOUTS)
WORLDS = sorted({lay["world"] for lay in LAYOUTS.values()})
PAIRS = [(a, b) for a in NAMES for b in NAMES]


def _dp(config: dict) -> int:
    return config.get("dp_replicate_size", 1) * config.get("dp_shard_size", 1)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Run every phase once; returns the output directory (save_*.pt, load_*.pt, export_*, ckpt/)."""
    from nd_parallel.testing.models import save_tiny_model

    sys.path.insert(0, str(HERE))
    import checkpoint_worker as worker

    root = tmp_path_factory.mktemp("checkpoint")
    model_dir = save_tiny_model("llama", root / "model", num_hidden_layers=4)  # 4: interleaved PP needs 4 stages
    spec = {"model": str(model_dir), "samples": SAMPLES, "steps": STEPS, "per_rank": 2, "ckpt": str(root / "ckpt"),
            "out": str(root),
            "layouts": {n: {k: v for k, v in lay.items() if k != "world"} for n, lay in LAYOUTS.items()},
            "checkpoints": NAMES}
    for phase in ("save", "load"):
        for world in WORLDS:
            names = [n for n in NAMES if LAYOUTS[n]["world"] == world]
            path = root / f"spec_{phase}_{world}.json"
            path.write_text(json.dumps({**spec, "save": names, "load": names}))
            if world == 1:
                worker.main(str(path), phase)  # one process: no launcher needed
            else:
                launch(WORKER, world, [str(path), phase], timeout=900, capture=True, env={"HF_HUB_OFFLINE": "1"})
    return root


@pytest.fixture(scope="module")
def saved(matrix):
    return {n: torch.load(matrix / f"save_{n}.pt", weights_only=True) for n in NAMES}


@pytest.fixture(scope="module")
def loaded(matrix):
    return {n: torch.load(matrix / f"load_{n}.pt", weights_only=True) for n in NAMES}


@pytest.fixture(scope="module")
def on_disk(matrix):
    """Each checkpoint read back offline (no process group), as the canonical flat dict."""
    from nd_parallel.checkpoint.export import read_tensors

    out = {}
    for name in NAMES:
        ckpt = matrix / "ckpt" / name
        state = {f"model.{k}": v for k, v in read_tensors(ckpt, "model")}
        state.update({f"optim.{k}": v for k, v in read_tensors(ckpt, "optim")})
        out[name] = state
    return out


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:8]}"
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    worst = max(((got[k].float() - want[k].float()).abs().max().item() for k in bad), default=0.0)
    assert not bad, f"{what}: {len(bad)} tensors differ (max abs {worst:.3g}), e.g. {bad[:4]}"


@pytest.mark.parametrize("name", [n for n in NAMES if LAYOUTS[n]["resume"]])
def test_resume_is_exact(name, saved, loaded):
    full = saved[name]["uninterrupted"]
    first, resumed = saved[name]["first"], loaded[name]["resumed"]
    print(f"{name}: uninterrupted {full}\n   save+load {first + resumed}")
    assert len(full) == 2 * STEPS and full[:STEPS] == first
    assert resumed == full[STEPS:], "the resumed run is not bit-identical to the uninterrupted one"
    assert full[-1] < full[0], "training did not move: an exact resume of nothing proves nothing"


def test_saving_does_not_disturb_the_run(saved):
    """The resume references continue the run that saved; here one is compared with a run that never saved."""
    for name, layout in LAYOUTS.items():
        if layout["never_saved"]:
            assert saved[name]["uninterrupted"] == saved[name]["never_saved"], name


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_holds_what_was_trained(name, saved, on_disk):
    state = on_disk[name]
    _assert_same(state, saved[name]["state"], f"{name}: checkpoint on disk vs state at save time")
    assert "model.lm_head.weight" not in state, "a tied weight is stored once, under its source name"
    assert any(k.endswith(".exp_avg_sq") for k in state) and any(k.endswith(".step") for k in state)


def test_checkpoints_differ_from_each_other(on_disk):
    """Each layout trained on its own order, so a load that left any tensor untouched would show."""
    key = "model.model.layers.0.mlp.up_proj.weight"
    for a in NAMES:
        for b in NAMES:
            if a < b:
                assert not torch.equal(on_disk[a][key], on_disk[b][key]), (a, b)


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_reshard(source, target, saved, loaded, on_disk):
    result = loaded[target][source]
    _assert_same(result["state"], on_disk[source], f"saved under {source}, loaded under {target}")
    assert result["sched"] == saved[source]["sched"]
    dp_changed = _dp(LAYOUTS[source]["config"]) != _dp(LAYOUTS[target]["config"])
    about_data = [w for w in result["warnings"] if w.startswith("dataloader 0:")]
    assert bool(about_data) == dp_changed, result["warnings"]
    if dp_changed:  # it says where it resumes, in numbers: the same samples consumed, on the new dp ranks
        src_dp, dst_dp = _dp(LAYOUTS[source]["config"]), _dp(LAYOUTS[target]["config"])
        in_epoch = STEPS % (SAMPLES["n"] // (2 * src_dp))  # batches of the current epoch the saved run took
        assert f"resumes at batch {in_epoch * src_dp // dst_dp} " in about_data[0], about_data[0]


def _logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        return model(input_ids=ids).logits, model


def _reference_logits(model_dir, state: dict, ids):
    """The original architecture with the saved weights put in by hand: what the export must reproduce."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    weights = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    missing = model.load_state_dict(weights, strict=False).missing_keys
    assert missing == ["lm_head.weight"], missing  # re-tied to the embedding, which was loaded
    model.tie_weights()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("name", [n for n in NAMES if LAYOUTS[n]["export"]])
def test_save_model_loads_in_transformers(name, matrix, saved):
    from safetensors import safe_open

    out = matrix / f"export_{name}"
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert (len(files) > 1) == (LAYOUTS[name]["export"] == "100KB"), files
    assert (out / "model.safetensors.index.json").is_file() == (len(files) > 1)
    stored = {}
    for f in files:
        with safe_open(str(out / f), "pt") as handle:
            stored.update({k: handle.get_tensor(k) for k in handle.keys()})  # noqa: SIM118
    assert "lm_head.weight" not in stored  # what save_pretrained writes for a tied model
    want = {k[len("model."):]: v for k, v in saved[name]["state"].items() if k.startswith("model.")}
    _assert_same(stored, want, f"{name}: save_model files vs the trained weights")
    ids = torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    logits, model = _logits(out, ids)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(logits, _reference_logits(matrix / "model", saved[name]["state"], ids))


def test_offline_export_cli(matrix, saved, tmp_path):
    """`nd-parallel export` of a 4-rank PP x FSDP checkpoint, in this process without any process group."""
    import torch.distributed as dist

    from nd_parallel.cli.main import main

    assert not dist.is_initialized()
    out = tmp_path / "hf"
    assert main(["export", str(matrix / "ckpt" / "pp2_fsdp2"), str(out), "--max-shard-size", "200KB"]) == 0
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    ids = torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    logits, _ = _logits(out, ids)
    assert torch.equal(logits, _reference_logits(matrix / "model", saved["pp2_fsdp2"]["state"], ids))


def _written(dcp_dir: Path) -> tuple[dict[int, int], dict[str, int]]:
    """From the checkpoint's DCP metadata: the tensor bytes placed in each rank's file (``__<rank>_<n>.distcp``),
    and each file's bytes as the metadata accounts for them (every item's byte range, pickled values included)."""
    import math

    from nd_parallel.checkpoint.format import read_dcp_metadata

    meta = read_dcp_metadata(dcp_dir)
    tensor_bytes, file_bytes = {}, {}
    for index, info in meta.storage_data.items():
        file_bytes[info.relative_path] = file_bytes.get(info.relative_path, 0) + info.length
        entry = meta.state_dict_metadata[index.fqn]
        if not hasattr(entry, "chunks"):  # a pickled value: hyper-parameters, schedulers
            continue
        chunk = next(c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset))
        rank = int(info.relative_path.split("_")[2])
        tensor_bytes[rank] = tensor_bytes.get(rank, 0) + math.prod(chunk.sizes) * entry.properties.dtype.itemsize
    return tensor_bytes, file_bytes


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_tp2", "pp2_fsdp2"])
def test_dcp_shard_files_per_rank(name, matrix, saved, on_disk):
    """Each rank wrote its own file, holding at most the tensors that rank holds (its shards under the layout):
    one rank writing the whole model, or whole tensors, would exceed its own bytes."""
    dcp_dir = matrix / "ckpt" / name / "dcp"
    files = sorted(dcp_dir.glob("*.distcp"))
    assert len(files) == LAYOUTS[name]["world"], files
    wrote, file_bytes = _written(dcp_dir)
    held = saved[name]["held"]
    print(f"{name}: tensor bytes written per rank {[wrote.get(r, 0) for r in range(len(held))]}, held {held}")
    for rank, own in enumerate(held):
        assert 0 < wrote.get(rank, 0) <= own, (name, rank, wrote, held)
    # the files hold exactly what the metadata places in them, and every tensor of the checkpoint once
    assert {f.name: f.stat().st_size for f in files} == file_bytes
    assert sum(wrote.values()) == sum(t.numel() * t.element_size() for t in on_disk[name].values())


def test_config_written_with_the_checkpoint(matrix):
    assert os.path.isfile(matrix / "ckpt" / "pp2" / "config.json")
