"""Reward models in `nd-parallel train`, in one process (no ranks): Axolotl's reward_model / process_reward_model
keys with its defaults, the records' tokens and labels (the same as Axolotl 0.19's own strategies when its venv is
there, and written out by hand for the stepwise labels), the refusals with their fix (pipeline parallelism, and
context parallelism for the token head, in the parent and before any collective), and the token-classification
loss's global-token form."""

import json
from pathlib import Path

import pytest
import torch

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.data.reward import bradley_terry_fn, stepwise_fn
from nd_parallel.cli.train.data.sources import DatasetSpec
from nd_parallel.config import ConfigError, ParallelismConfig
from nd_parallel.testing.models import make_text
from tests.unit.axolotl_venv import run_in_axolotl

RM = "reward_model: true\ndatasets:\n  - path: ./d.jsonl\n    type: bradley_terry.chat_template\n"
PRM = "process_reward_model: true\ndatasets:\n  - path: ./d.jsonl\n    type: stepwise_supervised\n"


def _load(tmp_path, text: str):
    path = tmp_path / "c.yml"
    path.write_text("base_model: ./m\nmax_steps: 2\n" + text)
    return load_train_config(path, environ={})


def _refused(tmp_path, text: str) -> str:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    return str(err.value)


def test_axolotl_defaults_for_the_two_kinds(tmp_path):
    rm = _load(tmp_path, RM + "model_type: AutoModelForSequenceClassification\ncenter_rewards_coefficient: 0.01\n"
               "cls_model_config: LlamaConfig\n")
    assert rm.reward_model and rm.pad_to_sequence_len  # Axolotl's hint_reward_model_pad
    assert (rm.num_labels, rm.center_rewards_coefficient, rm.cls_model_config) == (None, 0.01, "LlamaConfig")
    prm = _load(tmp_path, PRM + "    step_separator: ' ;; '\n    max_completion_length: 7\n"
                "    train_on_last_step_only: true\nmodel_type: Qwen2ForTokenClassification\n")
    assert prm.process_reward_model and not prm.pad_to_sequence_len
    spec = prm.datasets[0]
    assert (spec.step_separator, spec.max_completion_length, spec.train_on_last_step_only) == (" ;; ", 7, True)
    assert not _load(tmp_path, RM + "pad_to_sequence_len: false\n").pad_to_sequence_len  # an explicit false stays
    assert _load(tmp_path, RM + "context_parallel_size: 2\n").parallel.cp_size == 2  # pooled_head.py


def test_model_class_and_labels_follow_axolotl(tmp_path):
    import transformers

    from nd_parallel.cli.train.reward import auto_class, lora_task

    rm, extra = _load(tmp_path, RM), {}
    assert auto_class(rm, extra) is transformers.AutoModelForSequenceClassification and extra == {"num_labels": 1}
    prm, extra = _load(tmp_path, PRM + "num_labels: 3\n"), {}
    assert auto_class(prm, extra) is transformers.AutoModelForTokenClassification and extra == {"num_labels": 3}
    named, extra = _load(tmp_path, PRM + "model_type: LlamaForTokenClassification\n"), {}
    assert auto_class(named, extra) is transformers.LlamaForTokenClassification and extra == {"num_labels": 2}
    sft = _load(tmp_path, "datasets:\n  - path: ./d.jsonl\n")
    assert auto_class(sft, {}) is transformers.AutoModelForCausalLM
    assert lora_task(rm, ["q_proj", "score"]) == ("SEQ_CLS", ["q_proj"])  # the head is saved in full, not adapted
    assert lora_task(prm, ["classifier", "v_proj"]) == ("TOKEN_CLS", ["v_proj"])
    assert lora_task(sft, ["q_proj"]) == ("CAUSAL_LM", ["q_proj"])


@pytest.mark.parametrize("extra,needle", [
    ("pipeline_parallel_size: 2\n", "reward_model with pp_size=2: its head pools each sequence's last non-pad token"),
    ("process_reward_model: true\n", "reward_model and process_reward_model are both set"),
    ("rl: dpo\n", "rl='dpo' with reward_model: a run trains a policy or a reward model"),
    ("num_labels: 2\n", "num_labels=2 with reward_model: RewardTrainer scores each sequence with one logit"),
    ("model_type: AutoModelForTokenClassification\n", "the head is a SequenceClassification one"),
    ("sample_packing: true\n", "sample_packing=True with reward_model"),
    ("center_rewards_coefficient: -1\n", "center_rewards_coefficient=-1; write a number >= 0"),
    ("cls_model_config: 3\n", "cls_model_config=3 is not a transformers config class"),
])
def test_reward_model_refusals_name_the_fix(tmp_path, extra, needle):
    assert needle in _refused(tmp_path, RM + extra)


