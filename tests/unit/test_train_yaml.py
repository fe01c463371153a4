"""`nd-parallel train`'s Axolotl YAML and data pipeline, in one process (no ranks): key sorting, refusals in one
message, fsdp_config mapping, the Trainer's arguments, the record formats, packing, caching, and bad input caught
before any rank starts with the file, the record and the fix."""

import json
import re

import pytest
import torch

from nd_parallel.cli.main import main
from nd_parallel.cli.train.config import load_train_config
from nd_parallel.config import ConfigError
from tests.distributed.train_yaml_helpers import chat_entry, write_model_and_data, write_yaml

# The "typical Axolotl LoRA YAML", keys as users write them.
REAL_WORLD = """
base_model: {model}
model_type: LlamaForCausalLM
tokenizer_type: AutoTokenizer
datasets:
  - path: {alpaca}
    ds_type: json
    type: alpaca
dataset_prepared_path:
val_set_size: 0.1
output_dir: {out}
adapter: lora
lora_model_dir:
lora_r: 4
lora_alpha: 8
lora_dropout: 0.0
lora_target_linear: true
sample_packing: true
pad_to_sequence_len: true
sequence_len: 200
wandb_project:
wandb_entity:
wandb_watch:
wandb_name:
wandb_log_model:
gradient_accumulation_steps: 2
micro_batch_size: 2
num_epochs: 1
max_steps: 4
optimizer: adamw_torch
lr_scheduler: cosine
learning_rate: 0.002
train_on_inputs: false
group_by_length: false
bf16: auto
fp16:
tf32: false
gradient_checkpointing: true
early_stopping_patience:
resume_from_checkpoint:
logging_steps: 1
xformers_attention:
flash_attention: false
warmup_steps: 1
evals_per_epoch: 2
saves_per_epoch: 1
weight_decay: 0.0
fsdp_version: 2
fsdp_config:
  reshard_after_forward: true
  state_dict_type: FULL_STATE_DICT
  auto_wrap_policy: TRANSFORMER_BASED_WRAP
  transformer_layer_cls_to_wrap: LlamaDecoderLayer
dp_shard_size: 2
special_tokens:
  pad_token: "<pad>"
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_model_and_data(tmp_path_factory.mktemp("yaml_data"), n=40)


def real_world(tmp_path, data, **replace) -> str:
    text = REAL_WORLD.format(model=data["model"], alpaca=data["alpaca"], out=tmp_path / "out")
    for key, value in replace.items():
        line = re.compile(rf"^{key}:.*$", re.MULTILINE)
        text = line.sub(f"{key}: {value}", text, count=1) if line.search(text) else text + f"{key}: {value}\n"
    path = tmp_path / "axolotl.yml"
    path.write_text(text)
    return str(path)


def test_real_world_yaml_is_read_with_axolotls_meaning(tmp_path, data):
    cfg = load_train_config(real_world(tmp_path, data))
    assert cfg.adapter == "lora" and cfg.lora_target_linear and cfg.sample_packing and cfg.val_set_size == 0.1
    assert cfg.parallel.dp_shard_size == 2 and cfg.parallel.activation_checkpointing == "full"
    assert {"wandb_project", "wandb_entity"} <= set(cfg.unused) and cfg.group_by_length is False
    assert cfg.early_stopping_patience is None  # left empty: no early stopping
    assert cfg.attn_implementation is None  # flash_attention: false / xformers_attention: (empty) choose nothing
    from nd_parallel.cli.train.job import trainer_arguments

    args = trainer_arguments(cfg, "x", train_rows=40, eval_rows=4, dp=2)
    # 40 rows over 2 dp ranks, 2 per micro-batch, 2 micro-batches per step: 5 steps per epoch
    assert args["eval_strategy"] == "steps" and args["eval_steps"] == 2
    assert args["save_strategy"] == "steps" and args["save_steps"] == 5
    assert args["bf16"] is False and args["logging_steps"] == 1 and args["warmup_steps"] == 1


def test_keys_that_change_training_are_refused_together(tmp_path, data):
    path = real_world(tmp_path, data, flash_attention="true", s2_attention="true", optimizer="lion_8bit")
    text = open(path).read() + "load_in_4bit: true\ndeepspeed: deepspeed_configs/zero3.json\nrl: dpo\n"
    open(path, "w").write(text)  # adapter: lora with load_in_4bit: Axolotl's rule asks for qlora
    with pytest.raises(ConfigError) as err:
        load_train_config(path)
    message = str(err.value)
    assert "6 setting(s) cannot be used" in message, message
    for needle in ("s2_attention=True", "load_in_4bit=True with adapter='lora'",
                   "deepspeed and fsdp/fsdp_config are both set", "sample_packing=True with rl: dpo",
                   "datasets[0].type='alpaca' with rl: dpo", "set adapter: qlora",
                   "optimizer='lion_8bit': use one of adamw_torch"):
        assert needle in message, (needle, message)


@pytest.mark.parametrize("fsdp,match", [("  reshard_after_forward: false\n", "drop reshard_after_forward: false"),
                                        ("  sharding_strategy: HYBRID_SHARD\n", "dp_replicate_size and dp_shard"),
                                        ("  mystery: 1\n", "fsdp_config.mystery")])
def test_fsdp_config_refused_with_the_reason(tmp_path, data, fsdp, match):
    path = real_world(tmp_path, data)
    text = open(path).read().replace("  reshard_after_forward: true\n", "")  # a repeated key: YAML keeps the last
    open(path, "w").write(text.replace("fsdp_config:\n", "fsdp_config:\n" + fsdp))
    with pytest.raises(ConfigError, match=match):
        load_train_config(path)


@pytest.mark.parametrize("keys,expect", [
    ({"fsdp_config": {"offload_params": True, "cpu_offload_pin_memory": False}}, {"fsdp_offload_params": True}),
    ({"gradient_checkpointing": "offload"}, {"activation_checkpointing": "full", "activation_offloading": True}),
    ({"activation_offloading": "legacy"}, {"activation_offloading": True, "activation_checkpointing": None}),
    ({"activation_offloading": True, "gradient_checkpointing": True}, {"activation_offloading": True}),
    ({"tiled_mlp": True, "tiled_mlp_num_shards": 4, "tiled_mlp_use_original_mlp": True},
     {"tiled_mlp": True, "tiled_mlp_num_shards": 4}),
])
def test_memory_keys_map_onto_the_memory_options(tmp_path, data, keys, expect):
    path = write_yaml(tmp_path / "m.yml", {"base_model": data["model"], "datasets": [data["text"]], **keys})
    layout = load_train_config(path).parallel
    assert {k: getattr(layout, k) for k in expect} == expect


@pytest.mark.parametrize("keys,match", [
    ({"gradient_checkpointing": "offload_disk"}, r"gradient_checkpointing='offload_disk': .*use gradient_checkpointing: "
                                                 "offload"),
    ({"activation_offloading": "disk"}, r"activation_offloading='disk': .*use activation_offloading: true"),
    ({"tiled_mlp": True, "tiled_mlp_use_original_mlp": False}, r"tiled_mlp_use_original_mlp=False: the model's own"),
    ({"tiled_mlp_num_shards": 2}, r"tiled_mlp_num_shards=2 without tiled_mlp=True"),
])
def test_memory_keys_we_cannot_honour_are_refused(tmp_path, data, keys, match):
    path = write_yaml(tmp_path / "m.yml", {"base_model": data["model"], "datasets": [data["text"]], **keys})
    with pytest.raises(ConfigError, match=match):
        load_train_config(path)


def test_qlora_keys_are_read(tmp_path, data):
    path = write_yaml(tmp_path / "q.yml", {"base_model": data["model"], "datasets": [data["text"]], "adapter": "qlora",
                                          "load_in_4bit": True, "optimizer": "paged_adamw_8bit",
                                          "bnb_config_kwargs": {"bnb_4bit_quant_type": "nf4",
                                                                "bnb_4bit_compute_dtype": "torch.float32"}})
    cfg = load_train_config(path)
    assert cfg.adapter == "qlora" and cfg.load_in_4bit and cfg.optimizer == "paged_adamw_8bit"
    from nd_parallel.cli.train.rank import _quantization

    q = _quantization(cfg)["quantization_config"]
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype == torch.float32


def test_load_in_8bit_with_lora_reads_into_an_int8_quantization(tmp_path, data):
    """Axolotl's 8-bit LoRA: load_in_8bit + adapter: lora -> LLM.int8 (parity rows: tests/distributed/test_qlora.py)."""
    path = write_yaml(tmp_path / "q8.yml", {"base_model": data["model"], "datasets": [data["text"]], "adapter": "lora",
                                           "load_in_8bit": True, "dp_shard_size": 2})
    cfg = load_train_config(path)
    assert cfg.adapter == "lora" and cfg.load_in_8bit and not cfg.load_in_4bit
    from nd_parallel.cli.train.rank import _quantization

    assert _quantization(cfg)["quantization_config"].load_in_8bit


