"""Unit tests for nd_parallel.config's readers (dict, YAML, environment): single process, no torch.distributed."""

from __future__ import annotations

import pathlib

import pytest

from nd_parallel.config import PARALLEL_KEYS, ParallelismConfig

# ------------------------------------------------------------------ from_dict

def test_from_dict_with_axolotl_keys():
    c = ParallelismConfig.from_dict({"tensor_parallel_size": 2, "context_parallel_size": 2,
                                     "pipeline_parallel_size": 2, "dp_shard_size": 2,
                                     "dp_replicate_size": 1})
    assert (c.tp_size, c.cp_size, c.pp_size, c.dp_shard_size) == (2, 2, 2, 2)
    assert {"tensor_parallel_size", "context_parallel_size", "pipeline_parallel_size",
            "tp_size", "cp_backend"} <= PARALLEL_KEYS


def test_from_dict_null_sizes_follow_axolotl():
    c = ParallelismConfig.from_dict({"dp_shard_size": None, "tensor_parallel_size": None})
    assert c.dp_shard_size == -1 and c.tp_size == 1


def test_alias_conflict():
    with pytest.raises(ValueError) as e:
        ParallelismConfig.from_dict({"tp_size": 2, "tensor_parallel_size": 4})
    msg = str(e.value)
    assert "tp_size=2" in msg and "tensor_parallel_size=4" in msg and "keep only one" in msg
    same = ParallelismConfig.from_dict({"tp_size": 2, "tensor_parallel_size": 2})
    assert same.tp_size == 2


def test_unknown_key():
    with pytest.raises(ValueError) as e:
        ParallelismConfig.from_dict({"tp_sise": 2})
    assert str(e.value) == "unknown key 'tp_sise' in config; did you mean 'tp_size'?"
    with pytest.raises(ValueError) as e:
        ParallelismConfig.from_dict({"learning_rate": 1e-4}, source="train.yaml")
    msg = str(e.value)
    assert "'learning_rate' in train.yaml" in msg and "valid keys are" in msg and "'tp_size'" in msg


def test_from_dict_refuses_non_mapping_and_names_source():
    with pytest.raises(TypeError, match=r"config must be a mapping .* got a list"):
        ParallelismConfig.from_dict([("tp_size", 2)])
    with pytest.raises(ValueError, match=r"^in my.yaml: tp_size=0 must be a positive integer"):
        ParallelismConfig.from_dict({"tp_size": 0}, source="my.yaml")


def test_merge_follows_precedence():
    env = {"tp_size": 2, "cp_size": 2}
    yaml_layer = {"tensor_parallel_size": 4, "pp_size": 2}
    cli = {"pp_size": 1}
    c = ParallelismConfig.merge(env, yaml_layer, cli)
    assert (c.tp_size, c.cp_size, c.pp_size) == (4, 2, 1)


# ------------------------------------------------------------------ from_yaml

def test_from_yaml_file_and_text(tmp_path):
    path = tmp_path / "par.yaml"
    path.write_text("tensor_parallel_size: 2\ndp_shard_size: -1\npp_balance: [1, 2]\n"
                    "pp_size: 2\ncp_load_balance: false\n")
    for arg in (path, str(path)):
        c = ParallelismConfig.from_yaml(arg)
        assert (c.tp_size, c.dp_shard_size, c.pp_balance) == (2, -1, [1, 2])
        assert c.cp_load_balance is False
    assert ParallelismConfig.from_yaml("tp_size: 2\ncp_size: 2\n").cp_size == 2
    assert ParallelismConfig.from_yaml("{pp_size: 2, pp_schedule: gpipe}").pp_schedule == "gpipe"


def test_from_yaml_errors_name_the_file(tmp_path):
    path = tmp_path / "bad_value.yaml"
    path.write_text("tp_size: '2'\n")
    with pytest.raises(ValueError) as e:
        ParallelismConfig.from_yaml(path)
    assert str(path) in str(e.value) and "write tp_size=2" in str(e.value)
    with pytest.raises(ValueError, match=r"config file 'missing.yaml' does not exist"):
        ParallelismConfig.from_yaml("missing.yaml")


def test_malformed_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("tp_size: 2\npp_balance: [1, 2\ncp_size: 1\n")
    with pytest.raises(ValueError) as e:
        ParallelismConfig.from_yaml(path)
    msg = str(e.value)
    assert str(path) in msg and "malformed YAML" in msg and "line " in msg
    with pytest.raises(ValueError, match=r"YAML text, line 2, column \d+: malformed YAML"):
        ParallelismConfig.from_yaml("tp_size: 2\n  cp_size: 2\n")