@pytest.mark.parametrize("text,needle", [
    (PRM + "context_parallel_size: 2\n", "process_reward_model with cp_size=2: CP shifts the labels"),
    (PRM + "pipeline_parallel_size: 2\n", "process_reward_model with pp_size=2: the pipeline's last stage computes "
                                          "the causal LM's shifted cross-entropy"),
    (PRM + "center_rewards_coefficient: 0.01\n", "center_rewards_coefficient: only reward_model's RewardTrainer"),
    (PRM + "    max_completion_length: 0\n", "datasets[0].max_completion_length=0"),
    (PRM + "    train_on_last_step_only: 1\n", "datasets[0].train_on_last_step_only=1; use true or false"),
    ("datasets:\n  - path: ./d.jsonl\n    type: stepwise_supervised\n", "is a reward-model format: set "
                                                                        "process_reward_model: true"),
    ("datasets:\n  - path: ./d.jsonl\nnum_labels: 1\n", "num_labels=1 sizes a classification head"),
    ("reward_model: true\ndatasets:\n  - path: ./d.jsonl\n    type: chat_template\n",
     "datasets[0].type='chat_template' with reward_model: its records are read as bradley_terry.chat_template"),
    ("datasets:\n  - path: ./d.jsonl\nmodel_type: AutoModelForSequenceClassification\n", "only causal LMs train"),
])
def test_other_refusals_name_the_fix(tmp_path, text, needle):
    assert needle in _refused(tmp_path, text)


def test_axolotl_reward_examples_pass_the_config_stage(tmp_path):
    """The keys of Axolotl's examples/qwen2/reward-model.yaml, qwen3/reward-model.yaml and qwen2/prm.yaml."""
    rm = _load(tmp_path, RM + "model_type: AutoModelForSequenceClassification\nnum_labels: 1\ntokenizer_type: "
               "AutoTokenizer\nchat_template: qwen_25\nremove_unused_columns: false\nsample_packing: false\n"
               "eval_sample_packing: false\ncenter_rewards_coefficient: 0.01\npad_to_sequence_len: true\n")
    assert rm.num_labels == 1 and rm.chat_template == "qwen_25"
    prm = _load(tmp_path, PRM + "    step_separator: \"\\n\"\n    max_completion_length:\n"
                "    train_on_last_step_only: false\nmodel_type: AutoModelForTokenClassification\nnum_labels: 2\n"
                "chat_template:\n")
    assert prm.datasets[0].step_separator == "\n" and prm.datasets[0].max_completion_length is None


def test_classification_heads_are_refused_under_pp_and_cp_before_any_collective():
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    from nd_parallel.distributed.classification import check_classification_layout, head_kind
    from nd_parallel.testing.models import tiny_config

    config = tiny_config("llama")
    with torch.device("meta"):
        rm = AutoModelForSequenceClassification.from_config(config)
        prm = AutoModelForTokenClassification.from_config(config)
    assert (head_kind(rm), head_kind(prm)) == ("sequence", "token")
    for model in (rm, prm):
        check_classification_layout(model, ParallelismConfig(dp_shard_size=2, tp_size=2))  # allowed
        with pytest.raises(NotImplementedError, match="pp_size=2"):
            check_classification_layout(model, ParallelismConfig(pp_size=2))
    check_classification_layout(rm, ParallelismConfig(cp_size=2))  # its pooled token gathered (pooled_head.py)
    with pytest.raises(NotImplementedError, match="cp_size=2: CP shifts the labels"):
        check_classification_layout(prm, ParallelismConfig(cp_size=2))
    rm.score = None  # a head elsewhere: CP's pooling hooks transformers' `score`
    with pytest.raises(NotImplementedError, match="cp_size=2: its head is not transformers' `score` module"):
        check_classification_layout(rm, ParallelismConfig(cp_size=2))


def test_token_mean_loss_is_the_sum_over_the_given_count():
    """PRM's loss (cli/train/reward.token_mean_loss): transformers' token-classification mean without a count, the
    sum over the label tokens divided by num_items_in_batch with one (what the Trainer passes for the accumulated
    batch; transformers' own head drops it)."""
    from transformers import AutoModelForTokenClassification

    from nd_parallel.cli.train.reward import token_mean_loss
    from nd_parallel.testing.models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_config(tiny_config("llama", num_labels=2)).eval()
    ids = torch.randint(4, 100, (2, 9))
    labels = torch.full((2, 9), -100)
    labels[0, 3], labels[0, 8], labels[1, 0] = 1, 0, 1  # position 0 counts: labels are not shifted
    mean = model(input_ids=ids, labels=labels).loss
    token_mean_loss(model)
    assert torch.allclose(model(input_ids=ids, labels=labels).loss, mean)
    assert torch.allclose(model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(6)).loss, mean / 2)


# ------------------------------------------------------------------------------------------------- records
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from nd_parallel.testing.tokenizer import train_tiny_tokenizer

    path = tmp_path_factory.mktemp("reward_tok")
    train_tiny_tokenizer(make_text(40, seed=3)).save_pretrained(path)
    return str(path)


def _rows(fn, records: list[dict]) -> dict:
    return fn({k: [r[k] for r in records] for k in records[0]}, list(range(len(records))))