@pytest.mark.parametrize("keys,match", [
    ({"adapter": "lora", "load_in_4bit": True}, r"load_in_4bit=True with adapter='lora': .*set adapter: qlora"),
    ({"adapter": "qlora"}, r"adapter='qlora' without load_in_4bit: true"),
    ({"load_in_4bit": True}, r"load_in_4bit=True with adapter=None"),
    ({"adapter": "qlora", "load_in_4bit": True, "load_in_8bit": True},
     r"load_in_8bit=True with adapter='qlora' and load_in_4bit: .*not both"),
    ({"load_in_8bit": True}, r"load_in_8bit=True with adapter=None: .*set adapter: lora"),
    ({"adapter": "lora", "load_in_8bit": True, "tensor_parallel_size": 2},
     r"load_in_8bit=True with tensor_parallel_size=2: .*load_in_4bit with adapter: qlora under TP"),
    ({"adapter": "qlora", "load_in_4bit": True, "bnb_config_kwargs": {"bnb_4bit_quant_type": "int3"}},
     r"bnb_config_kwargs.bnb_4bit_quant_type='int3': use one of nf4, fp4"),
    ({"adapter": "qlora", "load_in_4bit": True, "bnb_config_kwargs": {"llm_int8_threshold": 6}},
     r"bnb_config_kwargs.llm_int8_threshold: not a 4-bit setting"),
])
def test_quantization_keys_we_cannot_honour_are_refused(tmp_path, data, keys, match):
    path = write_yaml(tmp_path / "q.yml", {"base_model": data["model"], "datasets": [data["text"]], **keys})
    with pytest.raises(ConfigError, match=match):
        load_train_config(path)


