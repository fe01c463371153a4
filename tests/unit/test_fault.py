"""Single-process tests of the fault-tolerance pieces: config validation, where a thread stands, the hang report's
wording, agreement diffs, the non-finite guard, the preemption flag, the process tree (nd_parallel/fault/)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from nd_parallel.config import ConfigError, ParallelismConfig
from nd_parallel.fault import agreement, proctree
from nd_parallel.fault.nonfinite import NonFiniteError, NonFiniteGuard, check_state_finite
from nd_parallel.fault.signals import PreemptionFlag, _ShieldedInit, shield_workers
from nd_parallel.fault.watchdog import _missing, beat_for, resolve_timeout
from nd_parallel.fault.where import Position, position_of


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("kwargs,expected", [
    (dict(hang_timeout=2), "hang_timeout=2 must be 0 (off) or at least 5 seconds"),
    (dict(hang_timeout="10"), "hang_timeout='10' is a str"),
    (dict(hang_timeout=True), "hang_timeout=True is a bool"),
    (dict(skip_nonfinite_steps=-1), "skip_nonfinite_steps=-1 must be a whole number >= 0"),
    (dict(skip_nonfinite_steps=1.5), "skip_nonfinite_steps=1.5 must be a whole number"),
    (dict(save_on_signal="yes"), "save_on_signal='yes' is a str; write True or False"),
    (dict(async_save=1), "async_save=1 is an int; write True or False"),
])
def test_fault_options_are_validated(kwargs, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        ParallelismConfig(**kwargs)


def test_fault_options_from_yaml_keys():
    c = ParallelismConfig.from_dict({"hang_timeout": 30, "save_on_signal": True, "skip_nonfinite_steps": 2,
                                     "async_save": True})
    assert (c.hang_timeout, c.save_on_signal, c.skip_nonfinite_steps, c.async_save) == (30, True, 2, True)
    assert "hang_timeout=30" in c.describe()


def test_default_hang_timeout_follows_the_backend():
    assert resolve_timeout(None, "cuda") == 600 and resolve_timeout(None, "cpu") == 1800
    assert resolve_timeout(0, "cuda") == 0 and resolve_timeout(12, "cpu") == 12
    assert beat_for(10) == 0.5 and beat_for(600) == 5.0 and beat_for(5) == 0.25


# ------------------------------------------------------------------------------------------------- where
def _blocked_in_collective(event):
    group = "pg-name"  # noqa: F841 (read from this frame by position_of, as a functional collective's group)
    event.wait()


def test_position_names_the_caller_and_a_busy_thread():
    done = threading.Event()
    t = threading.Thread(target=_blocked_in_collective, args=(done,))
    t.start()
    time.sleep(0.1)
    try:
        pos = position_of(t.ident, {"pg-name": "dp_shard"})
    finally:
        done.set()
        t.join()
    # threading's wait is not a torch.distributed frame: outside any collective, in our function
    assert pos.collective == "" and "_blocked_in_collective" in pos.caller
    assert pos.describe().startswith("outside any collective, in test_fault.py:")


def test_report_names_stopped_busy_and_elsewhere_ranks():
    me = Position("all_gather_single", "dp_shard", (0, 1, 2, 3), "train.py:10 step", ("k",))
    where = me.describe()
    first = {1: {"beat": 5, "step": 7, "where": where, "in": True},
             2: {"beat": 5, "step": 7, "where": "outside any collective, in loop.py:3 spin", "in": False},
             3: {"beat": 5, "step": 7, "where": "in all_reduce over world (called from x.py:1 f)", "in": True}}
    second = {1: dict(first[1]), 2: dict(first[2], beat=8), 3: dict(first[3], beat=8)}
    missing, stopped = _missing(0, me, first, second, 1.5)
    assert stopped == [1]
    assert missing[0].startswith("rank 1 (no heartbeat over the last 1.5 s: stopped or dead")
    assert "rank 2 (alive, step 7, outside any collective, in loop.py:3 spin: busy" in missing[1]
    assert "rank 3 (step 7, waits in all_reduce over world" in missing[2] and "only some ranks call" in missing[2]
    # a peer waiting in the same collective is not missing
    second[3] = dict(first[3], beat=8, where=where)
    assert len(_missing(0, me, first, second, 1.5)[0]) == 2


# --------------------------------------------------------------------------------------------- agreement
def test_agreement_diff_names_the_first_difference():
    a = {"num_hidden_layers": 2, "hidden_size": 64, "rope": {"theta": 1e4}}
    b = {"num_hidden_layers": 4, "hidden_size": 64, "rope": {"theta": 1e4}}
    assert agreement._diff(a, b) == "num_hidden_layers: 2 vs 4"
    assert agreement._diff({"rope": {"theta": 1}}, {"rope": {"theta": 2}}) == "rope.theta: 1 vs 2"
    assert "only in the first ['lm_head.weight(8, 4)']" in agreement._diff([["a(1,)", "lm_head.weight(8, 4)"]],
                                                                           [["a(1,)"]])


def test_agreement_fields_cover_config_model_trainable_loader_versions():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.model.embed_tokens.weight.requires_grad_(False)
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=3)
    fields = agreement.fields_of(ParallelismConfig(tp_size=2), [model, loader])
    assert set(fields) == {"parallelism config", "model config", "trainable parameters", "dataloader length",
                           "versions"}
    assert fields["parallelism config"]["tp_size"] == 2 and fields["dataloader length"] == [4]
    assert fields["model config"][0]["num_hidden_layers"] == 1
    assert not any(n.startswith("model.embed_tokens") for n in fields["trainable parameters"][0])
    assert set(fields["versions"]) == {"nd_parallel", "torch", "transformers"}
    json.dumps(fields)  # plain data: it is hashed and, on a mismatch, gathered


# --------------------------------------------------------------------------------------------- non-finite
def _guard(skip, grads):
    return NonFiniteGuard(skip, lambda: grads, distributed=False)


def test_guard_stops_naming_step_and_parameter():
    grads = [("a.weight", torch.ones(3)), ("b.weight", torch.tensor([1.0, float("inf")]))]
    guard = _guard(0, grads)
    guard.observe_loss(torch.tensor(2.0))
    guard.check(4, torch.tensor(1.0))  # finite: nothing happens
    guard.observe_loss(torch.tensor(2.0))
    with pytest.raises(NonFiniteError, match=r"optimizer step 6 \(loss=2.0, grad norm=inf\); first non-finite "
                                             r"gradient on rank 0 in b.weight"):
        guard.check(5, torch.tensor(float("inf")))


def test_guard_skips_up_to_n_then_stops():
    guard = _guard(2, [("w", torch.tensor([float("nan")]))])
    for step in (0, 1):
        guard.observe_loss(torch.tensor(float("nan")))
        guard.check(step, None)
        assert guard.skip_next_step
        guard.skip_next_step = False
    assert guard.skipped == 2
    guard.observe_loss(torch.tensor(float("nan")))
    with pytest.raises(NonFiniteError, match="loss=nan"):
        guard.check(2, None)


def test_a_loss_nan_with_finite_gradients_points_at_the_forward():
    guard = _guard(0, [("w", torch.ones(2))])
    guard.observe_loss(torch.tensor(float("nan")))
    with pytest.raises(NonFiniteError, match="every gradient is finite: the forward pass produced it"):
        guard.check(0, None)


def test_checkpoint_state_with_nan_is_refused():
    check_state_finite([("w", torch.ones(2)), ("step", torch.tensor(3))], distributed=False, step=3)
    with pytest.raises(NonFiniteError, match="refusing to save a checkpoint at step 3: rank 0 holds a non-finite "
                                             "value in optimizer 0 exp_avg of w"):
        check_state_finite([("w", torch.ones(2)), ("optimizer 0 exp_avg of w", torch.tensor([0.0, float("nan")]))],
                           distributed=False, step=3)


# ------------------------------------------------------------------------------------------------ signals
def test_checkpoint_check_reads_quantized_optimizer_states():
    """optimizer: adamw_torch_8bit (torchao) keeps its moments as OptimState8bit, which has no isfinite: the check
    dequantizes them instead of crashing at the first save (Axolotl's examples/alst YAMLs)."""
    subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")
    state = subclass_8bit.OptimState8bit.zeros((512,), signed=True, block_size=256, device="cpu")
    check_state_finite([("optimizer 0 exp_avg of w", state)], distributed=False, step=2)
    state.copy_(torch.full((512,), float("nan")))
    with pytest.raises(NonFiniteError, match="exp_avg of w"):
        check_state_finite([("optimizer 0 exp_avg of w", state)], distributed=False, step=2)


def test_preemption_flag_sets_on_signal_and_agrees_without_a_group():
    flag = PreemptionFlag().install()
    try:
        assert not flag.agreed(torch.device("cpu"), distributed=False)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert flag.received == signal.SIGTERM
        assert flag.agreed(torch.device("cpu"), distributed=False)
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_dataloader_workers_ignore_the_preemption_signal():
    loader = torch.utils.data.DataLoader(list(range(100)), batch_size=1, num_workers=1)
    shield_workers(loader)
    assert isinstance(loader.worker_init_fn, _ShieldedInit)
    it = iter(loader)
    next(it)
    worker = it._workers[0]
    os.kill(worker.pid, signal.SIGTERM)  # what torchrun's killpg of the rank's group does to it
    time.sleep(0.5)
    assert worker.is_alive()
    del it


# ------------------------------------------------------------------------------------------- process tree
def test_process_tree_with_and_without_psutil(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import subprocess,sys,time; "
                              "subprocess.Popen([sys.executable,'-c','import time; time.sleep(30)']); time.sleep(30)"])
    try:
        deadline = time.time() + 10
        while len(proctree.descendants(os.getpid())) < 2 and time.time() < deadline:
            time.sleep(0.05)
        with_psutil = proctree.descendants(child.pid)
        monkeypatch.setitem(sys.modules, "psutil", None)  # the /proc fallback
        assert proctree.descendants(child.pid) == with_psutil and len(with_psutil) == 1
        grandchild = with_psutil.pop()
        assert proctree.alive(grandchild)
        proctree.kill_all([grandchild, child.pid])
        child.wait()
        deadline = time.time() + 5
        while proctree.alive(grandchild) and time.time() < deadline:
            time.sleep(0.05)
        assert not proctree.alive(grandchild)
    finally:
        child.kill()


