"""Axolotl's keys with Axolotl's meanings, read by `nd-parallel train` in one process (no ranks): every test YAML
under tests/axolotl_configs/ passes the config stage; attention, DeepSpeed, FSDP1, plugin keys are mapped; the
named chat templates train the tokens Axolotl trains; refusals (all of them) come in one message."""

import json
import shutil
from pathlib import Path

import pytest

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.config import ConfigError
from tests.distributed.train_yaml_helpers import write_model_and_data, write_yaml

CONFIGS = Path(__file__).resolve().parent.parent / "axolotl_configs"
YAMLS = sorted(CONFIGS.glob("*.yml"))


@pytest.mark.parametrize("path", YAMLS, ids=[p.stem for p in YAMLS])
def test_every_test_yaml_passes_the_config_stage(path):
    cfg = load_train_config(path, environ={})
    assert cfg.datasets and cfg.max_steps == 2


def test_attention_keys_resolve_with_one_line_on_cpu():
    by_name = {p.stem: load_train_config(p, environ={}) for p in YAMLS}
    llama = by_name["llama3_lora_fsdp2"]  # attn_implementation: flash_attention_2 on a CPU machine
    assert llama.attn_implementation == "sdpa"
    assert any(n.startswith("attention: flash_attention_2 needs a CUDA kernel") for n in llama.notes)
    assert any("Liger's Triton kernels need a GPU" in n for n in llama.notes)
    assert by_name["mistral_fsdp1_alpaca"].attn_implementation == "sdpa"  # flash_attention: true (older key)
    assert by_name["gemma_chat_fsdp2"].attn_implementation == "eager"
    qwen3 = by_name["qwen3_chat_tp2"]
    assert any("use_reentrant=true" in n for n in qwen3.notes) and qwen3.parallel.tp_size == 2


def test_sdpa_becomes_eager_where_the_model_has_no_sdpa_path(tmp_path):
    """flash_attention_2 without CUDA becomes SDPA, which Gemma2 (soft-capped attention) does not have: the ranks
    load it with eager attention, as transformers' default does, instead of stopping at load (Axolotl's
    examples/gemma2/qlora.yml)."""
    from nd_parallel.cli.train.extras import attention_for
    from nd_parallel.testing.models import save_tiny_model

    gemma2, llama = save_tiny_model("gemma2", tmp_path / "gemma2"), save_tiny_model("llama", tmp_path / "llama")
    assert attention_for(str(gemma2), "sdpa", {}) == "eager"
    assert attention_for(str(llama), "sdpa", {}) == "sdpa"
    assert attention_for(str(gemma2), "eager", {}) == "eager"


def test_deepspeed_and_fsdp1_map_to_fsdp2():
    by_name = {p.stem: load_train_config(p, environ={}) for p in YAMLS}
    for name in ("gemma3_chat_zero3", "gemma3n_template", "phi3_chat_zero2", "mistral_fsdp1_alpaca"):
        assert by_name[name].parallel.dp_shard_size == -1, name
    assert any("ZeRO-3 mapped to FSDP2" in n for n in by_name["gemma3_chat_zero3"].notes)
    assert by_name["mistral_fsdp1_alpaca"].parallel.activation_checkpointing == "full"
    # transformer_layer_cls_to_wrap is kept to be checked against the model (job.check_local_model)
    assert by_name["qwen3_moe_qlora_experts"].fsdp_wrap_classes == ["Qwen3MoeDecoderLayer"]


def _write(tmp_path, extra: str) -> Path:
    path = tmp_path / "c.yml"
    path.write_text("base_model: ./m\ndatasets:\n  - path: ./d.jsonl\n    type: chat_template\n" + extra)
    return path