def test_fsdp_without_sizes_shards_over_every_rank(tmp_path, data):
    path = write_yaml(tmp_path / "f.yml", {"base_model": data["model"], "datasets": [data["text"]],
                                          "fsdp_config": {"activation_checkpointing": True}, "fsdp_version": 2})
    cfg = load_train_config(path)
    assert cfg.parallel.dp_shard_size == -1 and cfg.parallel.activation_checkpointing == "full"


def test_job_file_round_trip_is_exact(tmp_path, data):
    """The JSON the parent writes reads back, on every rank, into the same typed jobs (floats, None, lists)."""
    import dataclasses

    from nd_parallel.cli.train.job import DemoJob, Job, TrainJob, build_job, read_jobs, write_jobs
    from nd_parallel.testing.parity import Recipe

    cfg = load_train_config(real_world(tmp_path, data, warmup_ratio=0.1, lora_target_modules="[q_proj, v_proj]"))
    layout = dataclasses.replace(cfg.parallel.resolve(2), pp_profile_shape=(1, 64), tp_plan={"mlp.*": None})
    train, _ = build_job("axolotl.yml", cfg, layout, str(tmp_path / "work"))
    assert isinstance(train, TrainJob) and train.train is cfg and train.trainer_args["learning_rate"] == 0.002
    demo = DemoJob(name="fsdp2", layout=layout, model_dir="m", samples="s.pt", results="r.pt",
                   recipe=Recipe(steps=3, lr=1e-3, eval_at=(1, 2)))
    for jobs in ([train], [train, demo]):
        write_jobs(tmp_path / "job.json", jobs)
        text = (tmp_path / "job.json").read_text()
        assert read_jobs(tmp_path / "job.json") == jobs
        write_jobs(tmp_path / "job.json", read_jobs(tmp_path / "job.json"))
        assert (tmp_path / "job.json").read_text() == text
    assert Job.from_json(json.loads(json.dumps(demo.to_json()))).recipe.eval_at == (1, 2)
    with pytest.raises(ValueError, match="job kind 'eval'"):
        Job.from_json({"kind": "eval"})


