"""Fixtures the launched test modules share: tiny checkpoints, worker launches shared by many rows, and a
per-module cache for the single-process references those rows compare against.

A launch is the expensive part (one torchrun launch serves every row of its group), so it runs once per session
per key, and a failed launch is remembered so its other rows fail at once instead of launching again.
"""

import json
import os
from pathlib import Path

import pytest

from nd_parallel.fault.launch import launch
from nd_parallel.testing.launch import LaunchOnce

HERE = str(Path(__file__).parent)
# Rank programs import helpers from this folder (peft_recipe); a PYTHONPATH already set (e.g. another
# transformers) is kept behind it.
PYTHONPATH = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="session")
def tiny_model(tiny_models, tmp_path_factory):
    """``tiny_model(family, **config_overrides) -> str``: the directory of a tiny randomly initialised checkpoint
    (``save_tiny_model``), built once per distinct request.

    Overrides equal to the tiny defaults are dropped first, so e.g. ``tiny_model("llama", num_hidden_layers=2)``
    is ``tiny_models["llama"]`` (tests/conftest.py): the same config and seed give the same weights, built once."""
    from nd_parallel.testing.models import FAMILIES, TINY, save_tiny_model

    made = {}

    def get(family, **overrides):
        defaults = {**TINY, **FAMILIES.get(family, {})}
        overrides = {k: v for k, v in overrides.items() if k not in defaults or defaults[k] != v}
        if not overrides and family in tiny_models:
            return tiny_models[family]
        key = (family, json.dumps(overrides, sort_keys=True))
        if key not in made:
            made[key] = str(save_tiny_model(family, tmp_path_factory.mktemp(family), **overrides))
        return made[key]

    return get


@pytest.fixture(scope="session")
def launch_worker(tmp_path_factory):
    """``launch_worker(key, worker, world, spec, timeout=900) -> Path``: the output directory of ``worker`` run on
    ``world`` ranks as ``worker OUT OUT/spec.json``, launched once per session per ``key``.

    ``key`` names the launch (and its temporary directory), so modules prefix theirs (``"parity_2r"``). ``spec`` is
    the JSON written to ``spec.json``, or a callable taking the output directory and returning it (for specs that
    name paths inside it, and so the models it names are only built when the launch really runs). This folder is
    put in front of PYTHONPATH. A launch that failed or timed out re-raises for every later row with its key."""
    done = LaunchOnce()

    def start(key, worker, world, spec, timeout):
        out = tmp_path_factory.mktemp(key)
        (out / "spec.json").write_text(json.dumps(spec(out) if callable(spec) else spec))
        launch(worker, world, [str(out), str(out / "spec.json")], timeout=timeout, capture=True,
               env={"PYTHONPATH": PYTHONPATH})
        return out

    def get(key, worker, world, spec, timeout=900):
        return done.get(key, lambda: start(key, worker, world, spec, timeout))

    return get


@pytest.fixture(scope="session")
def worker_env():
    """The environment for running a worker script in one plain process: launch_worker's PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": PYTHONPATH}


@pytest.fixture(scope="module")
def memo():
    """``memo(key, compute)``: ``compute()``'s result, computed on the first request for ``key`` in this module.

    For the single-process references many rows compare against; module scope frees them with their module.
    Unlike a launch, a failure is not remembered: the next row that needs it computes it again."""
    cache = {}

    def get(key, compute):
        if key not in cache:
            cache[key] = compute()
        return cache[key]

    return get
