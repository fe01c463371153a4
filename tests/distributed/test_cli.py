"""`nd-parallel demo` and `nd-parallel train` end to end, and the train YAML's refusals (no launch).

The two launched tests read numbers, not exit codes: the demo's table must show the parity it claims, and a
2-rank FSDP run with gradient accumulation must give, step by step, the loss of one process accumulating the
same micro-batches (global-token mean over the whole step), and a checkpoint that from_pretrained reloads.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nd_parallel.cli import load_train_config, main, parse_layout
from nd_parallel.config import ConfigError
from nd_parallel.loss import count_label_tokens
from nd_parallel.toy import make_text, save_tiny_model
from nd_parallel.train import build_samples, collate

CLI = [sys.executable, "-m", "nd_parallel.cli"]


def _cli(*args, timeout=300):
    proc = subprocess.run([*CLI, *args], check=False, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def _number(label: str, text: str) -> float:
    match = re.search(rf"^{re.escape(label)}\s+([-+0-9.e]+)", text, re.MULTILINE)
    assert match, f"no '{label}' row in:\n{text}"
    return float(match.group(1))


def test_demo_table_shows_parity():
    out = _cli("demo", "--steps", "4")
    assert _number("max loss rel diff", out) < 1e-5
    assert _number("max param abs diff", out) < 1e-5
    assert _number("max grad-norm rel diff", out) < 1e-5
    losses = re.search(r"^loss per step \(4\)\s+1-4:\s+(.+)$", out, re.MULTILINE).group(1).split()
    assert len(losses) == 4 and float(losses[-1]) < float(losses[0])
    # fsdp2 x tp2 shards every weight 4 ways (norm weights are only split over dp, hence the slack).
    shares = [float(s) for s in re.findall(r"^\s*(?:params \+ AdamW per rank)?\s*rank \d: .*\(([0-9.]+)% of", out,
                                           re.MULTILINE)]
    assert len(shares) == 4 and all(20 < s < 27 for s in shares), out


def _write_train_yaml(tmp_path: Path, **extra) -> Path:
    model = save_tiny_model("llama", tmp_path / "model", seed=1)
    lines = make_text(160, seed=3)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in lines))
    cfg = {"base_model": str(model), "datasets": [{"path": str(tmp_path / "data.jsonl"), "type": "completion",
                                                    "field": "body"}],
           "sequence_len": 40, "micro_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 4,
           "learning_rate": 1e-3, "weight_decay": 0.01, "lr_scheduler": "linear", "seed": 0,
           "output_dir": str(tmp_path / "out"), **extra}
    path = tmp_path / "train.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def _reference(cfg, dp: int):
    """One process, the same global micro-batches, loss = sum over the step's micro-batches of sum/N_step."""
    from transformers import AutoModelForCausalLM, get_scheduler

    samples, _ = build_samples(cfg.base_model, cfg.datasets, cfg.sequence_len)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(cfg.base_model, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    sched = get_scheduler(cfg.lr_scheduler, opt, num_warmup_steps=0, num_training_steps=cfg.max_steps)
    glob = cfg.micro_batch_size * dp
    micro = [collate(samples[i:i + glob]) for i in range(0, len(samples) - glob + 1, glob)]
    losses = []
    for step in range(cfg.max_steps):
        batches = micro[step * cfg.gradient_accumulation_steps:(step + 1) * cfg.gradient_accumulation_steps]
        n = sum(int(count_label_tokens(b["labels"])) for b in batches)
        total = 0.0
        for b in batches:
            loss = model(**b, num_items_in_batch=n).loss
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model


@pytest.mark.parametrize("layout,dp", [(dict(dp_shard_size=2), 2), (dict(pipeline_parallel_size=2), 1),
                                      (dict(context_parallel_size=2), 1)],
                         ids=["fsdp2", "pp2-tied", "cp2"])
def test_train_yaml_matches_single_process_with_accumulation(tmp_path, layout, dp):
    """FSDP2; PP2 of a tied Llama: the tied copies on the two stages must add only each accumulated call's
    gradient, or the embedding drifts from the second step on; CP2: the step's token count covers the rank's
    whole batch, which both cp ranks share, so it must be added over dp only, not over dp x cp."""
    from transformers import AutoModelForCausalLM

    path = _write_train_yaml(tmp_path, **layout)
    out = _cli("train", str(path))
    assert "2 CPU ranks" in out
    cfg = load_train_config(path)
    logged = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    ref_losses, ref_model = _reference(cfg, dp=dp)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in logged]), torch.tensor(ref_losses),
                               rtol=1e-5, atol=0)
    assert ref_losses[-1] < ref_losses[0]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    expected = ref_model.state_dict()
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=name)


