"""do_causal_lm_eval (cli/train/lm_eval.py) in one process: Axolotl's perplexity equals Axolotl's own code (its venv),
BLEU / chrF / TER are sacrebleu's corpus scores, evaluation rows split into prompt and reference as Axolotl splits
them, every rank generates the same number of times, and what cannot run is refused in the config stage. The 2-rank
FSDP2 run equal to one process is test_axolotl_configs_train.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nd_parallel import ParallelismConfig
from nd_parallel.cli.train import lm_eval
from nd_parallel.testing.models import make_text, save_tiny_model
from tests.unit.axolotl_venv import run_in_axolotl


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from nd_parallel.testing.tokenizer import train_tiny_tokenizer

    root = tmp_path_factory.mktemp("lm_eval")
    lines = make_text(80, seed=4)
    model = save_tiny_model("llama", root / "model", seed=2)
    tokenizer = train_tiny_tokenizer(lines)
    tokenizer.save_pretrained(model)
    return model, lines


def test_perplexity_equals_axolotls_own(model_dir, tmp_path):
    """Axolotl's Perplexity (references padded together, labels including the padding, one window of max_seq_len
    tokens): ours, in chunks of 3 rows, gives its number; so does one chunk of all rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path, lines = model_dir
    references = [" ".join(lines[i:i + 1 + i % 3]) for i in range(7)]  # different lengths: padding matters
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ours = [lm_eval.perplexity(model, references, tokenizer, 16, batch) for batch in (3, 7)]
    (tmp_path / "spec.json").write_text(json.dumps({"model": str(model_path), "references": references,
                                                    "max_seq_len": 16}))
    theirs = run_in_axolotl(str(Path(__file__).with_name("axolotl_perplexity_dump.py")), str(tmp_path / "spec.json"))
    assert ours[0] == pytest.approx(theirs["score"], rel=1e-6) and ours[1] == pytest.approx(ours[0], rel=1e-6)


def test_scores_are_sacrebleus_corpus_scores():
    import sacrebleu

    refs = ["the cat sat on the mat", "a dog ran in the park today"]
    assert lm_eval.scores(["sacrebleu", "chrf", "ter"], refs, refs) == {
        "eval_sacrebleu": pytest.approx(100.0), "eval_chrf": pytest.approx(100.0), "eval_ter": 0.0}
    preds = ["the cat sat on a mat", "one dog ran in the park"]
    got = lm_eval.scores(["sacrebleu", "ter"], preds, refs)
    assert got == {"eval_sacrebleu": sacrebleu.corpus_bleu(preds, [refs]).score,
                   "eval_ter": sacrebleu.corpus_ter(preds, [refs]).score}
    assert lm_eval.scores(["perplexity"], preds, refs) == {}


def test_rows_split_into_prompt_and_reference_as_axolotl_splits_them():
    """Label-masked tokens (padding left out) are the prompt, trained ones the reference; a packed row is cut where
    its position_ids restart, and a one-token range is skipped (Axolotl's find_ranges)."""
    rows = [{"input_ids": [5, 6, 7, 8, 0, 0], "labels": [-100, -100, 7, 8, -100, -100]},
            {"input_ids": [5, 6, 9, 5, 7, 7, 3], "labels": [-100, 6, 9, -100, -100, 7, -100],
             "position_ids": [0, 1, 2, 0, 1, 2, 0]}]
    assert lm_eval.split_rows(rows, pad_id=0) == [([5, 6], [7, 8]), ([5], [6, 9]), ([5, 7], [7])]


@pytest.mark.parametrize("n,world", [(7, 2), (1, 2), (8, 4), (3, 4)])
def test_every_rank_generates_the_same_number_of_times_and_all_rows_once(n, world):
    shares = [lm_eval.share(n, rank, world) for rank in range(world)]
    assert len({len(runs) for _, runs in shares}) == 1
    assert [i for mine, _ in shares for i in mine] == list(range(n))


def _d(**keys):
    return {"do_causal_lm_eval": True, "val_set_size": 0.1, "eval_steps": 5, **keys}


@pytest.mark.parametrize("keys,layout,needle", [
    (dict(eval_causal_lm_metrics=["comet"]), None, "comet needs the unbabel-comet package"),
    (dict(eval_causal_lm_metrics=["bleurt"]), None, "'bleurt' is not a metric here"),
    (dict(eval_causal_lm_metrics="sacrebleu"), None, "write a list"),
    (dict(val_set_size=0), None, "without an evaluation"),
    (dict(evals_per_epoch=0, eval_steps=None), None, "without an evaluation"),
    (dict(eval_strategy="no"), None, "without an evaluation"),
    (dict(rl="dpo"), None, "with rl / a reward model"),
    (dict(eval_max_new_tokens=0), None, "eval_max_new_tokens=0"),
    ({}, dict(tp_size=2), "do_causal_lm_eval with tp_size=2"),
    ({}, dict(pp_size=2), "do_causal_lm_eval with pp_size=2"),
])
def test_what_cannot_run_is_refused_in_the_config_stage(keys, layout, needle):
    out = lm_eval.refusals(_d(**keys), ParallelismConfig(**layout) if layout else ParallelismConfig(dp_shard_size=2))
    assert any(needle in line for line in out), out


def test_default_metrics_are_axolotls_without_comet():
    assert lm_eval.metric_names(None) == ["sacrebleu", "ter", "chrf"]
    assert lm_eval.note(_d()) and not lm_eval.note(_d(eval_causal_lm_metrics=["perplexity"]))
    assert lm_eval.refusals(_d(), ParallelismConfig(dp_shard_size=2)) == []
