"""`nd-parallel train` on the issue's real-world Axolotl LoRA YAML (test_train_yaml.REAL_WORLD: alpaca, LoRA, sample
packing, val_set_size, evals_per_epoch, gradient_checkpointing, bf16: auto, fsdp_config, dp_shard_size: 2, empty
wandb_* keys, special_tokens), end to end through the CLI on two CPU ranks: the summary table, one train_log.jsonl
line per step, evaluation, sharded checkpoints through the Trainer (save_steps: 2), and an adapter that PEFT loads."""

import json
import re
import subprocess
import sys

import torch

from tests.distributed.train_yaml_helpers import logged, write_model_and_data
from tests.unit.test_train_yaml import real_world


def test_real_world_axolotl_lora_yaml_trains_and_its_adapter_loads_in_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = write_model_and_data(tmp_path, n=40)
    path = real_world(tmp_path, data, saves_per_epoch="", save_steps="2")
    proc = subprocess.run([sys.executable, "-m", "nd_parallel.cli", "train", path], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = tmp_path / "out"
    table = proc.stdout
    assert re.search(r"^layout\s+pp=1 dp_replicate=1 dp_shard=2 .*2 CPU ranks", table, re.MULTILINE), table
    assert re.search(r"^not used\s+.*wandb_project", table, re.MULTILINE), table
    assert "accepted, not used:" in table
    steps = logged(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    assert logged(out, "eval_log.jsonl"), "evals_per_epoch: 2 evaluated nothing"
    for step in (2, 4):  # the Trainer's checkpoints, sharded by nd_parallel (loadable under another layout)
        assert (out / f"checkpoint-{step}" / "nd_parallel" / "nd_parallel.json").is_file()
        assert json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())["global_step"] == step
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(data["model"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and max(p.abs().max().item() for p in lora_b) > 0  # trained (B starts at zero)
    ids = torch.tensor([[2, 40, 41, 42]])
    assert torch.isfinite(model(input_ids=ids).logits).all()
