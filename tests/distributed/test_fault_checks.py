"""Agreement at prepare, non-finite values and async saves in real 2-rank launches (nd_parallel/fault/)."""

import json

from tests.distributed.test_fault_hang import events, run_fault


def test_mismatched_model_fails_on_every_rank_naming_the_field(tiny_models, tmp_path):
    text, evs, _ = run_fault("agreement", tiny_models["llama"], tmp_path, other_model=tiny_models["qwen3"])
    errors = {e["rank"]: e for e in evs if e["event"] == "error"}
    assert sorted(errors) == [0, 1], text[-3000:]
    for rank, e in errors.items():
        took = e["t"] - next(x["t"] for x in evs if x["event"] == "prepare" and x["rank"] == rank)
        print(f"agreement: rank {rank} failed {took:.2f} s into prepare: {e['message']}")
        assert e["type"] == "AgreementError"
        assert "ranks disagree on the model config: ranks 0 vs ranks 1" in e["message"], e["message"]
        assert "LlamaForCausalLM" in e["message"] and "Qwen3ForCausalLM" in e["message"], e["message"]
        assert took < 10


def test_nonfinite_steps_are_skipped_then_stop_and_no_nan_checkpoint(tiny_models, tmp_path):
    from nd_parallel.fault.launch import launch

    opts = {"layout": {"skip_nonfinite_steps": 1}}
    out = launch("tests/distributed/fault_worker.py", 2, ["nonfinite", tiny_models["llama"], str(tmp_path),
                                                        json.dumps(opts)], timeout=180, capture=True)
    evs = events(tmp_path)
    for rank in (0, 1):
        mine = {e.get("step"): e for e in evs if e["rank"] == rank and e["event"] in ("step", "error")}
        assert mine[1]["applied"] and not mine[1]["skipped"]
        assert not mine[2]["applied"] and mine[2]["skipped"], mine[2]  # skipped: the optimizer did not touch a weight
        err = mine[3]  # the second non-finite step: the budget of 1 is spent
        assert err["event"] == "error" and err["type"] == "NonFiniteError", err
        assert "optimizer step 3" in err["message"] and "grad norm=nan" in err["message"]
        assert "rank 1 in model.layers.0.self_attn.q_proj.weight" in err["message"], err["message"]
    assert "step skipped, 0 more may be skipped" in out.stdout


def test_checkpoint_with_nan_is_refused_on_every_rank(tiny_models, tmp_path):
    from nd_parallel.fault.launch import launch

    launch("tests/distributed/fault_worker.py", 2, ["nonfinite", tiny_models["llama"], str(tmp_path),
                                                  json.dumps({"nan_save": True})], timeout=180, capture=True)
    refused = [e for e in events(tmp_path) if e["event"] == "save-refused"]
    assert len(refused) == 2, events(tmp_path)
    for e in refused:
        assert e["type"] == "NonFiniteError" and not e["published"]
        assert "rank 0 holds a non-finite value in model.layers.1.mlp.up_proj.weight" in e["message"], e["message"]


def test_async_save_publishes_in_the_background_and_loads_back(tiny_models, tmp_path):
    from nd_parallel.fault.launch import launch

    launch("tests/distributed/fault_worker.py", 2, ["async", tiny_models["llama"], str(tmp_path),
                                                  json.dumps({"layout": {"async_save": True}})], timeout=180)
    loaded = [e for e in events(tmp_path) if e["event"] == "async-loaded"]
    assert sorted(e["rank"] for e in loaded) == [0, 1] and all(e["equal"] for e in loaded), events(tmp_path)
    assert (tmp_path / "ckpt_async" / "nd_parallel.json").is_file()
    assert not list(tmp_path.glob(".ckpt_async*"))  # nothing incomplete left beside it
