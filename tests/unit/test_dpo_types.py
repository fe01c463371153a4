"""Axolotl's template-string DPO types (`chatml.*`, `llama3.*`: data/dpo_types.py) render the same prompt / chosen /
rejected strings as Axolotl's own strategies (its venv, prompt_strategies/dpo/chatml.py and llama3.py), and a record
without the strategy's fields is named. The strings then train as chat_template.default's do (test_dpo.py)."""

import json

import pytest

from nd_parallel.cli.train.data.dpo_types import STRATEGIES, TYPES, dpo_fn
from nd_parallel.cli.train.data.sources import DatasetSpec
from nd_parallel.config import ConfigError
from tests.unit.axolotl_venv import run_in_axolotl

TURNS = {"chosen": [{"role": "user", "content": "u?"}, {"role": "assistant", "content": "good"}],
         "rejected": [{"role": "user", "content": "u?"}, {"role": "assistant", "content": "bad"}]}
# strategy -> records in the shape that strategy reads (with and without a system turn)
RECORDS = {
    "default": [{"prompt": "p", "chosen": "c", "rejected": "r", "system": "s"},
                {"instruction": "i", "chosen_response": "c2", "rejected_response": "r2"}],
    "icr": [{"input": "x", "chosen": "c", "rejected": "r", "system": ""}],
    "intel": [{"question": "q", "chosen": "c", "rejected": "r", "system": "be brief"}],
    "prompt_pairs": [{"prompt": "p", "chosen": "c", "rejected": "r"}],
    "ultra": [{"prompt": "u?", **TURNS, "system": "s"}],
    "argilla_chat": [dict(TURNS)],
}

SCRIPT = """
import importlib, json, sys
records = json.loads(sys.argv[1])
out = {}
for template in ("chatml", "llama3"):
    module = importlib.import_module(f"axolotl.prompt_strategies.dpo.{template}")
    for strategy, rows in records.items():
        fn = getattr(module, strategy)(None)
        out[f"{template}.{strategy}"] = [{k: fn(dict(r))[k] for k in ("prompt", "chosen", "rejected")} for r in rows]
print(json.dumps(out))
"""


def _render(kind: str, records: list[dict]) -> list[dict]:
    fn = dpo_fn(DatasetSpec(path="d.jsonl", type=kind), "d.jsonl")
    keys = sorted({k for r in records for k in r})
    out = fn({k: [r.get(k) for r in records] for k in keys}, list(range(len(records))))
    return [dict(zip(out, values)) for values in zip(*out.values())]


def test_types_render_as_axolotls_strategies():
    theirs = run_in_axolotl("-c", SCRIPT, json.dumps(RECORDS))
    assert set(theirs) == set(TYPES) and len(TYPES) == 2 * len(STRATEGIES)
    for kind in TYPES:
        rows = RECORDS[kind.split(".", 1)[1]]
        for row in rows:  # one record at a time: Axolotl's default picks keys by presence in the record
            assert _render(kind, [row]) == [theirs[kind][rows.index(row)]], kind


@pytest.mark.parametrize("kind,record,match", [
    ("chatml.ultra", {"prompt": "p", "chosen": "c", "rejected": "r"}, "'chosen' must be a conversation whose turn 1"),
    ("llama3.intel", {"prompt": "p", "chosen": "c", "rejected": "r"}, "'question' must be a string"),
])
def test_a_record_without_the_strategys_fields_is_named(kind, record, match):
    with pytest.raises(ConfigError, match=match):
        _render(kind, [record])