def test_every_refusal_comes_in_one_message(tmp_path):
    """Keys, values, fsdp_config, deepspeed and datasets entries: one ConfigError lists all, each with its fix."""
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "optimizer": {"type": "Lion"}}))
    path = tmp_path / "c.yml"
    path.write_text(f"""base_model: ./m
chat_template: vicuna_v9
liger_rope: true
expert_parallel_size: 2
optimizer: lion
deepspeed: {tmp_path / 'ds.json'}
gradient_checkpointing_kwargs: {{preserve_rng_state: false}}
datasets:
  - path: ./d.jsonl
    type: chat_template
    split: train[:x]
    train_on_eos: sometimes
""")
    with pytest.raises(ConfigError) as err:
        load_train_config(path, environ={})
    message = str(err.value)
    for needle in ("chat_template='vicuna_v9' is not a chat template nd-parallel train knows", "chatml, cohere",
                   "unknown key 'liger_rope'", "plugin axolotl.integrations.liger.LigerPlugin",
                   "unknown key 'expert_parallel_size'", "optimizer='lion'", "split='train[:x]' is not a split",
                   "sets optimizer, which nd_parallel has no equivalent", "preserve_rng_state",
                   "datasets[0].train_on_eos='sometimes'"):
        assert needle in message, (needle, message)
    assert message.count("\n  - ") == 8 and "8 setting(s) cannot be used" in message, message


def test_bad_input_named_with_file_key_and_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"chat_template='llama9'.*use tokenizer_default.*llama3, llama4"):
        load_train_config(_write(tmp_path, "chat_template: llama9\n"), environ={})
    with pytest.raises(ConfigError, match=r"deepspeed='zero9.json'.*not one of Axolotl's deepspeed_configs.*"
                                          r"dp_shard_size: -1"):
        load_train_config(_write(tmp_path, "deepspeed: zero9.json\n"), environ={})
    # Axolotl's key reaches ParallelismConfig's ep_size; alone (Axolotl's examples/expert_parallel) the data-parallel
    # ranks left over shard the rest, and the world size is checked once known (a one-rank world has no dp ranks
    # for ep to borrow)
    ep = load_train_config(_write(tmp_path, "plugins: [axolotl.integrations.expert_parallel.ExpertParallelPlugin]"
                                            "\nexpert_parallel_size: 2\n"), environ={})
    assert (ep.parallel.ep_size, ep.parallel.dp_shard_size) == (2, -1)
    assert any(n.startswith("expert_parallel_size without dp_shard_size") for n in ep.notes)
    assert ep.parallel.resolve(4).dp_shard_size == 4
    with pytest.raises(ConfigError, match=r"ep_size=2 does not fit dp_shard_size=1.*ep_size must divide"):
        ep.parallel.resolve(1)
    with pytest.raises(ConfigError, match=r"ep_size=2 does not fit dp_shard_size=3"):
        load_train_config(_write(tmp_path, "expert_parallel_size: 2\ndp_shard_size: 3\nplugins: "
                                           "[axolotl.integrations.expert_parallel.ExpertParallelPlugin]\n"), environ={})
    # a plugin outside the table (knowledge distillation changes the objective under Axolotl) is refused, not dropped
    with pytest.raises(ConfigError, match=r"plugins: 'axolotl.integrations.kd.KDPlugin' is not run by "
                                          r"nd-parallel train .* Known here: .*LigerPlugin"):
        load_train_config(_write(tmp_path, "plugins: [axolotl.integrations.kd.KDPlugin]\n"), environ={})
    load_train_config(_write(tmp_path, "plugins: [nd_parallel.plugins.axolotl.NDParallelAxolotlPlugin]\n"), environ={})
    with pytest.raises(ConfigError, match=r"fsdp: 'hybrid_shard': set dp_replicate_size"):
        load_train_config(_write(tmp_path, "fsdp: [hybrid_shard, auto_wrap]\n"), environ={})
    with pytest.raises(ConfigError, match=r"chat_template='qwen2_vl' renders images"):
        load_train_config(_write(tmp_path, "chat_template: qwen2_vl\n"), environ={})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_model_and_data(tmp_path_factory.mktemp("axo_data"), n=24)


def _trained(tmp_path, data, **keys):
    from nd_parallel.cli.train.data import load_prepared, prepare

    cfg = load_train_config(write_yaml(tmp_path / "d.yml", {"base_model": data["model"], "sequence_len": 256,
                                                            **keys}), environ={})
    rows, _, tok = load_prepared(prepare(cfg, tmp_path / "work").path)
    return [tok.decode([t for t, lab in zip(r["input_ids"], r["labels"]) if lab != -100]) for r in rows], rows, tok


