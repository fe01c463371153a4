"""Unit tests for nd_parallel.config (construction, sizes, options): single process, no torch.distributed."""

from __future__ import annotations

import pytest

from nd_parallel.config import AXOLOTL_ALIASES, PARALLEL_KEYS, ParallelismConfig

SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "pp_size")


# ------------------------------------------------------------------ construction and sizes

def test_defaults():
    c = ParallelismConfig()
    assert (c.dp_replicate_size, c.dp_shard_size, c.tp_size, c.cp_size, c.pp_size) == (1,) * 5
    assert c.tp_plan is None and c.pp_schedule == "1f1b" and c.pp_microbatches is None
    assert c.pp_virtual_stages == 1 and c.pp_backend == "torch" and c.pp_balance == "uniform"
    assert c.cp_backend == "ring" and c.cp_load_balance is True
    assert c.world_size == 1 and c.dp_size == 1 and c.microbatches == 1


def test_kwargs_and_derived_sizes():
    c = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2, pp_size=2,
                          pp_microbatches=4)
    assert c.world_size == 16 and c.dp_size == 4 and c.microbatches == 4
    assert c.sizes == {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    assert ParallelismConfig(pp_size=3).microbatches == 3


def test_describe_is_one_line_summary():
    c = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    assert str(c) == "pp=1 dp_replicate=2 dp_shard=2 cp=1 tp=2 (world 8)"
    assert "pp_schedule=gpipe" in ParallelismConfig(pp_size=2, pp_schedule="gpipe").describe()
    assert "(world unresolved)" in str(ParallelismConfig(dp_shard_size=-1))


def test_to_dict_round_trip():
    c = ParallelismConfig(tp_size=2, tp_plan={"lm_head": None}, pp_size=2, pp_balance=[3, 5])
    d = c.to_dict()
    assert d["tp_size"] == 2 and d["tp_plan"] == {"lm_head": None} and d["pp_balance"] == [3, 5]
    assert set(d) == set(PARALLEL_KEYS) - set(AXOLOTL_ALIASES)
    d["pp_balance"].append(1)  # a copy: the config is unchanged
    assert ParallelismConfig.from_dict(c.to_dict()) == c


# ------------------------------------------------------------------ resolve and world size

def test_resolve_fills_dp_shard():
    c = ParallelismConfig(tp_size=2, dp_shard_size=-1)
    r = c.resolve(8)
    assert r.dp_shard_size == 4 and r.world_size == 8 and r.dp_size == 4
    assert c.dp_shard_size == -1  # resolve returns a copy


def test_unresolved_sizes_ask_for_resolve():
    c = ParallelismConfig(dp_shard_size=-1)
    for attr in ("world_size", "dp_size"):
        with pytest.raises(ValueError, match=r"dp_shard_size=-1.*resolve\(world_size\)"):
            getattr(c, attr)


def test_resolve_not_dividing():
    with pytest.raises(ValueError) as e:
        ParallelismConfig(tp_size=4, dp_shard_size=-1).resolve(6)
    msg = str(e.value)
    assert "world size 6" in msg and "tp_size(4)" in msg and "= 4" in msg
    assert "divides 6" in msg


def test_resolve_product_mismatch_shows_equation():
    c = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    with pytest.raises(ValueError) as e:
        c.resolve(4)
    msg = str(e.value)
    equation = "pp_size(1) * dp_replicate_size(2) * dp_shard_size(2) * cp_size(1) * tp_size(2)"
    assert f"{equation} = 8" in msg
    assert "the world size is 4" in msg and "product is 4" in msg
    assert "dp_shard_size=1" in msg  # a concrete fix


def test_resolve_keeps_explicit_sizes_and_rejects_bad_world():
    assert ParallelismConfig(tp_size=2).resolve(2) == ParallelismConfig(tp_size=2)
    with pytest.raises(ValueError, match=r"world_size=0 must be a positive integer"):
        ParallelismConfig().resolve(0)


# ------------------------------------------------------------------ bad sizes

@pytest.mark.parametrize("name", SIZES)
def test_zero_and_negative_sizes(name):
    with pytest.raises(ValueError) as e:
        ParallelismConfig(**{name: 0})
    assert f"{name}=0 must be a positive integer" in str(e.value)
    assert f"{name}=1" in str(e.value)
    with pytest.raises(ValueError, match=rf"{name}=-3 must be a positive integer.*use {name}=1"):
        ParallelismConfig(**{name: -3})


@pytest.mark.parametrize("name", ["tp_size", "cp_size", "pp_size", "dp_replicate_size"])
def test_minus_one_only_for_dp_shard(name):
    with pytest.raises(ValueError) as e:
        ParallelismConfig(**{name: -1})
    msg = str(e.value)
    assert f"{name}=-1 is not allowed" in msg and "only dp_shard_size may be -1" in msg
    assert f"{name}=1" in msg


@pytest.mark.parametrize("value, shown, fix", [
    (2.0, "tp_size=2.0 is a float", "write tp_size=2"),
    ("2", "tp_size='2' is a str", "write tp_size=2"),
    (True, "tp_size=True is a bool", "write tp_size=1"),
    (2.5, "tp_size=2.5 is a float", "tp_size=1 to disable tensor parallelism"),
    ("two", "tp_size='two' is a str", "tp_size=1"),
    (None, "tp_size=None is a NoneType", "tp_size=1"),
])
def test_size_of_wrong_type(value, shown, fix):
    with pytest.raises(ValueError) as e:  # also a TypeError, for callers that catch that
        ParallelismConfig(tp_size=value)
    assert isinstance(e.value, TypeError)
    assert shown in str(e.value) and "sizes must be integers" in str(e.value)
    assert fix in str(e.value)


def test_counts_other_than_sizes():
    with pytest.raises(ValueError, match=r"pp_microbatches=0 must be a positive integer; use "
                                         r"pp_microbatches=None"):
        ParallelismConfig(pp_size=2, pp_microbatches=0)
    with pytest.raises(ValueError, match=r"pp_virtual_stages='2' is a str; pp_virtual_stages "
                                         r"must be an integer, write pp_virtual_stages=2"):
        ParallelismConfig(pp_virtual_stages="2")


# ------------------------------------------------------------------ options

def test_unknown_schedule_suggests_closest():
    with pytest.raises(ValueError) as e:
        ParallelismConfig(pp_size=2, pp_schedule="interleaved-1fb1")
    msg = str(e.value)
    assert "pp_schedule='interleaved-1fb1'" in msg and "did you mean 'interleaved-1f1b'?" in msg
    with pytest.raises(ValueError, match="did you mean 'interleaved-1f1b'"):
        ParallelismConfig(pp_schedule="Interleaved1F1B")


@pytest.mark.parametrize("field, bad, hint", [
    ("cp_backend", "rign", "did you mean 'ring'?"),
    ("pp_backend", "deepspead", "did you mean 'deepspeed'?"),
    ("pp_balance", "uniforn", "did you mean 'uniform'?"),
    ("pp_schedule", "zzz", "'gpipe', '1f1b'"),
])
def test_unknown_options(field, bad, hint):
    with pytest.raises(ValueError) as e:
        ParallelismConfig(**{field: bad})
    assert f"{field}={bad!r}" in str(e.value) and hint in str(e.value)


def test_option_of_wrong_type():
    with pytest.raises(TypeError, match=r"pp_schedule=1 is an int; expected one of 'gpipe'"):
        ParallelismConfig(pp_schedule=1)
    with pytest.raises(ValueError, match=r"cp_load_balance='true' is a str; write True or False"):
        ParallelismConfig(cp_load_balance="true")


def test_interleaved_needs_virtual_stages():
    for schedule in ("interleaved-1f1b", "interleaved-zb"):
        with pytest.raises(ValueError) as e:
            ParallelismConfig(pp_size=2, pp_schedule=schedule)
        msg = str(e.value)
        assert f"pp_schedule='{schedule}'" in msg and "pp_virtual_stages=1" in msg
        assert "set pp_virtual_stages=2" in msg
    ok = ParallelismConfig(pp_size=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=3)
    assert ok.pp_virtual_stages == 3


def test_zbv_needs_exactly_two_stages():
    with pytest.raises(ValueError) as e:
        ParallelismConfig(pp_size=2, pp_schedule="zbv", pp_virtual_stages=3)
    assert "pp_virtual_stages=3" in str(e.value) and "set pp_virtual_stages=2" in str(e.value)
    assert ParallelismConfig(pp_size=2, pp_schedule="zbv", pp_virtual_stages=2).pp_size == 2


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_single_stage_schedules_refuse_virtual_stages(schedule):
    with pytest.raises(ValueError) as e:
        ParallelismConfig(pp_size=2, pp_schedule=schedule, pp_virtual_stages=2)
    assert "pp_virtual_stages=2" in str(e.value) and "'interleaved-1f1b'" in str(e.value)


@pytest.mark.parametrize("kwargs, shown", [
    ({"tp_size": 2}, "tp_size=2"),
    ({"dp_shard_size": 2}, "dp_shard_size=2"),
    ({"cp_size": 2}, "cp_size=2"),
])
def test_deepspeed_refuses_sharding_tp_cp(kwargs, shown):
    with pytest.raises(ValueError) as e:
        ParallelismConfig(pp_size=2, pp_backend="deepspeed", **kwargs)
    msg = str(e.value)
    assert shown in msg and "ZeRO stage <= 1" in msg
    assert "dp_replicate_size" in msg and "pp_backend='torch'" in msg


def test_deepspeed_schedule_and_late_dp_shard():
    with pytest.raises(ValueError, match=r"own 1F1B-style schedule, so pp_schedule='gpipe'.*"
                                         r"pp_schedule='1f1b'"):
        ParallelismConfig(pp_size=2, pp_backend="deepspeed", pp_schedule="gpipe")
    ok = ParallelismConfig(pp_size=2, dp_replicate_size=2, pp_backend="deepspeed")
    assert ok.world_size == 4
    lazy = ParallelismConfig(pp_size=2, dp_shard_size=-1, pp_backend="deepspeed")
    assert lazy.resolve(2).dp_shard_size == 1
    with pytest.raises(ValueError, match="cannot be combined with dp_shard_size=2"):
        lazy.resolve(4)


def test_pp_balance_list():
    c = ParallelismConfig(pp_size=2, pp_virtual_stages=2, pp_schedule="interleaved-1f1b",
                          pp_balance=(2, 3, 3, 2))
    assert c.pp_balance == [2, 3, 3, 2]
    with pytest.raises(ValueError) as e:
        ParallelismConfig(pp_size=2, pp_balance=[4, 4, 4])
    msg = str(e.value)
    assert "[4, 4, 4] has 3 entries" in msg and "pp_size(2) * pp_virtual_stages(1) = 2" in msg
    with pytest.raises(ValueError, match=r"pp_balance\[1\]=-2 must be a positive number of layers"):
        ParallelismConfig(pp_size=2, pp_balance=[4, -2])
    with pytest.raises(ValueError, match=r"pp_balance\[0\]=0 must be a positive"):
        ParallelismConfig(pp_size=2, pp_balance=[0, 4])
    with pytest.raises(TypeError, match=r"pp_balance\[0\]=2.5 is a float"):
        ParallelismConfig(pp_size=2, pp_balance=[2.5, 4])
    with pytest.raises(TypeError, match=r"pp_balance=4 is an int; use 'uniform', 'profile'"):
        ParallelismConfig(pp_size=2, pp_balance=4)


def test_tp_plan_validation():
    plan = {"layers.*.mlp.down_proj": "rowwise", "lm_head": None}
    c = ParallelismConfig(tp_size=2, tp_plan=plan)
    assert c.tp_plan == plan and c.tp_plan is not plan
    with pytest.raises(TypeError, match=r"tp_plan=\['colwise'\] is a list; expected a dict"):
        ParallelismConfig(tp_plan=["colwise"])
    with pytest.raises(TypeError, match=r"tp_plan key 3 is an int; keys are module name patterns"):
        ParallelismConfig(tp_plan={3: "colwise"})
    with pytest.raises(TypeError, match=r"tp_plan\['lm_head'\]=1 is an int; .*None to drop"):
        ParallelismConfig(tp_plan={"lm_head": 1})

