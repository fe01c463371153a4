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
