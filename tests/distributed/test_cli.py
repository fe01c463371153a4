"""`nd-parallel demo` end to end, and the train YAML's refusals (no launch).

The demo test reads numbers, not exit codes: the table must show the parity it claims. `nd-parallel train`'s
parity matrix is test_train_yaml_parity.py, its real-world Axolotl YAML run test_train_yaml_cli.py.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nd_parallel.cli.main import main
from nd_parallel.cli.ranks import parse_layout
from nd_parallel.cli.train.config import load_train_config
from nd_parallel.config import ConfigError

CLI = [sys.executable, "-m", "nd_parallel.cli"]


def _cli(*args, timeout=300):
    proc = subprocess.run([*CLI, *args], check=False, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def _number(label: str, text: str) -> float:
    match = re.search(rf"^{re.escape(label)}\s+([-+0-9.e]+)", text, re.MULTILINE)
    assert match, f"no '{label}' row in:\n{text}"
    return float(match.group(1))


def test_demo_table_shows_parity():
    out = _cli("demo", "--steps", "4")
    assert _number("max loss rel diff", out) < 1e-5
    assert _number("max param abs diff", out) < 1e-5
    assert _number("max grad-norm rel diff", out) < 1e-5
    losses = re.search(r"^loss per step \(4\)\s+1-4:\s+(.+)$", out, re.MULTILINE).group(1).split()
    assert len(losses) == 4 and float(losses[-1]) < float(losses[0])
    # fsdp2 x tp2 shards every weight 4 ways (norm weights are only split over dp, hence the slack).
    shares = [float(s) for s in re.findall(r"^\s*(?:params \+ AdamW per rank)?\s*rank \d: .*\(([0-9.]+)% of", out,
                                           re.MULTILINE)]
    assert len(shares) == 4 and all(20 < s < 27 for s in shares), out


# --------------------------------------------------------------------------------------- no launch
def _yaml(tmp_path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_unknown_key_suggests_the_closest(tmp_path):
    path = _yaml(tmp_path, "base_model: m\ndataset_path: d.txt\nlerning_rate: 1.0e-3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'lerning_rate' in .*cfg.yaml; did you mean 'learning_rate'"):
        load_train_config(path)
    path = _yaml(tmp_path, "base_model: m\ndataset_path: d.txt\ntensor_paralel_size: 2\n")
    with pytest.raises(ConfigError, match="did you mean 'tensor_parallel_size'"):
        load_train_config(path)


def test_missing_base_model(tmp_path):
    path = _yaml(tmp_path, "dataset_path: d.txt\nmax_steps: 3\n")
    with pytest.raises(ConfigError, match=r"cfg.yaml: 1 setting\(s\) cannot be used by nd-parallel train:\n  - "
                                          r"base_model is required"):
        load_train_config(path)


@pytest.mark.parametrize("text,match", [("- base_model\n- m\n", "is a list; expected a mapping"),
                                        ("", "is empty; expected a mapping"),
                                        ("base_model: [m\n", "malformed YAML")])
def test_non_mapping_or_malformed_yaml(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_train_config(_yaml(tmp_path, text))


def test_python_tag_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    path = _yaml(tmp_path, f"base_model: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match=r"cfg.yaml, line 1, column \d+: refusing the tag !!python/object/apply"
                                          r".*remove the tag"):
        load_train_config(path)
    assert not marker.exists()


def test_bad_values_and_cli_exit_code(tmp_path, capsys):
    path = _yaml(tmp_path, "base_model: m\ndataset_path: d.txt\nmicro_batch_size: 0\n")
    with pytest.raises(ConfigError, match="micro_batch_size=0 must be an integer >= 1"):
        load_train_config(path)
    path = _yaml(tmp_path, "base_model: m\ndataset_path: d.txt\ntp_size: 3\ndp_shard_size: two\n")
    with pytest.raises(ConfigError, match="dp_shard_size='two'"):
        load_train_config(path)
    path = _yaml(tmp_path, "base_model: m\nmax_steps: 3\n")
    assert main(["train", str(path)]) == 2
    assert "datasets" in capsys.readouterr().err


def test_layout_names():
    assert parse_layout("fsdp2_tp2") == {"dp_shard_size": 2, "tp_size": 2}
    assert parse_layout("hsdp2x2_tp2") == {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}
    assert parse_layout("ddp2") == {"dp_replicate_size": 2}
    assert parse_layout("fsdp_tp2") == {"dp_shard_size": -1, "tp_size": 2}
    with pytest.raises(ConfigError, match="cannot read 'zero3'"):
        parse_layout("zero3_tp2")


def test_adopt_launcher_env_hands_the_layout_to_nd_parallel():
    from nd_parallel.accelerate.launcher_env import adopt_launcher_env

    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
           "WORLD_SIZE": "4", "PARALLELISM_CONFIG_TP_SIZE": "2"}
    adopt_launcher_env(env)
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in env and env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false"
    assert env["PARALLELISM_CONFIG_TP_SIZE"] == "2"
    if not torch.cuda.is_available():
        assert env["ACCELERATE_USE_CPU"] == "true"


@pytest.mark.parametrize("text,match", [("bf16: maybe\n", "bf16='maybe'; use true, false or auto"),
                                        ("gradient_checkpointing: full\n", "gradient_checkpointing='full'")])
def test_train_yaml_precision_keys_refused(tmp_path, text, match):
    path = _yaml(tmp_path, "base_model: m\ndataset_path: d.txt\n" + text)
    with pytest.raises(ConfigError, match=match):
        load_train_config(path)