def test_split_slices_and_out_of_range_is_refused(tmp_path, data):
    entry = {"path": data["text"], "type": "completion"}
    rows = _trained(tmp_path, data, datasets=[{**entry, "split": "train[:25%]"}])[1]
    assert len(rows) == 6  # 25% of 24 records
    rows = _trained(tmp_path, data, datasets=[{**entry, "split": "train[10:14]"}])[1]
    assert len(rows) == 4
    with pytest.raises(ConfigError, match=r"text.jsonl: split='train\[:500\]' asks for row 500, but the data has 24 "
                                          r"rows; use a bound within 24 rows"):
        _trained(tmp_path, data, datasets=[{**entry, "split": "train[:500]"}])


@pytest.mark.parametrize("template,want", [
    ("llama3", "{a}<|eot_id|>"), ("gemma", "{a}<end_of_turn>"), ("phi_3", "{a}<|end|>"), ("chatml", "{a}<|im_end|>"),
    ("mistral_v2v3", "{a}</s>")])
def test_named_templates_train_the_answer_and_its_end_of_turn(tmp_path, data, template, want):
    """One user turn, one assistant turn: the answer and the first eot_tokens token after it are trained, the
    header, the prompt and the separators are not (Axolotl's roles_to_train / train_on_eos: turn)."""
    turns = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "a short answer"}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    eot = want.format(a="")
    trained, _, _ = _trained(tmp_path, data, chat_template=template, eot_tokens=[eot], tokens=[eot],
                             datasets=[{"path": str(tmp_path / "c.jsonl"), "type": "chat_template"}])
    assert trained == [want.format(a="a short answer")]


def test_drop_system_message_and_jinja_file(tmp_path, data):
    shutil.copy(CONFIGS / "turns.jinja", tmp_path / "t.jinja")
    turns = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "yo"}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    entry = {"path": str(tmp_path / "c.jsonl"), "type": "chat_template", "drop_system_message": True,
             "train_on_eos": "all"}
    trained, rows, tok = _trained(tmp_path, data, chat_template="jinja", chat_template_jinja=str(tmp_path / "t.jinja"),
                                  datasets=[entry])
    assert "sys" not in tok.decode(rows[0]["input_ids"]) and trained == ["</s>yo</s>"]


EXTRAS = """batch_size: 4
micro_batch_size: 2
gradient_accumulation_steps: 2
bfloat16: true
lr_scheduler: cosine
cosine_min_lr_ratio: 0.1
resize_token_embeddings_to_32x: true
mean_resizing_embeddings: true
adapter: lora
peft_use_rslora: true
lora_fan_in_fan_out: true
lora_target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]
revision_of_model: abc123
experts_implementation: scattermoe
torch_compile_mode: max-autotune
optimizer: paged_adamw_32bit
"""


