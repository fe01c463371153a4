"""ebft mode: strided (cli/train/ebft_strided.py): its mask, position ids, block rewards and advantages equal Axolotl
0.19's own code (in its venv) on the same tensors; the log-probs its loss reads are those of the distribution each
rollout token was sampled from (Axolotl's shifted read is not); the two built-in transforms; the config stage."""

import contextlib
import json
import types
from pathlib import Path

import pytest
import torch

from nd_parallel.cli.train import ebft_strided as es
from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.data.ebft_types import TRANSFORMS
from nd_parallel.config import ConfigError
from tests.unit.axolotl_venv import run_in_axolotl

MASKS = [(20, 4, 0, 3, 4, 4), (20, 4, 2, 3, 4, 4), (20, 4, 3, 3, 4, 4), (24, 9, 3, 3, 5, 3), (13, 6, 2, 2, 1, 6)]
REWARDS = {  # name: settings beyond the defaults, documents
    "whitened_rloo": ({"use_whitening": True, "embed_method": "last_token", "n_samples_per_prompt": 3}, 2),
    "mean_group_norm": ({"embed_method": "mean_pooling", "advantage_estimator": "group_norm", "diversity_coef": 0.5,
                         "alignment_coef": 2.0, "n_samples_per_prompt": 3}, 2),
    "reinforce": ({"advantage_estimator": "reinforce", "n_samples_per_prompt": 2}, 3),
}