def test_stepwise_labels_sit_on_each_steps_last_token(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    record = {"prompt": "2 + 2?", "completions": ["two plus two", "is five"], "labels": [True, False]}
    sep = enc("\n")
    a, b = enc("two plus two") + sep, enc("is five") + sep
    prompt = [tok.bos_token_id] + enc("2 + 2?")
    out = _rows(stepwise_fn(DatasetSpec(path="-", type="stepwise_supervised"), tok, "t", 512), [record])
    assert out["input_ids"] == [prompt + a + b]
    assert out["labels"] == [[-100] * (len(prompt) + len(a) - 1) + [1] + [-100] * (len(b) - 1) + [0]]
    last = DatasetSpec(path="-", type="stepwise_supervised", train_on_last_step_only=True, max_completion_length=4)
    out = _rows(stepwise_fn(last, tok, "t", 512), [record])
    assert out["input_ids"] == [prompt + (a + b)[:4]] and set(out["labels"][0]) == {-100}  # only step 2, cut away
    with pytest.raises(ConfigError, match="2 steps but 1 labels"):
        _rows(stepwise_fn(DatasetSpec(path="-", type="stepwise_supervised"), tok, "t", 512),
              [{**record, "labels": [True]}])


def test_reward_records_tokenize_as_axolotl(tokenizer_dir, tmp_path):
    """Axolotl 0.19's BTChatTemplateStrategy and StepwiseSupervisedPromptTokenizingStrategy, run in its own venv on the
    same records and tokenizer (its ChatML template): chosen / rejected ids, and input_ids / labels for three dataset
    settings, equal; the short sequence_len cuts some rows (Axolotl cuts, it does not drop)."""
    from transformers import AutoTokenizer

    lines = make_text(30, seed=4)
    pairs = [{"system": "be brief" if i % 2 else "", "input": lines[i], "chosen": lines[i + 1],
              "rejected": lines[i + 2][:7]} for i in range(0, 24, 3)]
    steps = [{"prompt": lines[i], "completions": [lines[i + 1][:20], lines[i + 2][:9], "x"],
              "labels": [True, False, i % 2 == 0]} for i in range(0, 24, 3)]
    settings = [{}, {"train_on_last_step_only": True, "step_separator": " ;; "}, {"max_completion_length": 7}]
    request = {"model": tokenizer_dir, "len": 64, "pairs": pairs, "steps": steps, "stepwise": settings}
    (tmp_path / "request.json").write_text(json.dumps(request))
    theirs = run_in_axolotl(str(Path(__file__).with_name("axolotl_reward_dump.py")), str(tmp_path / "request.json"))
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ours = _rows(bradley_terry_fn(tok, "t", 64), pairs)
    assert [list(p) for p in zip(ours["chosen_ids"], ours["rejected_ids"])] == theirs["pairs"]
    assert any(len(c) == 64 for c in ours["chosen_ids"]) and any(len(r) < 64 for r in ours["rejected_ids"])
    for i, setting in enumerate(settings):
        spec = DatasetSpec(path="-", type="stepwise_supervised", **setting)
        out = _rows(stepwise_fn(spec, tok, "t", 64), steps)
        assert [list(r) for r in zip(out["input_ids"], out["labels"])] == theirs["steps"][str(i)], setting


def test_global_token_loss_counts_a_token_heads_first_label(tmp_path):
    """distributed/loss.GlobalTokenLoss on a token-classification head (evaluation: no count given) counts the
    unshifted labels, position 0 included, so the loss is the model's own mean (a causal LM's count skips it)."""
    import torch.distributed as dist
    from transformers import AutoModelForTokenClassification

    from nd_parallel.cli.train.reward import token_mean_loss
    from nd_parallel.distributed.loss import GlobalTokenLoss
    from nd_parallel.testing.models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_config(tiny_config("llama", num_labels=2)).eval()
    token_mean_loss(model)
    ids, labels = torch.randint(4, 100, (1, 6)), torch.tensor([[1, -100, 0, -100, -100, 1]])
    mean = model(input_ids=ids, labels=labels).loss
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        hooks = GlobalTokenLoss(model, dist.group.WORLD)
        assert torch.allclose(model(input_ids=ids, labels=labels).loss, mean)
        hooks.remove()
    finally:
        dist.destroy_process_group()


def test_sequence_labels_under_a_group_are_refused_not_averaged_wrongly(tmp_path):
    """A sequence-classification head given labels (a plain Trainer's classification) would return this rank's mean,
    which summed over the dp ranks is not the global one: refused at its first labelled forward."""
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    from nd_parallel.distributed.loss import GlobalTokenLoss
    from nd_parallel.testing.models import tiny_config

    model = AutoModelForSequenceClassification.from_config(tiny_config("llama", num_labels=1, pad_token_id=0))
    ids = torch.randint(4, 100, (2, 5))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        GlobalTokenLoss(model, dist.group.WORLD)
        assert model(input_ids=ids).logits.shape == (2, 1)  # no labels (RewardTrainer): untouched
        with pytest.raises(NotImplementedError, match="with labels under data or context parallelism"):
            model(input_ids=ids, labels=torch.zeros(2))
    finally:
        dist.destroy_process_group()
