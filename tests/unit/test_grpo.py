"""rl: grpo / gdpo in one process (cli/train/grpo.py): the keyed sampler draws what transformers' sampling draws, the
same tokens however the rows are split over ranks; the config stage refuses every bad trl: setting in one message;
the parent runs the user's transform and reads a local dataset folder's configuration (``name``)."""

import json
import textwrap

import pytest
import torch
from transformers import GenerationConfig

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.grpo import Settings, batch_problem
from nd_parallel.cli.train.grpo_rank import KeyedSampling
from nd_parallel.config import ConfigError


def _sample(config, logits, round_=0, first_row=0, steps=1):
    sampler = KeyedSampling(config, seed=7, round_=round_, first_row=first_row)
    ids, out = torch.zeros(logits.shape[0], 3, dtype=torch.long), []
    for _ in range(steps):
        scores = sampler(ids, logits.clone())
        chosen = scores.argmax(-1)
        assert torch.all(scores.isinf().sum(-1) == logits.shape[-1] - 1)  # one token left: any sampler takes it
        out.append(chosen)
        ids = torch.cat([ids, chosen[:, None]], 1)
    return torch.stack(out, 1)


def test_the_same_rows_draw_the_same_tokens_however_they_are_split():
    config = GenerationConfig(do_sample=True, temperature=0.8, top_p=0.9)
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    whole = _sample(config, logits, steps=4)
    halves = torch.cat([_sample(config, logits[:4], steps=4), _sample(config, logits[4:], first_row=4, steps=4)])
    assert torch.equal(whole, halves)
    assert not torch.equal(whole, _sample(config, logits, round_=1, steps=4))  # another round, other draws


def test_the_draws_follow_the_warped_distribution():
    """Gumbel-max over the warped log-probabilities: frequencies over 6000 rows match softmax(logits / T) within
    the nucleus (top_p), and tokens outside it are never drawn."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -3.0])
    config = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9)
    drawn = _sample(config, logits.expand(6000, 5))[:, 0]
    probs = torch.softmax(logits / 0.7, -1)
    keep = torch.cumsum(probs, 0) - probs < 0.9  # transformers' nucleus: the top tokens up to mass 0.9
    want = torch.where(keep, probs, 0) / probs[keep].sum()
    freq = torch.bincount(drawn, minlength=5).double() / len(drawn)
    assert torch.all(freq[~keep] == 0)
    assert torch.allclose(freq, want.double(), atol=0.02), (freq, want)  # ~4 standard errors at 6000 draws


REWARDS = textwrap.dedent('''
    def prompts(cfg, dataset_idx=0):
        assert cfg.rl in ("grpo", "gdpo") and cfg.datasets[dataset_idx].path.endswith("q.jsonl") and cfg.nope is None
        return lambda row: {"prompt": [{"role": "user", "content": row["q"]}]}

    def broken(cfg, dataset_idx=0):
        return lambda row: {"prompt": row["missing"]}

    def no_prompt(cfg, dataset_idx=0):
        return lambda row: {"other": row["q"]}

    def score(prompts, completions, **kwargs):
        return [1.0 for _ in completions]

    def one_argument(completions):
        return [1.0 for _ in completions]
''')


@pytest.fixture()
def workspace(tmp_path):
    (tmp_path / "rwd_unit.py").write_text(REWARDS)
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(8)))
    return tmp_path


def _yaml(path, **keys):
    base = {"base_model": "./m", "rl": "grpo",
            "datasets": [{"path": str(path / "q.jsonl"), "type": "rwd_unit.prompts"}],
            "trl": {"reward_funcs": ["rwd_unit.score"], "num_generations": 2}, "micro_batch_size": 2,
            "sequence_len": 64}
    (path / "c.yml").write_text(json.dumps({**base, **keys}))
    return path / "c.yml"


def test_a_grpo_yaml_passes_and_imports_from_its_folder(workspace, monkeypatch):
    monkeypatch.chdir(workspace.parent)  # the YAML's folder, not the working directory, holds rwd_unit.py
    trl = {"reward_funcs": ["rwd_unit.score"], "num_generations": 2, "generation_kwargs": {"stop": ["x"]},
           "vllm_server_port": 8000}
    cfg = load_train_config(_yaml(workspace, rl="gdpo", trl=trl, vllm={"max_model_len": 64}), environ={})
    assert cfg.rl == "gdpo" and str(workspace) in cfg.import_dirs
    notes = "\n".join(cfg.notes)
    for needle in ("keyed by (seed, round, row, position)", "trl.generation_kwargs: read by Axolotl's async GRPO",
                   "trl.vllm_server_port: read only with use_vllm: true", "vllm: Axolotl reads this block only"):
        assert needle in notes, (needle, notes)


def test_async_prefetch_is_read(workspace):
    """Axolotl's async trainer: accepted with its meaning stated; it reads generation_kwargs, so they are not unused."""
    trl = {"reward_funcs": ["rwd_unit.score"], "num_generations": 2, "async_prefetch": True, "prefetch_depth": 2,
           "generation_kwargs": {"stop": ["x"]}}
    cfg = load_train_config(_yaml(workspace, rl="grpo", trl=trl), environ={})
    notes = "\n".join(cfg.notes)
    assert "by the policy at the start of the step 2 before it" in notes, notes
    assert "trl.generation_kwargs: read by Axolotl's async GRPO" not in notes, notes