# ------------------------------------------------------------------------------------------------ data
def _prepare(tmp_path, data, **keys):
    from nd_parallel.cli.train.data import load_prepared, prepare

    cfg = load_train_config(write_yaml(tmp_path / "d.yml", {"base_model": data["model"], **keys}))
    prepared = prepare(cfg, tmp_path / "work")
    return (prepared, *load_prepared(prepared.path))


@pytest.mark.parametrize("eot,option,want", [
    (None, "turn", "{a}{b}"),  # Axolotl: eot_tokens default to eos_token (</s>), which ChatML never writes
    (["<|im_end|>"], "turn", "{a}<|im_end|>{b}<|im_end|>"),
    (["<|im_end|>"], "last", "{a}{b}<|im_end|>"),
    (["<|im_end|>"], "none", "{a}{b}")])
def test_chat_template_trains_on_assistant_turns_only(tmp_path, data, eot, option, want):
    entry = {**chat_entry(data["chat"]), "train_on_eos": option}
    _, train, _, tok = _prepare(tmp_path, data, datasets=[entry], sequence_len=256, eot_tokens=eot)
    row = train[0]
    trained = tok.decode([t for t, lab in zip(row["input_ids"], row["labels"]) if lab != -100])
    first = json.loads(open(data["chat"]).readline())["conversations"]
    assert trained == want.format(a=first[2]["value"], b=first[4]["value"])


def test_alpaca_prompt_is_not_trained_and_packing_restarts_positions(tmp_path, data):
    alpaca = {"path": data["alpaca"], "type": "alpaca"}
    _, rows, _, tok = _prepare(tmp_path, data, datasets=[alpaca], sequence_len=256)
    assert "### Response:" in tok.decode(rows[0]["input_ids"]) and rows[0]["labels"][0] == -100
    text = {"path": data["text"], "type": "completion"}
    _, rows, _, _ = _prepare(tmp_path, data, datasets=[text], sequence_len=256)
    _, packed, _, _ = _prepare(tmp_path, data, datasets=[text], sequence_len=256, sample_packing=True)
    assert len(packed) < len(rows) and all(len(r["input_ids"]) <= 256 for r in packed)
    pos, labels = packed[0]["position_ids"], packed[0]["labels"]
    starts = [i for i, p in enumerate(pos) if p == 0]
    assert len(starts) >= 2 and all(labels[i] == -100 for i in starts)
    from nd_parallel.cli.train.data import Collator

    batch = Collator(0, pad_to=256)([packed[0]])
    assert batch["position_ids"].shape == (1, 256) and "attention_mask" not in batch


def test_prepared_data_is_cached_and_pretraining_is_cut_into_blocks(tmp_path, data):
    keys = dict(datasets=[{"path": data["text"], "type": "pretraining"}], sequence_len=32,
                dataset_prepared_path=str(tmp_path / "prepared"))
    first, rows, _, _ = _prepare(tmp_path, data, **keys)
    again, _, _, _ = _prepare(tmp_path, data, **keys)
    assert not first.cached and again.cached and again.path == first.path
    assert all(len(r["input_ids"]) == 32 for r in rows.select(range(len(rows) - 1)))


