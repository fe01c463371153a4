"""LoRA parity rows: every layout trains a PEFT LoRA adapter exactly like one process with the same init.

Two launches (2 and 4 ranks) run every (family, layout, model path); each row compares loss per step (rtol
1e-5), global gradient norm per step (rtol 1e-5) and every parameter at the end (atol 1e-5; the adapter moves,
the frozen base must not) with a single-process PeftModel: plain ``get_peft_model`` on plain transformers, no
nd_parallel (for the memory-efficient path, started from the adapter values that path initialised). Every rank
also reports that no frozen parameter got a gradient or optimizer state. The same launches save the adapter and
the merged model (compared here, tensor by tensor and by their logits, with the one-process run's trained adapter)
and resume a LoRA run from save_state under another layout.
"""

import hashlib
import sys
from pathlib import Path

import pytest
import torch

from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, RunResult, compare

sys.path.insert(0, str(Path(__file__).parent))
from peft_recipe import lora_config, train_reference  # noqa: E402

WORKER = "tests/distributed/peft_worker.py"
SAMPLES = dict(n=64, seq_len=24)
STEPS = 4
LR = 1e-3  # the parity recipe's: Adam's amplification of fp32 reduction-order noise grows with the step size
FAMILIES = ["llama", "qwen3", "mistral"]
# launch -> (world, samples per dp rank, {layout name: (config, model path)})
LAUNCHES = {
    "2r": (2, 4, {"ddp2": ({"dp_replicate_size": 2}, "wrap"), "fsdp2": ({"dp_shard_size": 2}, "load"),
                  "tp2": ({"tp_size": 2}, "wrap"), "tp2_load": ({"tp_size": 2}, "load"),
                  "pp2": ({"pp_size": 2}, "wrap"), "cp2": ({"cp_size": 2}, "wrap")}),
    "4r": (4, 4, {"fsdp2_tp2": ({"dp_shard_size": 2, "tp_size": 2}, "load"),
                  "pp2_tp2": ({"pp_size": 2, "tp_size": 2}, "wrap")}),
}
# Checkpoint rows (llama only): save_state under one layout after step 2, resume under another with the same
# number of data-parallel ranks (the same global batches), e.g. TP -> PP, FSDP -> DDP, FSDPxTP -> DDPxTP.
RESUME_ONLY = {"ddp2_tp2": ({"dp_replicate_size": 2, "tp_size": 2}, "wrap")}
RESUME = {"2r": [("tp2", "pp2"), ("fsdp2", "ddp2")], "4r": [("fsdp2_tp2", "ddp2_tp2")]}
EXPORTS = {"2r": "tp2", "4r": "pp2_tp2"}  # layout whose adapter / merged model is exported (llama)
CASES = [(n, f, lay) for n, (_, _, lays) in LAUNCHES.items() for f in FAMILIES for lay in lays]


def _dp(config: dict, world: int) -> int:
    return world // (config.get("tp_size", 1) * config.get("pp_size", 1) * config.get("cp_size", 1))


def _spec(name, out, tiny_model):
    """Every (family, layout) row of the launch, plus its export and save_state / resume rows (llama)."""
    _, per_rank, layouts = LAUNCHES[name]
    rows = [[f, cfg, how, f"{f}__{lay}", {}] for f in FAMILIES for lay, (cfg, how) in layouts.items()]
    for row in rows:
        if row[3] == f"llama__{EXPORTS[name]}":
            row[4] = {"adapter": str(out / "adapter"), "merged": str(out / "merged")}
    for saver, loader in RESUME[name]:
        next(r for r in rows if r[3] == f"llama__{saver}")[4].update(save_at=2, ckpt=str(out / saver))
        cfg, how = {**layouts, **RESUME_ONLY}[loader]
        rows.append(["llama", cfg, how, f"resume__{saver}__{loader}", {"resume": str(out / saver)}])
    return {"models": {f: tiny_model(f) for f in FAMILIES}, "samples": SAMPLES, "runs": rows,
            "recipe": dict(steps=STEPS, per_rank_batch=per_rank, lr=LR)}


@pytest.fixture(scope="module")
def runs(tiny_model, launch_worker):
    """launch name -> directory of rank-0 results, launched lazily once per launch."""
    return lambda name: launch_worker(f"peft_{name}", WORKER, LAUNCHES[name][0],
                                      lambda out: _spec(name, out, tiny_model))