def test_every_bad_grpo_setting_is_refused_in_one_message(workspace):
    trl = {"reward_funcs": ["rwd_unit.score", "rwd_unit.one_argument", "nowhere.fn", "rwd_unit.absent"],
           "reward_weights": [1.0], "num_generations": 1, "rollout_func": "m.f", "multi_objective_aggregation":
           "sum_then_normalize", "num_generation": 4, "prefetch_depth": 0, "replay_buffer_size": 8}
    with pytest.raises(ConfigError) as err:
        load_train_config(_yaml(workspace, rl="gdpo", trl=trl, tensor_parallel_size=2, sample_packing=True,
                                datasets=[{"path": "q.jsonl", "type": "chat_template"},
                                          {"path": "q.jsonl", "type": "rwd_unit.missing_fn"}]), environ={})
    message = str(err.value)
    for needle in ("takes fewer than 2 arguments", "trl.reward_funcs[2]='nowhere.fn' cannot be imported",
                   "has no function 'absent'", "trl.reward_weights=[1.0]: write one number per reward function (4)",
                   "trl.num_generations=1", "trl.rollout_func='m.f': a custom rollout replaces the keyed sampling",
                   "'sum_then_normalize' is GRPO's", "unknown key trl.num_generation; did you mean 'num_generations'",
                   "trl.prefetch_depth=0: write an integer >= 1", "trl.replay_buffer_size=8: a setting of Axolotl's "
                   "async GRPO", "with tp_size=2",
                   "sample_packing=True with rl: gdpo",
                   "datasets[0].type='chat_template' with rl: gdpo", "datasets[1].type='rwd_unit.missing_fn'"):
        assert needle in message, (needle, message)


def test_trl_without_grpo_and_transforms_without_it_are_refused(workspace):
    with pytest.raises(ConfigError) as err:
        load_train_config(_yaml(workspace, rl="dpo"), environ={})
    assert "trl: with rl: dpo" in str(err.value) and "datasets[0].type='rwd_unit.prompts' is not supported" in str(
        err.value)


def test_the_generation_batch_holds_whole_groups(workspace):
    cfg = load_train_config(_yaml(workspace, trl={"reward_funcs": ["rwd_unit.score"], "num_generations": 3}),
                            environ={})
    assert "not a multiple of trl.num_generations=3" in batch_problem(cfg, dp=2)  # 2 x 2 x 1 completions
    assert batch_problem(cfg, dp=3) is None


def _prepare(workspace, **keys):
    from nd_parallel.cli.train.data import load_prepared, prepare
    from nd_parallel.testing.models import make_text, save_tiny_model
    from nd_parallel.testing.tokenizer import train_tiny_tokenizer

    model = save_tiny_model("llama", workspace / "m", seed=1)
    train_tiny_tokenizer(make_text(40, seed=1)).save_pretrained(model)
    cfg = load_train_config(_yaml(workspace, base_model=str(model), **keys), environ={})
    return load_prepared(prepare(cfg, workspace / "work").path)[0]


def test_the_parent_runs_the_transform(workspace):
    rows = _prepare(workspace)
    assert len(rows) == 8 and rows[0]["prompt"] == [{"role": "user", "content": "question 0"}]
    for kind, needle in (("rwd_unit.broken", "failed on a record: KeyError"), ("rwd_unit.no_prompt", "no 'prompt'")):
        with pytest.raises(ConfigError, match=needle):
            _prepare(workspace, datasets=[{"path": str(workspace / "q.jsonl"), "type": kind}])


def test_a_local_dataset_folders_configuration(workspace):
    """``name`` on a dataset folder downloaded from the hub: its README.md configurations, or a subfolder."""
    from nd_parallel.cli.train.data.sources import DatasetSpec, load_source

    folder = workspace / "gsm8k"
    for config in ("main", "socratic"):
        (folder / config).mkdir(parents=True)
        (folder / config / "train.jsonl").write_text("".join(json.dumps({"q": f"{config} {i}"}) + "\n"
                                                             for i in range(10)))
    (folder / "README.md").write_text("# GSM8K\nA dataset card without configurations.\n")
    spec = DatasetSpec(path=str(folder), name="socratic", split="train[:40%]")
    rows, _ = load_source(spec, str(workspace / "cache"))  # no configurations in the README: the subfolder
    assert rows["q"] == [f"socratic {i}" for i in range(4)]
    configs = "".join(f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.jsonl\n"
                      for c in ("main", "socratic"))
    (folder / "README.md").write_text("---\nconfigs:\n" + configs + "---\n")
    rows, _ = load_source(DatasetSpec(path=str(folder), name="main", split="train[2:5]"), str(workspace / "cache"))
    assert rows["q"] == ["main 2", "main 3", "main 4"]
    with pytest.raises(ConfigError, match="'nope' not found"):
        load_source(DatasetSpec(path=str(folder), name="nope"), str(workspace / "cache"))
    with pytest.raises(ConfigError, match="not a dataset folder with that configuration"):
        load_source(DatasetSpec(path=str(workspace / "q.jsonl"), name="main"), str(workspace / "cache"))


def test_settings_read_like_axolotls_cfg():
    cfg = Settings({"trl": {"beta": 0.1}, "seed": 3})
    assert cfg.trl.beta == 0.1 and cfg.seed == 3 and cfg.missing is None