def test_checkpoint_without_tokenizer_uses_bytes(tmp_path):
    from nd_parallel.testing.models import save_tiny_model

    model = save_tiny_model("llama", tmp_path / "m")
    (tmp_path / "t.txt").write_text("hello\nworld\n")
    prepared, rows, _, tok = _prepare(tmp_path, {"model": str(model)}, dataset_path=str(tmp_path / "t.txt"),
                                     sequence_len=64)
    assert prepared.tokenizer_how.startswith("byte-level") and rows[0]["input_ids"] == list(b"hello") + [1]


# ------------------------------------------------------------------------------------------------ bad input
def _bad(tmp_path, data, records=None, name="bad.jsonl", entry=None, **keys):
    if records is not None:
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    entry = entry or {"path": str(tmp_path / name), "type": "alpaca"}
    path = write_yaml(tmp_path / "bad.yml", {"base_model": data["model"], "datasets": [entry], "sequence_len": 256,
                                            "output_dir": str(tmp_path / "model-out"), **keys})
    return path


@pytest.mark.parametrize("case", ["missing_file", "missing_field", "unknown_role", "too_long", "empty"])
def test_bad_input_stops_before_any_rank_with_file_record_and_fix(tmp_path, data, capsys, case):
    good = {"instruction": "a", "input": "", "output": "b"}
    if case == "missing_file":
        path = _bad(tmp_path, data, entry={"path": str(tmp_path / "nowhere.jsonl"), "type": "completion"})
        want = [f"dataset file '{tmp_path / 'nowhere.jsonl'}' does not exist", "fix the path"]
    elif case == "missing_field":
        path = _bad(tmp_path, data, [good, good, good, {"instruction": "a", "answer": "b"}])
        want = [f"{tmp_path / 'bad.jsonl'}, record 3: no 'output' field (it has instruction, answer)",
                "alpaca records need instruction, output"]
    elif case == "unknown_role":
        turns = [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "..."}]
        path = _bad(tmp_path, data, [{"messages": turns[:1]}, {"messages": turns}],
                    entry={"path": str(tmp_path / "bad.jsonl"), "type": "chat_template"})
        want = [f"{tmp_path / 'bad.jsonl'}, record 1, turn 1: role 'narrator' is not one the chat template knows",
                "roles: {assistant: [assistant, narrator]}"]
    elif case == "too_long":
        path = _bad(tmp_path, data, [good], sequence_len=4096)
        want = ["sequence_len=4096 is beyond the model's max_position_embeddings=256", "use sequence_len <= 256"]
    else:
        path = _bad(tmp_path, data, [{"instruction": "x " * 300, "input": "", "output": "y"}] * 3, sequence_len=64)
        want = [f"{tmp_path / 'bad.jsonl'}: none of its 3 records is left", "raise sequence_len"]
    assert main(["train", str(path), "--cpu"]) == 2
    err = capsys.readouterr().err
    for needle in want:
        assert needle in err, (needle, err)
    assert not (tmp_path / "model-out").exists()  # stopped in the parent: no rank started, nothing written


def test_tokens_as_a_mapping_is_refused_not_added_by_its_key_names(tmp_path, data):
    """Older Axolotl examples write special tokens under `tokens:` as a mapping; adding that "list" would have added
    the key names ('pad_token', ...) as new tokens. Axolotl 0.19 refuses it too; the fix names special_tokens."""
    path = real_world(tmp_path, data)
    open(path, "a").write("tokens:\n  pad_token: '<pad>'\n")
    with pytest.raises(ConfigError, match=r"tokens=\{'pad_token': '<pad>'\}; write a list of strings of new tokens .*special_tokens:"):
        load_train_config(path)