def _digest(tensors: dict | None) -> str | None:
    if tensors is None:
        return None
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def references(tiny_model, memo):
    """The one-process PeftModel run a row must reproduce: family, model path, data-parallel size, batch, and for
    the memory-efficient path the adapter init it drew (the same seed gives every launch the same one)."""
    def get(family, how, dp, per_rank, adapter_init=None):
        recipe = Recipe(steps=STEPS, per_rank_batch=per_rank, lr=LR)
        return memo((family, how, dp, per_rank, _digest(adapter_init)), lambda: train_reference(
            tiny_model(family), how, make_samples(**SAMPLES), dp, recipe, adapter_init))

    return get


def _load(path):
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("launch_name,family,layout", CASES, ids=[f"{a}-{f}-{n}" for a, f, n in CASES])
def test_lora_matches_single_process(launch_name, family, layout, runs, references):
    world, per_rank, layouts = LAUNCHES[launch_name]
    config, how = layouts[layout]
    saved = _load(runs(launch_name) / f"{family}__{layout}.pt")
    run = RunResult(saved["losses"], saved["norms"], saved["state"])
    assert (saved["adapter_init"] is not None) == (how == "load")
    ref = references(family, how, _dp(config, world), per_rank, saved["adapter_init"])
    diff = compare(ref, run)
    adapter = {k for k in ref.state if ".lora_" in k}
    print(f"{launch_name} {family} {layout}: {diff} memory per rank {saved['memory']}")
    assert saved["rank_spread"] == 0.0
    assert diff["loss_rel"] <= 1e-5, (diff, run.losses, ref.losses)
    assert diff["norm_rel"] <= 1e-5, (diff, run.norms, ref.norms)
    assert diff["param_abs"] <= 1e-5, diff
    assert saved["frozen_grads"] == 0 and saved["frozen_state"] == 0, "a frozen base parameter got grads or state"
    # Training moved every adapter (LoRA's B starts at zero, so a silent no-op would leave it zero).
    assert all(ref.state[k].abs().max() > 1e-4 for k in adapter if ".lora_B." in k)


@pytest.mark.parametrize("launch_name", list(RESUME))
def test_lora_resume_under_another_layout(launch_name, runs):
    out = runs(launch_name)
    for saver, loader in RESUME[launch_name]:
        whole = _load(out / f"llama__{saver}.pt")
        resumed = _load(out / f"resume__{saver}__{loader}.pt")
        assert len(resumed["losses"]) == STEPS - 2
        for a, b in zip(resumed["losses"], whole["losses"][2:]):
            assert abs(a - b) <= 1e-5 * abs(b), (saver, loader, resumed["losses"], whole["losses"])
        for k, v in whole["state"].items():
            assert (resumed["state"][k] - v).abs().max() <= 1e-5, (saver, loader, k)


@pytest.mark.parametrize("launch_name", list(EXPORTS))
def test_adapter_and_merged_exports_load_in_one_process(launch_name, runs, references, tiny_model):
    """The exported adapter is the adapter one process trains (tensor by tensor, parity tolerance) and, bit for
    bit, the one the layout held; the adapter loaded with PEFT and the merged model give one process's logits."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    world, per_rank, layouts = LAUNCHES[launch_name]
    config, how = layouts[EXPORTS[launch_name]]
    out = runs(launch_name)
    trained = _load(out / f"llama__{EXPORTS[launch_name]}.pt")["state"]
    assert sorted(p.name for p in (out / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    exported = load_file(out / "adapter" / "adapter_model.safetensors")
    one = references("llama", how, _dp(config, world), per_rank)
    want = get_peft_model_state_dict(one.model)  # the one-process run's trained adapter, under PEFT's save names
    assert set(exported) == set(want), sorted(set(exported) ^ set(want))
    worst = max((exported[k] - v).abs().max().item() for k, v in want.items())
    print(f"{launch_name}: exported adapter vs one process: max abs {worst:.1e}")
    assert worst <= 1e-5, worst
    assert all(v.abs().max() > 1e-4 for k, v in want.items() if ".lora_B." in k)  # trained: B left its zero init
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model("llama")), out / "adapter")
    state = model.state_dict()
    assert {k for k in state if ".lora_" in k} == {k for k in trained if ".lora_" in k}
    assert all(torch.equal(state[k], v) for k, v in trained.items()), "the saved adapter differs from training"
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    batch = {k: torch.stack([s[k] for s in make_samples(n=4, seq_len=24, seed=7)]) for k in ("input_ids",
                                                                                              "attention_mask")}
    one.model.eval()
    with torch.no_grad():
        logits = one.model(**batch).logits
        for name, loaded in (("adapter", model), ("merged", merged)):
            diff = (loaded(**batch).logits - logits).abs().max().item()
            print(f"{launch_name}: {name} export vs one process: logits max abs {diff:.1e}")
            assert diff <= 1e-5, (name, diff)
    assert lora_config().target_modules  # the adapter covered every projection (column- and row-wise)
