"""`rl: kto` in `nd-parallel train`, in one process: the YAML's KTO keys reach TRL's KTOConfig with Axolotl's
meaning, Axolotl's KTO dataset types render the prompt / completion strings its strategies write, and what cannot be
run is refused in the config stage with the fix. Training under a layout: tests/distributed/test_kto.py (parity)
and test_axolotl_configs_train.py (the YAML on 2 ranks)."""

import pytest

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.data.kto import TYPES, kto_fn
from nd_parallel.cli.train.data.sources import DatasetSpec
from nd_parallel.config import ConfigError


def _write(tmp_path, extra: str, kind: str = "llama3.ultra"):
    path = tmp_path / "c.yml"
    path.write_text(f"base_model: ./m\nmicro_batch_size: 2\ndatasets:\n  - path: ./d.jsonl\n    type: {kind}\n"
                    + extra)
    return path


def _render(kind: str, records: list[dict]):
    fn = kto_fn(DatasetSpec(path="d.jsonl", type=kind), "d.jsonl")
    return fn({k: [r.get(k) for r in records] for k in records[0]}, list(range(len(records))))


def test_kto_keys_reach_ktoconfig(tmp_path):
    from nd_parallel.cli.train.preference import preference_trainer

    cfg = load_train_config(_write(tmp_path, "rl: kto\nrl_beta: 0.5\nkto_desirable_weight: 0.2\n"), environ={})
    assert (cfg.rl, cfg.rl_beta, cfg.kto_desirable_weight, cfg.kto_undesirable_weight) == ("kto", 0.5, 0.2, None)
    seen = {}

    class Stop(Exception):
        pass

    def fake_trainer(args, **kwargs):
        seen["args"] = args
        raise Stop

    import trl

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trl, "KTOTrainer", fake_trainer)
        with pytest.raises(Stop):
            preference_trainer(cfg, {"output_dir": str(tmp_path / "o"), "use_cpu": True, "report_to": []})
    args = seen["args"]
    assert (type(args).__name__, args.beta, args.desirable_weight, args.undesirable_weight, args.max_length) == (
        "KTOConfig", 0.5, 0.2, 1.0, cfg.sequence_len)  # Axolotl: an unset weight is 1.0


def test_kto_types_render_as_axolotls_strategies():
    rows = _render("llama3.ultra", [{"prompt": "hi", "completion": "yo", "label": True, "system": ""},
                                    {"prompt": "q", "completion": "a", "label": False, "system": "be brief"}])
    assert rows["prompt"] == [
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|><|start_header_id|>user<|end_header_id|>"
        "\n\nq<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"]
    assert rows["completion"] == ["yo<|eot_id|>", "a<|eot_id|>"] and rows["label"] == [True, False]
    rows = _render("chatml.intel", [{"question": "q", "completion": "a", "label": True, "system": "s"}])
    assert rows["prompt"] == ["<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"]
    assert rows["completion"] == ["a<|im_end|>"]
    rows = _render("chatml.argilla_chat", [{"completion": [{"role": "user", "content": "u"},
                                                           {"role": "assistant", "content": "v"}], "label": False}])
    assert rows == {"prompt": ["<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"],
                    "completion": ["v<|im_end|>"], "label": [False]}
    assert {"llama3.argilla", "chatml.prompt_pairs", "llama3.argilla_chat"} <= set(TYPES)


@pytest.mark.parametrize("record,match", [
    ({"prompt": "p", "completion": "c", "label": "yes"}, "record 0: KTO needs 'label' true .* got 'yes'"),
    ({"instruction": "p", "completion": "c", "label": True}, "ultra reads the strings 'prompt' and 'completion'"),
])
def test_bad_kto_records_are_named(record, match):
    with pytest.raises(ConfigError, match=match):
        _render("llama3.ultra", [record])


@pytest.mark.parametrize("extra,kind,needle", [
    ("rl: kto\nmicro_batch_size: 1\n", "llama3.ultra", "micro_batch_size=1 with rl: kto: KTO estimates its KL term"),
    ("rl: kto\nkto_desirable_weight: 0\n", "llama3.ultra", "kto_desirable_weight=0; write a number > 0"),
    ("rl: kto\n", "chat_template", "datasets[0].type='chat_template' with rl: kto"),
    ("", "llama3.ultra", "datasets[0].type='llama3.ultra' is a DPO or KTO format: set rl: dpo or rl: kto"),
    ("", "chatml.argilla", "datasets[0].type='chatml.argilla' is a KTO format: set rl: kto"),
    ("rl: kto\npipeline_parallel_size: 2\n", "llama3.ultra", "rl: kto with pipeline_parallel_size: 2: KTO sums"),
])
def test_what_kto_cannot_run_is_refused_in_the_config_stage(tmp_path, extra, kind, needle):
    with pytest.raises(ConfigError) as err:
        load_train_config(_write(tmp_path, extra, kind), environ={})
    assert needle in str(err.value), str(err.value)