# ---------------------------------------------------------------------------------------- train YAML keys
def test_train_yaml_takes_the_fault_keys_also_with_layout_auto(tmp_path):
    from nd_parallel.cli.train.config import load_train_config

    (tmp_path / "d.jsonl").write_text('{"text": "a b c"}\n')
    base = (f"base_model: {tmp_path}\ndatasets:\n  - path: {tmp_path / 'd.jsonl'}\n    type: completion\n"
            "hang_timeout: 30\nsave_on_signal: true\nskip_nonfinite_steps: 2\nasync_save: true\n"
            "resume_from_checkpoint: auto\n")
    for extra in ("dp_shard_size: 2\n", "layout: auto\n"):
        path = tmp_path / "cfg.yml"
        path.write_text(base + extra)
        cfg = load_train_config(path)
        p = cfg.parallel
        assert (p.hang_timeout, p.save_on_signal, p.skip_nonfinite_steps, p.async_save) == (30, True, 2, True)
        assert cfg.resume_from_checkpoint == "auto"


def test_resume_auto_takes_the_latest_complete_checkpoint(tmp_path):
    from nd_parallel.fault.resume import account, choose, complete_checkpoints

    for step, parts in ((2, ("state", "trainer")), (4, ("state", "trainer")), (6, ("state",)), (8, ())):
        d = tmp_path / f"checkpoint-{step}"
        (d / "nd_parallel").mkdir(parents=True)
        if "state" in parts:
            (d / "nd_parallel" / "nd_parallel.json").write_text("{}")
        if "trainer" in parts:
            (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]
    assert choose("auto", tmp_path, restart=0).endswith("checkpoint-4")
    assert choose("/some/path", tmp_path, restart=0) == "/some/path"
    assert choose("/some/path", tmp_path, restart=1).endswith("checkpoint-4")  # a restart takes the newest
    assert choose("auto", tmp_path / "empty", restart=0) is None  # nothing yet: a fresh start
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8)))
    note = account(str(tmp_path / "checkpoint-4"), log, restart=1)
    assert note.endswith("restart 1: resuming from checkpoint-4 (step 4); the interrupted run had logged step 7: "
                         "3 steps lost")
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2, 3, 4]