# --------------------------------------------------------------------------------------- no launch
def _yaml(tmp_path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_unknown_key_suggests_the_closest(tmp_path):
    path = _yaml(tmp_path, "base_model: m\ndataset_path: d.txt\nlerning_rate: 1.0e-3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'lerning_rate' in .*cfg.yaml; did you mean 'learning_rate'"):
        load_train_config(path)
    path = _yaml(tmp_path, "base_model: m\ndataset_path: d.txt\ntensor_paralel_size: 2\n")
    with pytest.raises(ConfigError, match="did you mean 'tensor_parallel_size'"):
        load_train_config(path)


def test_missing_base_model(tmp_path):
    path = _yaml(tmp_path, "dataset_path: d.txt\nmax_steps: 3\n")
    with pytest.raises(ConfigError, match=r"cfg.yaml: base_model is required"):
        load_train_config(path)


@pytest.mark.parametrize("text,match", [("- base_model\n- m\n", "is a list; expected a mapping"),
                                        ("", "is empty; expected a mapping"),
                                        ("base_model: [m\n", "malformed YAML")])
def test_non_mapping_or_malformed_yaml(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_train_config(_yaml(tmp_path, text))


def test_python_tag_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    path = _yaml(tmp_path, f"base_model: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match=r"cfg.yaml, line 1: .*python/object/apply.*remove the tag"):
        load_train_config(path)
    assert not marker.exists()


def test_bad_values_and_cli_exit_code(tmp_path, capsys):
    path = _yaml(tmp_path, "base_model: m\ndataset_path: d.txt\nmicro_batch_size: 0\n")
    with pytest.raises(ConfigError, match="micro_batch_size=0 must be an integer >= 1"):
        load_train_config(path)
    path = _yaml(tmp_path, "base_model: m\ndataset_path: d.txt\ntp_size: 3\ndp_shard_size: two\n")
    with pytest.raises(ConfigError, match="dp_shard_size='two'"):
        load_train_config(path)
    path = _yaml(tmp_path, "base_model: m\nmax_steps: 3\n")
    assert main(["train", str(path)]) == 2
    assert "datasets" in capsys.readouterr().err


def test_layout_names():
    assert parse_layout("fsdp2_tp2") == {"dp_shard_size": 2, "tp_size": 2}
    assert parse_layout("hsdp2x2_tp2") == {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}
    assert parse_layout("ddp2") == {"dp_replicate_size": 2}
    assert parse_layout("fsdp_tp2") == {"dp_shard_size": -1, "tp_size": 2}
    with pytest.raises(ConfigError, match="cannot read 'zero3'"):
        parse_layout("zero3_tp2")


def test_pack_keeps_documents_whole_and_pads_right():
    from nd_parallel.train import pack

    samples = pack([[5, 6, 7], [8, 9], [1, 2, 3, 4, 5, 6, 7]], seq_len=5, pad_id=0)
    assert [s["input_ids"].tolist() for s in samples] == [[5, 6, 7, 8, 9], [1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert samples[2]["labels"].tolist() == [6, 7, -100, -100, -100]
    assert samples[2]["attention_mask"].tolist() == [1, 1, 0, 0, 0]


def test_samples_use_the_checkpoints_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from nd_parallel.train import DatasetSpec

    lines = make_text(50, seed=0)
    model = save_tiny_model("llama", tmp_path / "model")
    word_level = Tokenizer(models.WordLevel(unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", unk_token="<unk>",
                            eos_token="</s>").save_pretrained(model)
    (tmp_path / "d.txt").write_text("\n".join(lines[:3]) + "\n")
    samples, how = build_samples(str(model), [DatasetSpec(str(tmp_path / "d.txt"))], sequence_len=64)
    assert how.startswith("tokenizer of")
    ids = samples[0]["input_ids"].tolist()
    words = sum(len(line.replace(".", " .").split()) for line in lines[:3])
    assert ids.count(2) == 3 and ids[:words + 3].count(0) == 0  # one </s> per document, then <pad> (id 0)
    assert samples[0]["labels"].tolist()[words + 3:] == [-100] * (64 - words - 3)


def test_adopt_launcher_env_hands_the_layout_to_nd_parallel():
    from nd_parallel.train import adopt_launcher_env

    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
           "WORLD_SIZE": "4", "PARALLELISM_CONFIG_TP_SIZE": "2"}
    adopt_launcher_env(env)
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in env and env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false"
    assert env["PARALLELISM_CONFIG_TP_SIZE"] == "2"
    if not torch.cuda.is_available():
        assert env["ACCELERATE_USE_CPU"] == "true"


def test_train_yaml_bf16_and_gradient_checkpointing(tmp_path):
    """`bf16: true` + `gradient_checkpointing: true` under FSDP2 train end to end: the YAML keys map onto
    Accelerator(mixed_precision="bf16") and activation_checkpointing="full"; the saved weights are fp32 (the
    master copy), the loss falls."""
    from transformers import AutoModelForCausalLM

    path = _write_train_yaml(tmp_path, dp_shard_size=2, bf16=True, gradient_checkpointing=True)
    assert load_train_config(path).parallel.activation_checkpointing == "full"
    _cli("train", str(path))
    logged = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in logged) and logged[-1]["loss"] < logged[0]["loss"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(p.dtype == torch.float32 for p in reloaded.parameters())


@pytest.mark.parametrize("text,match", [("bf16: maybe\n", "bf16='maybe'; use true, false or auto"),
                                        ("gradient_checkpointing: full\n", "gradient_checkpointing='full'")])
def test_train_yaml_precision_keys_refused(tmp_path, text, match):
    path = _yaml(tmp_path, "base_model: m\ndataset_path: d.txt\n" + text)
    with pytest.raises(ConfigError, match=match):
        load_train_config(path)
