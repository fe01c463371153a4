"""`fix_untrained_tokens` through `nd-parallel train` (cli/train/embeddings.py; the rows themselves equal Axolotl's
own function in tests/unit/test_untrained_tokens.py): a tiny Llama whose rows of three tokens of the data are zero
(untrained), full fine-tuning. The rows are fixed on every rank on the whole model before the layout, so FSDP2 and
DDP equal one process (every loss, every saved tensor), and the run differs from the same YAML without the key.
Tolerance: only fp32 reduction order differs: loss rtol 1e-5, saved tensors atol 1e-5."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.distributed.train_yaml_helpers import compare_runs, run_rows, saved_tensors, write_model_and_data

BASE = dict(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=3, learning_rate=2e-3, lr_scheduler="linear",
            seed=0, optimizer="adamw_torch", adam_epsilon=1e-6, sequence_len=64, val_set_size=0.0)
LAYOUTS = {"fsdp2": {"dp_shard_size": 2}, "ddp": {"dp_replicate_size": 2}}


def _zero_rows(data: dict) -> list[int]:
    """Zero the embedding rows (tied lm_head) of three tokens of the first text: untrained tokens of the data."""
    from pathlib import Path

    from transformers import AutoTokenizer

    model = Path(data["model"])
    text = json.loads(Path(data["text"]).read_text().splitlines()[0])["text"]
    ids = sorted(set(AutoTokenizer.from_pretrained(model)(text, add_special_tokens=False)["input_ids"]))[:3]
    [file] = model.glob("*.safetensors")
    tensors = load_file(str(file))
    for name, value in tensors.items():
        if "embed_tokens" in name or "lm_head" in name:
            value[ids] = 0
    save_file(tensors, str(file), metadata={"format": "pt"})
    return ids


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("untrained_tokens")
    data = write_model_and_data(root, n=48)
    ids = _zero_rows(data)
    common = {**BASE, "base_model": data["model"], "dataset_prepared_path": str(root / "prepared"),
              "datasets": [{"path": data["text"], "type": "completion"}], "fix_untrained_tokens": True}
    # still: a learning rate too small to move a float32 weight (AdamW steps by ~lr): the weights as the fix left them
    rows = {"fix": common, "still": {**common, "learning_rate": 1e-30}}
    off = {row: {"fix_untrained_tokens": None} for row in rows}
    return run_rows(root, rows, LAYOUTS, {"micro_batch_size": 4}, off, {"still": []}), ids


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fixed_rows_train_the_same_under_each_layout(runs, layout):
    root, _ = runs
    compare_runs(root / f"fix_{layout}", root / "fix_ref", rtol=1e-5, atol=1e-5, label=f"fix_untrained_tokens {layout}")


def test_the_rows_were_fixed(runs, tmp_path):
    """At learning rate 1e-30 the saved model is the loaded one after the fix: the zero rows hold what
    models/untrained_tokens.py computes from the training rows (and they are no longer 0); without the key they stay 0,
    and every other row is the checkpoint's."""
    from transformers import AutoModelForCausalLM

    from nd_parallel.cli.train.config import load_train_config
    from nd_parallel.cli.train.data import load_prepared, prepare
    from nd_parallel.models.untrained_tokens import fix_untrained_tokens

    root, ids = runs
    cfg = load_train_config(root / "still_ref.yaml")
    train, _, tokenizer = load_prepared(prepare(cfg, tmp_path).path)
    want = AutoModelForCausalLM.from_pretrained(cfg.base_model, dtype=torch.float32)
    base = want.get_input_embeddings().weight.detach().clone()
    assert fix_untrained_tokens(want, tokenizer, train["input_ids"]) == ids
    got, plain = saved_tensors(root / "still_ref"), saved_tensors(root / "still_plain")
    [key] = [k for k in got if "embed_tokens" in k]
    torch.testing.assert_close(got[key], want.get_input_embeddings().weight.detach(), rtol=0, atol=1e-28)
    torch.testing.assert_close(plain[key], base, rtol=0, atol=1e-28)
    assert got[key][ids].abs().amax(dim=1).min() > 1e-5 and plain[key][ids].abs().max() < 1e-28
