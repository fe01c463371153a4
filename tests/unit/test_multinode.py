"""Several nodes and the chaos harness, without processes: `nd-parallel train --nnodes` refuses bad input in the parent
before any rank starts, the torchrun arguments each node gets, trainer_callbacks, the restart note, the agreed
resume choice in one process, and the harness's own checks."""

import json

import pytest

from nd_parallel.cli.main import main
from nd_parallel.cli.train.config import load_train_config
from nd_parallel.config import ConfigError
from nd_parallel.fault.launch import Nodes
from nd_parallel.fault.resume import account, agreed
from nd_parallel.testing.chaos import ChaosRun, Fault
from tests.distributed.train_yaml_helpers import write_model_and_data, write_yaml


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_model_and_data(tmp_path_factory.mktemp("multinode"), n=16)


def _cfg(tmp_path, data, **extra):
    return write_yaml(tmp_path / "cfg.yml", {"base_model": data["model"], "datasets": [{"path": data["text"],
                      "type": "completion"}], "sequence_len": 32, "output_dir": str(tmp_path / "out"), **extra})


@pytest.mark.parametrize("flags, needle", [
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--rdzv-endpoint", "127.0.0.1:29400"], "--rdzv-endpoint 127.0.0.1:29400 without --nnodes"),
    (["--nnodes", "2", "--rdzv-endpoint", "node001"], "rdzv_endpoint='node001': write HOST:PORT"),
    (["--nnodes", "3", "--rdzv-endpoint", "127.0.0.1:29400"], "2 ranks do not split over --nnodes 3"),
])
def test_nnodes_bad_input_stops_in_the_parent(tmp_path, data, capsys, flags, needle):
    path = _cfg(tmp_path, data, dp_shard_size=2)
    assert main(["train", str(path), "--cpu", *flags]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # no rank started


def test_nnodes_zero_is_refused_by_the_parser(tmp_path, data, capsys):
    with pytest.raises(SystemExit):
        main(["train", str(_cfg(tmp_path, data)), "--nnodes", "0"])
    assert "'0' is not a whole number >= 1" in capsys.readouterr().err


def test_nodes_torchrun_arguments():
    nodes = Nodes(2, "head:29400", "job7", "keep_alive_interval=1")
    assert nodes.torchrun_args() == ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=head:29400",
                                     "--rdzv-id=job7", "--rdzv-conf=keep_alive_interval=1"]
    assert Nodes.ENV == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a fresh store for every attempt
    with pytest.raises(ValueError, match="at least 2 nodes"):
        Nodes(1, "head:29400")


def test_trainer_callbacks_key(tmp_path, data):
    cfg = load_train_config(_cfg(tmp_path, data, trainer_callbacks=[
        "transformers:PrinterCallback",
        {"class": "nd_parallel.testing.chaos_inject:ChaosInjector", "args": {"dir": str(tmp_path)}}]))
    assert cfg.trainer_callbacks == [{"class": "transformers:PrinterCallback", "args": {}},
                                     {"class": "nd_parallel.testing.chaos_inject:ChaosInjector",
                                      "args": {"dir": str(tmp_path)}}]
    from nd_parallel.cli.train.callbacks import user_callbacks

    built = user_callbacks(cfg.trainer_callbacks)
    assert [type(c).__name__ for c in built] == ["PrinterCallback", "ChaosInjector"]


@pytest.mark.parametrize("value, needle", [
    ("transformers:PrinterCallback", "write a list"),
    (["no_such_module:X"], "cannot import 'no_such_module:X'"),
    (["json:dumps"], "'json:dumps' is not a transformers.TrainerCallback class"),
    ([{"class": "transformers:PrinterCallback", "kwargs": {}}], "write 'module:Class' or"),
])
def test_trainer_callbacks_refused(tmp_path, data, value, needle):
    with pytest.raises(ConfigError, match="trainer_callbacks") as err:
        load_train_config(_cfg(tmp_path, data, trainer_callbacks=value))
    assert needle in str(err.value)


def test_restart_note_without_a_checkpoint(tmp_path):
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 4)))
    note = account(None, log, restart=2)
    assert note == ("[nd_parallel] restart 2: no complete checkpoint yet, starting again (step 0); the interrupted "
                    "run had logged step 3: 3 steps lost")
    assert log.read_text() == ""  # the new attempt logs from step 1 again
    assert account(None, tmp_path / "none.jsonl", restart=1).endswith("logged step 0: 0 steps lost")  # died early
    assert account(None, log, restart=0) is None  # a fresh start is no restart


def test_agreed_in_one_process_is_choose(tmp_path):
    (tmp_path / "checkpoint-3" / "nd_parallel").mkdir(parents=True)
    (tmp_path / "checkpoint-3" / "nd_parallel" / "nd_parallel.json").write_text("{}")
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    assert agreed("auto", tmp_path, 0) == (str(tmp_path / "checkpoint-3"), 0)
    assert agreed(None, tmp_path, 0) == (None, 0)
    assert agreed(None, tmp_path, 1) == (str(tmp_path / "checkpoint-3"), 1)


def test_chaos_fault_kinds_are_checked(tmp_path):
    with pytest.raises(ValueError, match="'node' needs nnodes >= 2"):
        ChaosRun({}, tmp_path, nproc=2).run([Fault("node")])
    with pytest.raises(ValueError, match="use kill, save, stop, nan, mismatch, node, end"):
        ChaosRun({}, tmp_path, nproc=2).run([Fault("meteor")])
    with pytest.raises(ValueError, match="'end' strikes after the last step: it can only be the last fault"):
        ChaosRun({}, tmp_path, nproc=2).run([Fault("end"), Fault("kill")])
    with pytest.raises(ValueError, match="two mismatches in a row"):
        ChaosRun({}, tmp_path, nproc=2).run([Fault("kill"), Fault("mismatch"), Fault("mismatch")])


def test_axolotls_auto_resume_is_resume_auto(tmp_path, data):
    assert load_train_config(_cfg(tmp_path, data, auto_resume_from_checkpoints=True)).resume_from_checkpoint == "auto"
    assert load_train_config(_cfg(tmp_path, data, auto_resume_from_checkpoints=False)).resume_from_checkpoint is None
    explicit = str(tmp_path / "out" / "checkpoint-4")
    cfg = load_train_config(_cfg(tmp_path, data, auto_resume_from_checkpoints=True, resume_from_checkpoint=explicit))
    assert cfg.resume_from_checkpoint == explicit  # an explicit checkpoint wins, as in Axolotl
    with pytest.raises(ConfigError, match="auto_resume_from_checkpoints='yes'; use true or false"):
        load_train_config(_cfg(tmp_path, data, auto_resume_from_checkpoints="yes"))


def test_nnodes_under_an_outer_launcher_is_refused(tmp_path, data, capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = _cfg(tmp_path, data, dp_shard_size=2)
    assert main(["train", str(path), "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"]) == 2
    assert "--nnodes under an outer launcher" in capsys.readouterr().err