def test_axolotl_extras_are_acted_on(tmp_path):
    """Each key reaches what the ranks and the Trainer receive (extras.py)."""
    from nd_parallel.cli.train.embeddings import rows_wanted as embedding_rows
    from nd_parallel.cli.train.extras import lora_kwargs, model_kwargs
    from nd_parallel.cli.train.job import trainer_arguments

    cfg = load_train_config(_write(tmp_path, EXTRAS), environ={})
    assert cfg.bf16 is True and cfg.batch_size == 4 and cfg.optimizer == "paged_adamw_32bit"
    assert cfg.mean_resizing_embeddings is True  # rank.py passes it to resize_token_embeddings (Axolotl: default off)
    assert load_train_config(_write(tmp_path, "micro_batch_size: 1\n"), environ={}).mean_resizing_embeddings is False
    assert lora_kwargs(cfg) == {"use_rslora": True, "fan_in_fan_out": True,
                                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    assert model_kwargs(cfg) == {"revision": "abc123"}  # scattermoe: Axolotl's kernel, not transformers'
    assert (embedding_rows(cfg, 181), embedding_rows(cfg, 192), embedding_rows(cfg, 193)) == (192, 192, 224)
    args = trainer_arguments(cfg, "c", train_rows=8, eval_rows=0, dp=1)
    assert args["lr_scheduler_type"] == "cosine_with_min_lr" and args["lr_scheduler_kwargs"] == {"min_lr_rate": 0.1}
    assert any(n.startswith("experts_implementation: scattermoe") for n in cfg.notes)
    assert any(n.startswith("torch_compile_mode='max-autotune': not passed on") for n in cfg.notes)
    plain = load_train_config(_write(tmp_path, "batch_size: 1\n"), environ={})  # 1 = 1 x 1 (Axolotl's defaults)
    assert embedding_rows(plain, 181) == 181 and plain.gradient_accumulation_steps == 1


def test_cosine_min_lr_ratio_is_axolotls_schedule():
    """transformers' cosine_with_min_lr (what cosine_min_lr_ratio maps to) against Axolotl's
    _get_cosine_schedule_with_min_lr_lambda, written out: warm-up, then (1 - r) * 0.5 * (1 + cos(pi p)) + r."""
    import math

    import torch
    from transformers import get_scheduler

    warmup, total, r = 3, 20, 0.1
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_scheduler("cosine_with_min_lr", opt, num_warmup_steps=warmup, num_training_steps=total,
                          scheduler_specific_kwargs={"min_lr_rate": r})
    for step in range(total + 1):
        p = (step - warmup) / (total - warmup)
        want = step / warmup if step < warmup else (1 - r) * 0.5 * (1 + math.cos(math.pi * p)) + r
        assert abs(sched.get_last_lr()[0] - want) < 1e-12, (step, sched.get_last_lr(), want)
        opt.step()
        sched.step()


def test_extras_and_unsupported_features_are_refused_in_one_message(tmp_path):
    path = _write(tmp_path, """batch_size: 8
micro_batch_size: 2
gradient_accumulation_steps: 2
lr_scheduler: linear
cosine_min_lr_ratio: 0.2
lora_target_parameters: [experts.down_proj]
bfloat16: true
bf16: false
float16: true
qat: {activation_dtype: nvfp4, weight_dtype: nvfp4, group_size: 32}
processor_type: AutoProcessor
tokenizer_use_mistral_common: true
chat_template: chatml
""")
    with pytest.raises(ConfigError) as err:
        load_train_config(path, environ={})
    message = str(err.value)
    for needle in ("batch_size=8 with gradient_accumulation_steps=2: they disagree (micro_batch_size x "
                   "gradient_accumulation_steps = 4); keep one", "cosine_min_lr_ratio with lr_scheduler='linear'",
                   "lora_target_parameters without adapter: lora", "bfloat16=True with bf16=False",
                   "qat: group_size=32 with nvfp4",
                   "set group_size: 16",
                   "chat_template='chatml' with tokenizer_use_mistral_common: mistral-common renders"):
        assert needle in message, (needle, message)
    assert "processor_type" not in message, message  # with mistral-common: its tokenizer is the processor
    assert "6 setting(s) cannot be used" in message, message


def test_an_optimizer_whose_package_is_missing_is_refused_before_the_ranks(monkeypatch):
    import importlib.util

    from nd_parallel.cli.train import extras

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"c.yml: optimizer='adamw_torch_4bit' is built from torchao, which is not "
                                          r"installed: pip install torchao, or use optimizer: adamw_torch"):
        extras.check_installed("adamw_torch_4bit", "c.yml")
    extras.check_installed("adamw_torch", "c.yml")


def test_lora_on_parameter_tensors_is_refused_where_the_experts_are_split(tmp_path):
    from nd_parallel import ParallelismConfig
    from nd_parallel.cli.train import extras

    cfg = load_train_config(_write(tmp_path, "adapter: lora\nlora_target_parameters: [mlp.experts.down_proj]\n"),
                            environ={})
    extras.check_layout(cfg, ParallelismConfig(dp_shard_size=2), "c.yml")
    with pytest.raises(ConfigError, match=r"c.yml: lora_target_parameters with tp_size=2: LoRA on parameter tensors "
                                          r"is checked under FSDP2 / DDP only; use dp_shard_size"):
        extras.check_layout(cfg, ParallelismConfig(tp_size=2), "c.yml")


