"""Axolotl's fp16 / float16 keys in nd-parallel train's YAML (issue 19), read as Axolotl's resolve_dtype reads them:
fp16: true -> mixed_precision fp16 (over bf16: auto), bf16: true wins over both, float16: true trains as fp16: true
with a printed note (Axolotl keeps fp16 weights without loss scaling; here fp32 master weights)."""

import pytest

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.job import mixed_precision, trainer_arguments

from .test_train_yaml import data, real_world  # noqa: F401 (fixture)


def _precision(cfg) -> tuple[bool, bool]:
    args = trainer_arguments(cfg, "x", train_rows=40, eval_rows=4, dp=2)
    return args["bf16"], args["fp16"]


@pytest.mark.parametrize("keys,expected,note", [
    (dict(fp16="true"), (False, True), None),                          # bf16: auto (the file's) -> fp16, as Axolotl
    (dict(fp16="true", bf16="false"), (False, True), None),
    (dict(fp16="true", bf16="true"), (True, False), "fp16: true with bf16: true: bf16 mixed precision is used"),
    (dict(float16="true"), (False, True), "float16: true (in Axolotl: weights loaded in fp16"),
    # what Axolotl's own examples write (archived/openllama-3b, archived/pythia-12b, llama-2/gptq-lora)
    (dict(float16="true", fp16="false", bf16="false"), (False, True), "trains as fp16: true here"),
    (dict(float16="true", bf16="true"), (True, False), "float16: true with bf16: true: bf16"),
    (dict(fp16="false"), (False, False), None),                        # CPU: auto is fp32
])
def test_fp16_keys_map_to_mixed_precision(tmp_path, data, keys, expected, note):  # noqa: F811
    cfg = load_train_config(real_world(tmp_path, data, **keys))
    assert _precision(cfg) == expected
    notes = [n for n in cfg.notes if "fp16" in n or "float16" in n]
    assert (notes == []) if note is None else (len(notes) == 1 and note in notes[0]), cfg.notes


def test_mixed_precision_order():
    assert mixed_precision(True, True) == "bf16" and mixed_precision("auto", True) == "fp16"
    assert mixed_precision(False, True) == "fp16" and mixed_precision(False, False) == "no"


def test_float16_with_bf16_auto_is_bf16_on_a_bf16_gpu(tmp_path, data, monkeypatch):  # noqa: F811
    """Axolotl's resolve_dtype: float16 does not set fp16, so bf16: auto still picks bf16 on a GPU that has it (its
    openllama examples train bf16 on an H100), before float16 is looked at; fp16: true would win over auto."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    cfg = load_train_config(real_world(tmp_path, data, float16="true", fp16="false"))
    assert _precision(cfg) == (True, False)
    assert [n for n in cfg.notes if "float16" in n] == [
        "float16: true with bf16: auto on a GPU with bf16: bf16 mixed precision is used, as in Axolotl"]
    assert mixed_precision("auto", False, True) == "bf16" and mixed_precision("auto", True, True) == "fp16"
    assert mixed_precision(False, False, True) == "fp16"