class Hidden(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        return types.SimpleNamespace(hidden_states=self.hidden)


def test_mask_positions_rewards_and_advantages_equal_axolotls(tmp_path):
    g = torch.Generator().manual_seed(0)
    length, gen, stride, anchor = 22, 3, 4, 5
    blocks = (length - gen - anchor) // stride + 1
    cases = {}
    for name, (extra, docs) in REWARDS.items():
        s = es.strided_settings({"generate_max_len": gen, "stride": stride, "context_length": anchor,
                                 "feature_layers": [0.25, 1.0], **extra})
        rows = docs * s["n_samples_per_prompt"]
        hidden = [torch.randn(rows, length + gen * blocks, 8, generator=g) for _ in range(5)]
        cases[name] = {"settings": {**s, "anchor": anchor}, "hidden": hidden, "indices": [1, 4], "docs": docs,
                       "blocks": blocks, "length": length}
    torch.save({"masks": MASKS, "rewards": cases}, tmp_path / "spec.pt")
    run_in_axolotl(str(Path(__file__).with_name("axolotl_ebft_strided_dump.py")), str(tmp_path / "spec.pt"),
                   str(tmp_path / "out.pt"))
    theirs = torch.load(tmp_path / "out.pt")
    for i, (length_, anchor_, steps, gen_, stride_, blocks_) in enumerate(MASKS):
        mask, positions = es.allowed(length_, anchor_, steps, gen_, stride_, blocks_)
        assert torch.equal(mask, theirs[f"mask_{i}"]), MASKS[i]
        assert torch.equal(positions, theirs[f"positions_{i}"]), MASKS[i]
    for name, case in cases.items():
        s = case["settings"]
        feats = es.features(Hidden(case["hidden"]), contextlib.nullcontext(), None, None, None, s["feature_layers"], 4)
        rolled, truth = es.block_embeddings(feats, length, anchor, blocks, s)
        rewards, _, _, cfm = es.block_rewards(rolled, truth, case["docs"], s)
        torch.testing.assert_close(rewards, theirs[f"rewards_{name}"], rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(es.advantages(rewards, s["advantage_estimator"]), theirs[f"advantages_{name}"],
                                   rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(cfm, theirs[f"cfm_{name}"], rtol=1e-5, atol=1e-5, msg=name)


def _tiny_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config).eval()


def test_the_loss_reads_the_log_probs_the_tokens_were_sampled_from(monkeypatch):
    """Generation samples token (step k, block b) from one position's logits; the training forward's log-prob of that
    token at ``sampled_from``'s position is the same distribution's. Axolotl's read (each token from the position
    before it in the appended layout) gives other numbers once there is more than one block."""
    model, s = _tiny_model(), es.strided_settings({"stride": 3, "context_length": 4, "generate_max_len": 3,
                                                   "temperature": 1.0})
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    blocks = (16 - 3 - 4) // 3 + 1
    seen, plain = [], es.sample

    def recording(logits, *args):
        seen.append(torch.log_softmax(logits.double(), -1))
        return plain(logits, *args)

    monkeypatch.setattr(es, "sample", recording)
    full = es.generate(model, ids, blocks, 4, s, ["a", "b"], seed=0, step=0)
    tokens = full[:, 16:].view(2, 3, blocks)
    sampled = torch.stack([seen[k].gather(-1, tokens[:, k, :, None]).squeeze(-1) for k in range(3)], 1)
    mask, positions = es.model_inputs(16, 4, 3, s, blocks, 2, torch.float32, ids.device)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=mask, position_ids=positions).logits
    ours = es._log_probs(logits[:, es.sampled_from(16, 4, 3, blocks, 3)], tokens)
    torch.testing.assert_close(ours.double(), sampled, rtol=0, atol=1e-4)
    shifted = es._log_probs(logits[:, 15:15 + 3 * blocks], full[:, 16:]).view(2, 3, blocks)
    assert (shifted.double() - sampled).abs().max() > 0.1


def test_the_same_keys_draw_the_same_rollouts():
    model, s = _tiny_model(), es.strided_settings({"stride": 3, "context_length": 4, "generate_max_len": 3,
                                                   "temperature": 0.7, "top_p": 0.8})
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    one = es.generate(model, ids, 4, 4, s, ["a", "b"], seed=0, step=3)
    torch.manual_seed(123)  # torch's global generator is not what draws
    assert torch.equal(one, es.generate(model, ids, 4, 4, s, ["a", "b"], seed=0, step=3))
    assert torch.equal(one[1:], es.generate(model, ids[1:], 4, 4, s, ["b"], seed=0, step=3))  # rows alone
    assert not torch.equal(one, es.generate(model, ids, 4, 4, s, ["a", "b"], seed=0, step=4))


def test_the_sampler_draws_the_warped_distribution():
    """4000 keyed draws of one block: each token's frequency is its probability after temperature and top-p (0.8)
    within 0.03, and tokens outside the nucleus are never drawn."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.0, -3.0]).expand(4000, 1, 6)
    s = es.strided_settings({"temperature": 0.7, "top_p": 0.8})
    drawn = es.sample(logits, s, list(range(4000)), seed=0, step=0).flatten()
    probs = torch.softmax(logits[0, 0] / 0.7, -1)
    kept = torch.cumsum(probs, 0) - probs < 0.8  # the nucleus: tokens before the mass reaches top_p, and that one
    want = torch.where(kept, probs, 0.0) / probs[kept].sum()
    got = torch.bincount(drawn, minlength=6).float() / 4000
    assert got[~kept].sum() == 0 and (got - want).abs().max() < 0.03, (got, want)


def test_the_builtin_transforms(tmp_path):
    from nd_parallel.testing.tokenizer import train_tiny_tokenizer

    tok = train_tiny_tokenizer(["one two three four five six seven eight nine ten"] * 20)
    cfg = types.SimpleNamespace(sequence_len=12)
    row, kwargs = TRANSFORMS["ebft_pretrain.transform"](cfg)
    out = row({"text": "one two three"}, tokenizer=tok)
    assert len(out["input_ids"]) == 12 and out["labels"] == out["input_ids"]
    assert out["input_ids"][-1] == tok.pad_token_id and kwargs == {"remove_columns": ["question", "answer"]}
    row, _ = TRANSFORMS["ebft_strided_structured.transform"](cfg)
    out = row({"input": "one two", "output": "three four five"}, tokenizer=tok)
    head = len(tok("one two")["input_ids"])
    assert out["prompt_length"] == head and len(out["input_ids"]) == 12
    assert out["labels"][:head] == [-100] * head and out["labels"][head] != -100 and out["labels"][-1] == -100
    long = row({"input": " ".join(["one"] * 30), "output": "two"}, tokenizer=tok)  # the prompt fills sequence_len
    assert long["prompt_length"] == 11 and long["labels"][11] != -100 and len(long["input_ids"]) == 12


def test_anchors_start_after_the_longest_prompt():
    s = es.strided_settings({"context_length": 4, "min_completion_prefix": 2})
    ids = torch.zeros(2, 20, dtype=torch.long)
    assert es.anchor_of({"input_ids": ids, "labels": ids}, s) == (4, False)  # raw documents: every token a label
    labels = torch.full((2, 20), -100)
    labels[0, 7:], labels[1, 3:] = 1, 1
    assert es.anchor_of({"input_ids": ids, "labels": labels}, s) == (9, True)
    assert es.anchor_of({"input_ids": ids, "prompt_length": torch.tensor([1, 1])}, s) == (4, True)


def _yaml(tmp_path, **keys):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "a b c"}) + "\n")
    cfg = {"base_model": "./m", "rl": "ebft", "micro_batch_size": 1, "sequence_len": 64,
           "datasets": [{"path": str(tmp_path / "d.jsonl"), "type": "ebft_pretrain.transform"}],
           "ebft": {"mode": "strided", "stride": 8, "context_length": 8, "generate_max_len": 8,
                    "n_samples_per_prompt": 4, "use_whitening": True, "rl_coef": 1.0, "ce_coef": 0.0,
                    "advantage_estimator": "rloo"}, **keys}
    (tmp_path / "c.yml").write_text(json.dumps(cfg))
    return tmp_path / "c.yml"


def test_strided_config_stage(tmp_path):
    from nd_parallel.cli.train.grpo import batch_problem

    cfg = load_train_config(_yaml(tmp_path, attn_implementation="flash_attention_2"), environ={})
    notes = "\n".join(cfg.notes)
    for needle in ("log-prob is read at the position it was sampled from", "the model runs SDPA"):
        assert needle in notes, (needle, notes)
    assert batch_problem(cfg, dp=2) is None  # rollouts are per document: no group rule
    bad = {"mode": "strided", "stride": 0, "advantage_estimator": "ppo", "top_p": 1.5, "embed_method": "concat",
           "min_completion_prefix": -1}
    with pytest.raises(ConfigError) as err:
        load_train_config(_yaml(tmp_path, ebft=bad, tensor_parallel_size=2), environ={})
    for needle in ("ebft.stride=0", "ebft.advantage_estimator='ppo'", "ebft.top_p=1.5",
                   "ebft.embed_method='concat' with mode: strided", "ebft.min_completion_prefix=-1",
                   "rl: ebft with tp_size=2"):
        assert needle in str(err.value), (needle, str(err.value))


def test_a_micro_batch_too_short_for_a_block_trains_nothing_and_makes_the_same_forwards():
    """Anchors after a long prompt leave no block: the loss is 0 (on the graph, so every rank backs), no metrics,
    and the model still runs generate_max_len + 1 forwards (the feature network's under LoRA: + 1) as the other
    ranks' FSDP gathers expect."""
    model = _tiny_model()
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(unwrap_model=lambda m: m),
                                    args=types.SimpleNamespace(seed=0), state=types.SimpleNamespace(global_step=0))
    s = es.strided_settings({"stride": 2, "context_length": 2, "generate_max_len": 3})
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, metrics = es.strided_loss(trainer, model, {"input_ids": ids, "prompt_length": torch.tensor([10, 4])}, s,
                                    frozen=model)
    assert loss.item() == 0 and loss.requires_grad and metrics == {} and len(calls) == 3 + 1
