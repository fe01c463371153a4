"""docs/axolotl_keys.md is what `python -m nd_parallel.cli.train.keys_table` writes from the code that reads the keys
(regenerate it when a key's handling changes), and the table sorts every key of Axolotl 0.19's schema."""

from pathlib import Path

from nd_parallel.cli.train.keys_table import render, rows
from nd_parallel.cli.train.schema import AXOLOTL_DEFAULTS

DOC = Path(__file__).resolve().parents[2] / "docs" / "axolotl_keys.md"


def test_the_committed_table_is_the_generated_one():
    assert DOC.read_text() == render(), "regenerate: python -m nd_parallel.cli.train.keys_table > docs/axolotl_keys.md"


def test_every_schema_key_has_a_row_and_a_reason():
    table = {key: (kind, why) for key, kind, why in rows()}
    assert set(AXOLOTL_DEFAULTS) <= set(table)
    assert all(why for kind, why in table.values()), [k for k, (_, why) in table.items() if not why]
    assert table["peft_use_dora"][0] == "acted on" and table["gptq"][0] == "refused if set"
    assert table["use_trackio"][0] == "no effect" and table["dpo_beta"][0] == "line"