def test_yaml_tags_are_refused_and_not_run(tmp_path, capfd):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.yaml"
    path.write_text(f'!!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(ValueError) as e:
        ParallelismConfig.from_yaml(path)
    msg = str(e.value)
    assert str(path) in msg and "refusing the tag !!python/object/apply:os.system" in msg
    assert "only plain YAML values are allowed" in msg
    assert not marker.exists()
    with pytest.raises(ValueError, match="refusing the tag"):
        ParallelismConfig.from_yaml('tp_size: !!python/object/apply:os.system ["echo hi"]\n')
    assert "hi" not in capfd.readouterr().out


def test_yaml_top_level_not_a_mapping(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("- tp_size: 2\n")
    with pytest.raises(ValueError) as e:
        ParallelismConfig.from_yaml(path)
    assert f"top level of {path} is a list, expected a mapping of keys such as tp_size: 2" \
        == str(e.value)


def test_empty_yaml_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert ParallelismConfig.from_yaml(path) == ParallelismConfig()
    path.write_text("# only a comment\n")
    assert ParallelismConfig.from_yaml(pathlib.Path(path)) == ParallelismConfig()


# ------------------------------------------------------------------ from_env

def _accelerate_env(**overrides: str) -> dict[str, str]:
    """The variables `accelerate launch --use_parallelism_config ...` sets (accelerate 1.x)."""
    env = {
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": "4",
        "PARALLELISM_CONFIG_TP_SIZE": "2",
        "PARALLELISM_CONFIG_CP_SIZE": "1",
        "PARALLELISM_CONFIG_CP_BACKEND": "torch",
        "PARALLELISM_CONFIG_SP_SIZE": "1",
        "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed",
        "PATH": "/usr/bin",
    }
    env.update(overrides)
    return env


def test_from_env_accelerate_defaults_keep_ring():
    c = ParallelismConfig.from_env(_accelerate_env())
    assert (c.dp_replicate_size, c.dp_shard_size, c.tp_size, c.cp_size) == (1, 4, 2, 1)
    assert c.cp_backend == "ring"  # accelerate always writes CP_BACKEND=torch; cp is off here


def test_from_env_accelerate_with_cp():
    env = _accelerate_env(PARALLELISM_CONFIG_CP_SIZE="2",
                          PARALLELISM_CONFIG_CP_COMM_STRATEGY="allgather")
    c = ParallelismConfig.from_env(env)
    # accelerate's launcher writes CP_BACKEND=torch whatever the user chose: keep ring, which runs everywhere
    assert c.cp_size == 2 and c.cp_backend == "ring"
    env["PARALLELISM_CONFIG_CP_BACKEND"] = "ulysses"
    assert ParallelismConfig.from_env(env).cp_backend == "ulysses"


def test_from_env_our_pipeline_variables():
    c = ParallelismConfig.from_env({
        "PARALLELISM_CONFIG_PP_SIZE": "2",
        "PARALLELISM_CONFIG_PP_SCHEDULE": "interleaved-1f1b",
        "PARALLELISM_CONFIG_PP_VIRTUAL_STAGES": "2",
        "PARALLELISM_CONFIG_PP_MICROBATCHES": "8",
        "PARALLELISM_CONFIG_PP_BACKEND": "torch",
        "PARALLELISM_CONFIG_PP_BALANCE": "3, 1,2,2",
        "PARALLELISM_CONFIG_CP_LOAD_BALANCE": "False",
    })
    assert (c.pp_size, c.pp_schedule, c.pp_virtual_stages, c.microbatches) == \
        (2, "interleaved-1f1b", 2, 8)
    assert c.pp_balance == [3, 1, 2, 2] and c.cp_load_balance is False
    named = ParallelismConfig.from_env({"PARALLELISM_CONFIG_PP_BALANCE": "profile"})
    assert named.pp_balance == "profile"


def test_from_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    assert ParallelismConfig.from_env().tp_size == 2
    assert ParallelismConfig.env_overrides() == {"tp_size": 2}


def test_from_env_bad_values():
    with pytest.raises(ValueError) as e:
        ParallelismConfig.from_env({"PARALLELISM_CONFIG_TP_SIZE": "two"})
    assert "PARALLELISM_CONFIG_TP_SIZE='two' is not an integer" in str(e.value)
    assert "PARALLELISM_CONFIG_TP_SIZE=2" in str(e.value)
    with pytest.raises(ValueError, match=r"LOAD_BALANCE='maybe' is not a boolean; use true/false"):
        ParallelismConfig.from_env({"PARALLELISM_CONFIG_CP_LOAD_BALANCE": "maybe"})
    with pytest.raises(ValueError, match=r"PP_BALANCE='4;4' is neither a balance name"):
        ParallelismConfig.from_env({"PARALLELISM_CONFIG_PP_BALANCE": "4;4"})
    with pytest.raises(ValueError, match=r"tp_size=0 must be a positive integer"):
        ParallelismConfig.from_env({"PARALLELISM_CONFIG_TP_SIZE": "0"})


def test_from_env_unknown_variable():
    with pytest.raises(ValueError) as e:
        ParallelismConfig.from_env({"PARALLELISM_CONFIG_TP_SISE": "2"})
    msg = str(e.value)
    assert "unknown environment variable PARALLELISM_CONFIG_TP_SISE" in msg
    assert "did you mean 'PARALLELISM_CONFIG_TP_SIZE'?" in msg


def test_from_env_refuses_accelerate_sp():
    env = _accelerate_env(PARALLELISM_CONFIG_SP_SIZE="2", PARALLELISM_CONFIG_SP_SEQ_LENGTH="None",
                          PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE="True",
                          PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION="sdpa")
    with pytest.raises(ValueError) as e:
        ParallelismConfig.from_env(env)
    msg = str(e.value)
    assert "PARALLELISM_CONFIG_SP_SIZE=2" in msg and "DeepSpeed Ulysses" in msg
    assert "use cp_size with cp_backend='ulysses'" in msg
