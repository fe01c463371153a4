"""Bad checkpoints are refused before anything is loaded, with a message that names the file and the fix.

One process, a tiny Llama under the plugin (no process group): save a good checkpoint, damage a copy, and
check both the message and that the model and optimizer were left exactly as they were.
"""

import shutil

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch.utils.data import DataLoader

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.checkpoint import CheckpointError
from nd_parallel.testing.models import make_samples, save_tiny_model


def _collate(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_models")
    return {"llama": save_tiny_model("llama", root / "llama"),
            "wide": save_tiny_model("llama", root / "wide", hidden_size=128, intermediate_size=256),
            "qwen3": save_tiny_model("qwen3", root / "qwen3")}


def run(model_dir, steps=2, project=None, custom=None):
    """A prepared one-process run after ``steps`` steps: (accelerator, model, optimizer, loader)."""
    from transformers import AutoModelForCausalLM

    accelerator = Accelerator(project_config=project) if project else Accelerator()
    NDParallelPlugin(ParallelismConfig()).attach(accelerator)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 10)
    loader = DataLoader(make_samples(16, 12), batch_size=2, shuffle=True, collate_fn=_collate)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    if custom is not None:
        accelerator.register_for_checkpointing(custom)
    for i, batch in zip(range(steps), loader):
        accelerator.backward(model(**batch).loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    return accelerator, model, opt, loader


@pytest.fixture(scope="module")
def good(models, tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "ckpt"
    accelerator, *_ = run(models["llama"])
    accelerator.save_state(path)
    return path


def refused(accelerator, model, opt, path, match):
    """load_state raises CheckpointError matching ``match`` and leaves model and optimizer untouched."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    had_state = bool(opt.optimizer.state)
    with pytest.raises(CheckpointError, match=match) as err:
        accelerator.load_state(path)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "weights changed"
    assert bool(opt.optimizer.state) == had_state, "the optimizer was initialised by a refused load"
    return str(err.value)


@pytest.fixture
def fresh(models):
    accelerator, model, opt, _ = run(models["llama"], steps=0)
    return accelerator, model, opt


def test_good_checkpoint_loads(fresh, good):
    accelerator, model, opt = fresh
    marker = accelerator.load_state(good)
    assert marker["optimizer_step"] == 2 and marker["world_size"] == 1 and opt.optimizer.state


def test_model_alone_loads_from_a_training_state(models, good):
    """Evaluation: only the model prepared; optimizer, scheduler and data position in the checkpoint are skipped."""
    from transformers import AutoModelForCausalLM

    from nd_parallel.checkpoint.export import read_tensors

    accelerator = Accelerator()
    NDParallelPlugin(ParallelismConfig()).attach(accelerator)
    model = accelerator.prepare(AutoModelForCausalLM.from_pretrained(models["llama"]))
    accelerator.load_state(good)
    saved = dict(read_tensors(good))
    assert set(saved) | {"lm_head.weight"} == set(model.state_dict())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_checkpoint_of_another_model(models, good):
    accelerator, model, opt, _ = run(models["qwen3"], steps=0)
    msg = refused(accelerator, model, opt, good, "does not match the model being loaded")
    assert "q_norm" in msg and "missing from the checkpoint" in msg and "config.json" in msg
    accelerator, model, opt, _ = run(models["wide"], steps=0)
    msg = refused(accelerator, model, opt, good, "shapes differ")
    assert "model.embed_tokens.weight is (256, 64) in the checkpoint, (256, 128) here" in msg


def test_damaged_files(fresh, good, tmp_path):
    accelerator, model, opt = fresh
    shard = next((good / "dcp").glob("*.distcp")).name
    cases = {
        "truncated": (lambda d: (d / "dcp" / shard).write_bytes((d / "dcp" / shard).read_bytes()[:1000]),
                      rf"shard file .*{shard} is truncated: 1000 bytes"),
        "missing shard": (lambda d: (d / "dcp" / shard).unlink(), rf"shard file .*{shard} is missing"),
        "missing metadata": (lambda d: (d / "dcp" / ".metadata").unlink(), r"\.metadata is missing"),
        "missing rng": (lambda d: next((d / "rng").iterdir()).unlink(), r"rank_00000\.safetensors is missing"),
        "bad marker": (lambda d: (d / "nd_parallel.json").write_text("{not json"), "is unreadable"),
    }
    for i, (name, (damage, match)) in enumerate(cases.items()):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(good, copy)
        damage(copy)
        refused(accelerator, model, opt, copy, match)


def test_model_only_export_is_not_a_training_state(fresh, good, tmp_path):
    accelerator, model, opt = fresh
    accelerator.save_model(model, tmp_path / "export")
    msg = refused(accelerator, model, opt, tmp_path / "export", "holds model weights only")
    assert "plugin.from_pretrained" in msg
    refused(accelerator, model, opt, tmp_path / "nowhere", "does not exist")


def test_interrupted_save_keeps_the_previous_checkpoint(models, good, tmp_path, monkeypatch):
    from nd_parallel.checkpoint import state

    target = tmp_path / "ckpt"
    shutil.copytree(good, target)
    accelerator, model, opt, _ = run(models["llama"], steps=3)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(state, "write_json", crash)  # dies after every shard was written, before the marker
    with pytest.raises(OSError, match="disk full"):
        accelerator.save_state(target)
    monkeypatch.undo()
    partial = tmp_path / ".ckpt.incomplete"
    assert (partial / "dcp" / ".metadata").is_file() and not (partial / "nd_parallel.json").exists()
    fresh_acc, fresh_model, fresh_opt, _ = run(models["llama"], steps=0)
    assert fresh_acc.load_state(target)["optimizer_step"] == 2  # the previous good one, untouched
    msg = refused(fresh_acc, fresh_model, fresh_opt, partial, "left by an interrupted save")
    assert "ckpt" in msg
    accelerator.save_state(target)  # the next save cleans the leftover up
    assert not partial.exists() and fresh_acc.load_state(target)["optimizer_step"] == 3


def test_automatic_naming_and_total_limit(models, tmp_path, monkeypatch):
    from nd_parallel.checkpoint import state

    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator, model, opt, loader = run(models["llama"], steps=1, project=project)
    for _ in range(3):
        accelerator.save_state()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    monkeypatch.setattr(state, "write_json", lambda *a, **k: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError):
        accelerator.save_state()  # checkpoint_3 never completes
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == [".checkpoint_3.incomplete", "checkpoint_1", "checkpoint_2"]
    accelerator.load_state()  # the latest *complete* one
    assert loader._nd_position.pending is not None
    with pytest.raises(RuntimeError, match="already positioned this dataloader"):
        accelerator.skip_first_batches(loader, 1)


class _Opaque:  # not plain data: torch.load(weights_only=True) refuses it
    pass


class _Custom:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, sd):
        self.value = sd["value"]


def test_non_plain_values_are_refused_before_weights(models, tmp_path):
    accelerator, *_ = run(models["llama"], custom=_Custom(_Opaque()))
    accelerator.save_state(tmp_path / "opaque")
    accelerator, model, opt, _ = run(models["llama"], steps=0, custom=_Custom(1))
    refused(accelerator, model, opt, tmp_path / "opaque", "not plain data.*nothing was loaded")
    plain = _Custom({"a": [1, 2.5, "x"]})
    accelerator, *_ = run(models["llama"], custom=plain)
    accelerator.save_state(tmp_path / "plain")
    back = _Custom(None)
    accelerator, *_ = run(models["llama"], steps=0, custom=back)
    accelerator.load_state(tmp_path / "plain")
    assert back.value == {"a": [1, 2.5, "x"]}


def test_save_model_matches_save_pretrained(models, tmp_path):
    """One process: the plugin's export and transformers' own writer give the same files and bytes."""
    from safetensors.torch import load_file

    accelerator, model, _, _ = run(models["llama"], steps=1)
    accelerator.save_model(model, tmp_path / "ours")
    model.save_pretrained(tmp_path / "theirs")
    ours, theirs = load_file(str(tmp_path / "ours" / "model.safetensors")), load_file(
        str(tmp_path / "theirs" / "model.safetensors"))
    assert set(ours) == set(theirs) and "lm_head.weight" not in ours
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    with pytest.raises(ValueError, match="safetensors only"):
        accelerator.save_model(model, tmp_path / "pickle", safe_serialization=False)