def test_field_thinking_reaches_the_template_and_is_trained_with_the_answer(tmp_path, data):
    """Axolotl's field_thinking / template_thinking_key: the record's reasoning goes to the template under the
    template's key; a trained turn's reasoning and content are trained, the prompt is not."""
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['thinking'] is defined %}[{{ m['thinking'] }}]"
                "{% endif %}{{ m['content'] }}</s>{% endfor %}")
    turns = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "an answer", "why": "a plan"}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    entry = {"path": str(tmp_path / "c.jsonl"), "type": "chat_template", "field_thinking": "why",
             "template_thinking_key": "thinking"}
    trained, rows, tok = _trained(tmp_path, data, chat_template="jinja", chat_template_jinja=template,
                                  datasets=[entry])
    assert "[a plan]an answer" in tok.decode(rows[0]["input_ids"])
    assert trained == ["a plan]an answer</s>"]


def test_jamba_template(tmp_path, data):
    turns = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "a short answer"}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    markers = ["<|bom|>", "<|eom|>", "<|system|>", "<|user|>", "<|assistant|>"]
    trained, rows, tok = _trained(tmp_path, data, chat_template="jamba", eot_tokens=["<|eom|>"], tokens=markers,
                                  datasets=[{"path": str(tmp_path / "c.jsonl"), "type": "chat_template"}])
    text = tok.decode(rows[0]["input_ids"]).replace(tok.bos_token or "", "")
    assert text == "<|bom|><|system|> <|eom|><|bom|><|user|> hello there<|eom|><|bom|><|assistant|> a short answer<|eom|>"
    assert trained == ["a short answer<|eom|>"]