def test_a_store_that_stops_answering_is_reported_by_a_waiting_rank(monkeypatch):
    """Several nodes: each attempt's store is served by rank 0's process, so a stopped rank 0 silences every
    heartbeat. A rank waiting in a collective for the threshold then reports that and ends (watchdog.py)."""
    from nd_parallel.fault import watchdog as wd

    class Store:  # rank 1's view; rank 0 never beats here, so no record of it exists (and nothing is killed)
        fail, data = False, {}

        def _up(self):
            if self.fail:
                raise RuntimeError("Wait timeout")

        def set(self, key, value):
            self._up()
            self.data[key] = value

        def check(self, keys):
            self._up()
            return all(k in self.data for k in keys)

        def multi_get(self, keys):
            self._up()
            return [self.data[k] for k in keys]

    monkeypatch.setattr(wd.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(wd.dist, "get_world_size", lambda: 2)
    waiting = Position("all_reduce", "dp_replicate", (0, 1), "loss.py:92 global_mean", ("k",))
    monkeypatch.setattr(wd, "position_of", lambda ident, names: waiting)
    exits, store = [], Store()
    dog = wd.Watchdog(5, {}, store=store, exit_fn=exits.append)
    dog.step = 41
    dog.start()
    store.fail = True
    deadline = time.time() + 15
    while not exits and time.time() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert exits == [1]
    assert dog.report.startswith("[nd_parallel] hang: rank 1 at step 41 waits in all_reduce over dp_replicate")
    assert "the store has not answered for" in dog.report and "(RuntimeError)" in dog.report
    assert "rank 0, or torchrun's agent on the first node) is stopped or dead" in dog.report


def test_a_stopped_rank_outside_the_waited_group_is_named_as_the_root():
    """HSDP: rank 1 waits over dp_replicate with rank 3, which waits over dp_shard for rank 2, which is stopped.
    Rank 1's report names rank 3 where it waits and rank 2 as stopped, and rank 2 is the one to kill."""
    me = Position("all_reduce", "dp_replicate", (1, 3), "plugin.py:298 backward", ("k",))
    first = {0: {"beat": 4, "step": 63, "where": "in all_reduce over world (called from x.py:1 f)", "in": True},
             2: {"beat": 4, "step": 63, "where": "outside any collective, in model.py:9 forward", "in": False},
             3: {"beat": 4, "step": 63, "where": "in all_gather_single over dp_shard (called from fsdp)", "in": True}}
    second = {0: dict(first[0], beat=7), 2: dict(first[2]), 3: dict(first[3], beat=7)}
    missing, stopped = _missing(1, me, first, second, 1.5)
    assert stopped == [2]
    assert missing[0].startswith("rank 3 (step 63, waits in all_gather_single over dp_shard")
    assert missing[0].endswith("perhaps on a stopped rank, or a collective only some ranks call)")
    assert missing[1].startswith("rank 2 (no heartbeat over the last 1.5 s: stopped or dead")
    assert len(missing) == 2  # rank 0 beats and is outside the group: not named
