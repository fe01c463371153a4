"""Axolotl's diffusion plugin (cli/train/diffusion.py) in one process: which tokens are masked and by what draws,
the sample ids the 4-D mask is built from, the loss as Axolotl's DiffusionTrainer computes it, and the config stage.
FSDP2 / DDP against one process: tests/distributed/test_train_diffusion.py."""

from __future__ import annotations

import pytest
import torch

from nd_parallel import ParallelismConfig
from nd_parallel.cli.train import diffusion

PLUGIN = diffusion.PLUGIN


def test_sample_ids_restart_with_the_positions_and_padding_is_zero():
    rows = [{"input_ids": [5, 6, 7, 8, 9], "position_ids": [0, 1, 2, 0, 1]}, {"input_ids": [5, 6, 7]}]
    assert diffusion.segments(rows, 6).tolist() == [[1, 1, 1, 2, 2, 0], [1, 1, 1, 0, 0, 0]]


def test_a_rows_masking_depends_on_the_row_not_on_where_it_lands():
    """The same row draws the same masks alone, first or second in a batch (any layout sees what one process sees);
    another step draws others; padding, special tokens and unlabelled tokens are never masked."""
    a, b = torch.arange(10, 26).reshape(1, 16), torch.arange(40, 56).reshape(1, 16)
    labels = torch.cat([a, b]).clone()
    labels[:, :2] = -100
    ids = torch.cat([a, b])
    ids[1, 3] = 2  # a special token
    seg = torch.ones(2, 16, dtype=torch.long)
    seg[1, -2:] = 0  # padding
    args = dict(special={2}, eps=1e-3, seed=0)
    both, p = diffusion.noise(ids, labels, seg, step=1, **args)
    alone, _ = diffusion.noise(ids[1:], labels[1:], seg[1:], step=1, **args)
    swapped, _ = diffusion.noise(ids.flip(0), labels.flip(0), seg.flip(0), step=1, **args)
    assert torch.equal(both[1], alone[0]) and torch.equal(both, swapped.flip(0))
    assert not torch.equal(both, diffusion.noise(ids, labels, seg, step=2, **args)[0])
    assert not both[:, :2].any() and not both[1, 3] and not both[1, -2:].any()
    assert ((p > 0) & (p <= 1)).all() and (p[:, 0:1] == p).all()  # one noise level per row


def test_the_loss_is_axolotls_on_the_masked_tokens(monkeypatch, tmp_path):
    """With the masked positions fixed: cross-entropy of the masked tokens read from the shifted logits of the
    noised input under bidirectional attention, divided by p, summed per row over its labelled-token count, mean."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from nd_parallel.testing.models import save_tiny_model

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model("llama", tmp_path / "llama"), dtype=torch.float32)
    ids = torch.randint(10, 200, (2, 12))
    labels = ids.clone()
    labels[0, :3] = -100
    masked = torch.zeros(2, 12, dtype=torch.bool)
    masked[0, [4, 7]] = masked[1, [0, 5, 11]] = True
    p = torch.tensor([[0.3], [0.6]]).expand(2, 12)
    monkeypatch.setattr(diffusion, "noise", lambda *a, **k: (masked, p))
    trainer = SimpleNamespace(args=SimpleNamespace(seed=0), state=SimpleNamespace(global_step=0))
    inputs = {"input_ids": ids, "labels": labels, "sample_ids": torch.ones(2, 12, dtype=torch.long)}
    got = diffusion.compute_loss(trainer, model, dict(inputs), {"eps": 1e-3}, set(), mask_id=3)
    noised = torch.where(masked, torch.tensor(3), ids)
    with torch.no_grad():
        logits = model(input_ids=noised, attention_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool)).logits
    logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    want = []
    for row in range(2):
        where = masked[row].nonzero().flatten()
        ce = torch.nn.functional.cross_entropy(logits[row, where], ids[row, where], reduction="none")
        want.append((ce / p[row, where]).sum() / (labels[row] != -100).sum())
    assert got.item() == pytest.approx(torch.stack(want).mean().item(), rel=1e-6)


def _d(**block):
    return {"plugins": [PLUGIN], "diffusion": {"mask_token_id": 3, **block}}


@pytest.mark.parametrize("d,layout,needle", [
    ({"diffusion": {"mask_token_id": 3}}, None, "list axolotl.integrations.diffusion.DiffusionPlugin"),
    (_d(eps=2), None, "diffusion.eps=2"),
    (_d(eps="tiny"), None, "diffusion.eps='tiny'"),
    (_d(mask_token_id=None), None, "give mask_token_id"),
    (_d(sampler="x"), None, "sampler not keys of Axolotl's diffusion plugin"),
    ({**_d(), "rl": "dpo"}, None, "diffusion with rl"),
    (_d(), dict(tp_size=2), "diffusion with tp_size=2"),
    (_d(), dict(cp_size=2), "diffusion with cp_size=2"),
    ({**_d(), "attn_implementation": "flash_attention_2"}, None, "needs attn_implementation: sdpa or eager"),
    ({**_d(), "flash_attention": True}, None, "diffusion with flash_attention: its bidirectional 4-D"),
])
def test_what_cannot_run_is_refused_in_the_config_stage(d, layout, needle):
    out = diffusion.refusals(d, ParallelismConfig(**layout) if layout else ParallelismConfig(dp_shard_size=2))
    assert any(needle in line for line in out), out


def test_axolotls_example_block_is_read_as_axolotl_reads_it():
    d = _d(eps="5e-4", importance_weighting=True, noise_schedule="cosine", min_mask_ratio=0.15, max_mask_ratio=0.85,
           num_diffusion_steps=128, generate_samples=True, generation_interval=250)
    assert diffusion.refusals(d, ParallelismConfig(dp_shard_size=2)) == [] and d["diffusion"]["eps"] == 5e-4
    notes = diffusion.notes(d)
    assert sum("read by no Axolotl 0.19 training code" in n for n in notes) == 4
    assert any("generate_samples" in n for n in notes)


def test_the_mask_token_must_be_the_tokenizers():
    tok = type("T", (), {"__len__": lambda self: 100, "all_special_tokens": ["<s>", "<mask>"],
                         "convert_tokens_to_ids": lambda self, t: 7})()
    assert diffusion.mask_token(tok, {"mask_token_id": 42}) == 42
    assert diffusion.mask_token(tok, {"mask_token_id": 128002, "mask_token_str": "<mask>"}) == 7
    with pytest.raises(ValueError, match=r"mask_token_id=128002 .* is not a token of the tokenizer \(100 tokens\)"):
        diffusion.mask_token(tok, {"mask_token_id": 128002})