def test_every_unknown_key_of_a_datasets_entry_is_in_the_one_message(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("base_model: ./m\ndatasets:\n  - path: ./d.jsonl\n    type: chat_template\n"
                    "    field_prompt: prompt\n    field_reward: reward\nrl: grpo\n")
    with pytest.raises(ConfigError) as err:
        load_train_config(path, environ={})
    message = str(err.value)
    for needle in ("unknown key 'field_prompt' in datasets[0]", "unknown key 'field_reward' in datasets[0]",
                   "trl=None with rl: grpo: write the trl: block with reward_funcs"):
        assert needle in message, (needle, message)
    assert "3 setting(s) cannot be used" in message, message


def test_rl_dpo_maps_and_what_it_cannot_do_is_refused(tmp_path):
    cfg = load_train_config(_write(tmp_path, "rl: dpo\nrl_beta: 0.05\n"), environ={})
    assert (cfg.rl, cfg.rl_beta, cfg.datasets[0].field_chosen, cfg.datasets[0].field_rejected) == (
        "dpo", 0.05, "chosen", "rejected")
    assert load_train_config(_write(tmp_path, "rl: ipo\ncontext_parallel_size: 2\n"), environ={}).rl == "ipo"
    for extra, needle in [
            ("rl: ppo\n", "rl='ppo': nd-parallel train runs rl: dpo, ipo (TRL's DPOTrainer), kto"),
            ("rl: kto\n", "datasets[0].type='chat_template' with rl: kto: KTO examples are read as Axolotl's"),
            ("rl: dpo\nkto_desirable_weight: 2\n", "kto_desirable_weight with rl: dpo: it weighs KTO's examples"),
            ("rl: dpo\nrl_beta: -1\n", "rl_beta=-1; write a number > 0"),
            ("rl: dpo\nsample_packing: true\n", "sample_packing=True with rl: dpo: preference examples are not packed"),
            ("rl: dpo\npipeline_parallel_size: 2\n", "rl: dpo with pipeline_parallel_size: 2: DPO sums each "
                                                     "sequence's per-token log-probs")]:
        with pytest.raises(ConfigError, match=None) as err:
            load_train_config(_write(tmp_path, extra), environ={})
        assert needle in str(err.value), (needle, str(err.value))
    path = tmp_path / "t.yml"
    path.write_text("base_model: ./m\nrl: dpo\ndatasets:\n  - path: ./d.jsonl\n    type: chatml.argilla\n")
    with pytest.raises(ConfigError, match=r"datasets\[0\].type='chatml.argilla' with rl: dpo: .*chat_template.default"):
        load_train_config(path, environ={})  # a KTO type (data/dpo_types.py has chatml.ultra & co. for DPO)


def test_preference_records_render_as_axolotl_renders_them(tmp_path):
    """chat_template.default pairs: the prompt with the generation prompt, each answer from its text on (keeping
    the template's end of turn), answers given as a string, a turn or a conversation; bad records name the fix."""
    from nd_parallel.cli.train.data.preference import preference_fn
    from nd_parallel.cli.train.data.sources import DatasetSpec
    from nd_parallel.testing.models import make_text
    from nd_parallel.testing.tokenizer import train_tiny_tokenizer

    tok = train_tiny_tokenizer(make_text(50, seed=1))
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    spec = DatasetSpec(path="x", type="chat_template", field_messages="conv", field_chosen="good",
                       field_rejected="bad", message_property_mappings={"role": "from", "content": "value"},
                       roles={"user": ["human"], "assistant": ["gpt"]})
    batch = {"conv": [[{"from": "human", "value": "hi there"}], "just a string"],
             "good": [{"from": "gpt", "value": "hello"}, "fine "],
             "bad": [[{"from": "human", "value": "x"}, {"from": "gpt", "value": "go away"}], "no"]}
    out = preference_fn(spec, tok, "d.jsonl")(batch, [0, 1])
    assert out["prompt"] == ["<|user|>hi there<|end|><|assistant|>", "<|user|>just a string<|end|><|assistant|>"]
    assert out["chosen"] == ["hello<|end|>", "fine <|end|>"] and out["rejected"] == ["go away<|end|>", "no<|end|>"]
    with pytest.raises(ConfigError, match=r"record 0: no 'good' field .*set field_chosen / field_rejected"):
        preference_fn(spec, tok, "d.jsonl")({"conv": [[{"from": "human", "value": "a"}]], "bad": ["b"]}, [0])
    with pytest.raises(ConfigError, match=r"good's role 'robot' is not one the chat template knows"):
        preference_fn(spec, tok, "d.jsonl")({"conv": ["a"], "good": [{"from": "robot", "value": "b"}],
                                              "bad": ["c"]}, [0])


def test_a_batch_size_alone_is_read_as_axolotl_reads_it(tmp_path):
    """Axolotl 0.19 fills gradient_accumulation_steps: 1 before it reads batch_size, so batch_size alone does not
    change training there: the same here, with one line naming the setting that would."""
    cfg = load_train_config(_write(tmp_path, "batch_size: 8\nmicro_batch_size: 2\n"), environ={})
    assert (cfg.micro_batch_size, cfg.gradient_accumulation_steps) == (2, 1)
    assert any(n.startswith("batch_size=8: not used for training, as in Axolotl 0.19") and
               n.endswith("set gradient_accumulation_steps: 4 for a batch of 8") for n in cfg.notes), cfg.notes
    agreeing = load_train_config(_write(tmp_path, "batch_size: 4\nmicro_batch_size: 2\n"
                                                  "gradient_accumulation_steps: 2\n"), environ={})
    assert not any(n.startswith("batch_size") for n in agreeing.notes)
    with pytest.raises(ConfigError, match=r"batch_size=0 must be an integer >= 1"):
        load_train_config(_write(tmp_path, "batch_size: 0\n"), environ={})


def test_lora_dropout_with_parameter_targets_is_refused_in_the_config_stage(tmp_path):
    """Axolotl's rule: peft's ParamWrapper (LoRA on parameter tensors) cannot apply dropout; refused before launch."""
    head = "adapter: lora\nlora_target_parameters: [mlp.experts.down_proj]\n"
    with pytest.raises(ConfigError, match=r"lora_dropout=0.05 with lora_target_parameters: .*set lora_dropout: 0"):
        load_train_config(_write(tmp_path, head + "lora_dropout: 0.05\n"), environ={})
    assert load_train_config(_write(tmp_path, head + "lora_dropout: 0\n"), environ={}).lora_target_parameters
