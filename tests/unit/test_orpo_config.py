"""`rl: orpo` in `nd-parallel train`, in one process: the YAML's ORPO keys reach TRL's ORPOConfig with Axolotl's
meaning, Axolotl's ``chat_template.argilla`` records render as its own transform renders them, and what cannot be run
is refused in the config stage with the fix. Training under a layout: tests/distributed/test_orpo.py (parity) and
test_axolotl_configs_train.py (the YAML on 2 ranks)."""

import json
from pathlib import Path

import pytest

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.data.orpo import argilla_fn
from nd_parallel.config import ConfigError
from tests.unit.axolotl_venv import run_in_axolotl


def _write(tmp_path, extra: str, kind: str = "chat_template.argilla"):
    path = tmp_path / "c.yml"
    path.write_text(f"base_model: ./m\ndatasets:\n  - path: ./d.jsonl\n    type: {kind}\n" + extra)
    return path


def _tokenizer():
    from nd_parallel.testing.models import make_text
    from nd_parallel.testing.tokenizer import train_tiny_tokenizer

    return train_tiny_tokenizer(make_text(50, seed=1))


def _render(tokenizer, records: list[dict]):
    columns = sorted({k for r in records for k in r})
    return argilla_fn(tokenizer, "d.jsonl")({k: [r.get(k) for r in records] for k in columns},
                                            list(range(len(records))))


@pytest.mark.parametrize("extra,beta", [("orpo_alpha: 0.25\n", 0.25), ("orpo_alpha: 0.25\nrl_beta: 0.5\n", 0.5),
                                        ("", 0.1)])
def test_orpo_keys_reach_orpoconfig(tmp_path, extra, beta):
    """Axolotl: rl_beta, else orpo_alpha, is ORPOConfig's beta (TRL's default 0.1); sequence_len its max_length."""
    from trl.experimental import orpo

    from nd_parallel.cli.train.preference import preference_trainer

    cfg = load_train_config(_write(tmp_path, "rl: orpo\n" + extra), environ={})
    with pytest.MonkeyPatch.context() as mp:  # the trainer class returns the config it is given
        mp.setattr(orpo, "ORPOTrainer", lambda args, **kwargs: args)
        args = preference_trainer(cfg, {"output_dir": str(tmp_path / "o"), "use_cpu": True, "report_to": []})
    assert (type(args).__name__, args.beta, args.max_length, args.gradient_checkpointing) == (
        "ORPOConfig", beta, cfg.sequence_len, False)


@pytest.mark.parametrize("extra,kind,needle", [
    ("rl: orpo\n", "chat_template", "datasets[0].type='chat_template' with rl: orpo: ORPO pairs are read as "
                                    "Axolotl's chat_template.argilla"),
    ("rl: dpo\n", "chat_template.argilla", "datasets[0].type='chat_template.argilla' with rl: dpo"),
    ("", "chat_template.argilla", "datasets[0].type='chat_template.argilla' is an ORPO format: set rl: orpo"),
    ("rl: dpo\norpo_alpha: 0.1\n", "chat_template", "orpo_alpha with rl: dpo: it weighs ORPO's odds-ratio term"),
    ("rl: orpo\norpo_alpha: 0\n", "chat_template.argilla", "orpo_alpha=0; write a number > 0"),
    ("rl: orpo\nkto_desirable_weight: 2\n", "chat_template.argilla", "kto_desirable_weight with rl: orpo"),
    ("rl: orpo\nsample_packing: true\n", "chat_template.argilla", "sample_packing=True with rl: orpo"),
    ("rl: orpo\npipeline_parallel_size: 2\n", "chat_template.argilla",
     "rl: orpo with pipeline_parallel_size: 2: ORPO builds its loss from the whole logits after the forward"),
])
def test_what_orpo_cannot_do_is_refused(tmp_path, extra, kind, needle):
    with pytest.raises(ConfigError) as err:
        load_train_config(_write(tmp_path, extra, kind), environ={})
    assert needle in str(err.value), (needle, str(err.value))


def test_orpo_runs_under_fsdp_tp_and_cp(tmp_path):
    for layout in ("dp_shard_size: 2\n", "tensor_parallel_size: 2\n", "context_parallel_size: 2\n"):
        assert load_train_config(_write(tmp_path, "rl: orpo\n" + layout), environ={}).rl == "orpo"


RECORDS = [
    {"chosen": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "a good answer"}],
     "rejected": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "a bad one"}]},
    {"system": "be brief", "prompt": "the prompt wins",
     "chosen": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "yes"}],
     "rejected": [{"role": "user", "content": "other"}, {"content": "no"}]},
    {"system": "", "chosen": [{"content": "q1"}, {"content": "a1"}, {"content": "q2"}, {"content": "fine"}],
     "rejected": [{"content": "q1"}, {"content": "a1"}, {"content": "q2"}, {"content": "poor"}]},
]


def test_argilla_records_render_as_axolotls_transform(tmp_path):
    """Axolotl 0.19's own chat_template.argilla transform (in its venv) and ours, on the same records and template:
    one turn, a system turn with ``prompt`` standing for every user turn, two turns; the same strings."""
    tok = _tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "records.json").write_text(json.dumps({"tokenizer": str(tmp_path / "tok"), "chat_template": "chatml",
                                                       "records": RECORDS}))
    theirs = run_in_axolotl(str(Path(__file__).with_name("axolotl_orpo_dump.py")), str(tmp_path / "records.json"))
    tok.chat_template = theirs["template"]
    ours = _render(tok, RECORDS)
    assert [list(r) for r in zip(ours["prompt"], ours["chosen"], ours["rejected"])] == theirs["rows"]
    assert ours["chosen"][0] == "a good answer<|im_end|>\n"  # from the answer on, with the end of turn
    assert ours["prompt"][1].count("the prompt wins") == 2 and "q1" not in ours["prompt"][1]


def test_bad_argilla_records_name_the_fix():
    tok = _tokenizer()
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    for record, needle in [
            ({"chosen": [{"content": "q"}], "rejected": [{"content": "r"}]}, "'chosen' an even number of them"),
            ({"chosen": "text", "rejected": [{"content": "r"}]}, "reads 'chosen' and 'rejected' as conversations"),
            ({"chosen": [{"content": "q"}, {"text": "a"}], "rejected": [{"content": "r"}]},
             "every turn of 'chosen' needs a 'content' string")]:
        with pytest.raises(ConfigError, match="d.jsonl, record 0: ") as err:
            _render(tok, [record])
        assert needle in str(err.value), (needle, str(err.value))
    tok.chat_template = None
    with pytest.raises(ConfigError, match="chat_template.argilla renders the pairs with a chat template"):
        argilla_fn(tok, "d.jsonl")
