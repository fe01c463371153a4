"""Axolotl's optimizer groups (cli/train/param_groups.py): which parameter lands in which group, at which rate and
weight decay, as its OptimizerMixin.create_optimizer_grouped_parameters puts them; LoRA+ through peft's helper."""

from types import SimpleNamespace

import torch

from nd_parallel.cli.train.param_groups import ParamGroupOptions, groups, use_param_groups


def _model():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config)


def _trainer(model, weight_decay=0.1):
    from transformers import Trainer

    trainer = SimpleNamespace(args=SimpleNamespace(weight_decay=weight_decay))
    trainer.get_decay_parameter_names = lambda m: Trainer.get_decay_parameter_names(trainer, m)
    return trainer


def test_groups_are_axolotls():
    model = _model()
    names = {id(p): n for n, p in model.named_parameters()}
    t = ParamGroupOptions(embedding_lr_scale=0.5, embedding_lr=1.0,
                          lr_groups=[{"name": "attention", "modules": ["self_attn"], "lr": 5e-4}])
    out = groups(model, _trainer(model), t, 2e-3)
    by = [(g["lr"], g["weight_decay"], sorted(names[id(p)] for p in g["params"])) for g in out]
    decay, embeddings, no_decay, attention = by
    assert decay[:2] == (2e-3, 0.1) and all("mlp" in n for n in decay[2])
    assert embeddings[:2] == (1e-3, 0.0) and embeddings[2] == ["lm_head.weight", "model.embed_tokens.weight"]
    assert no_decay[:2] == (2e-3, 0.0) and all("norm" in n for n in no_decay[2])
    assert attention[:2] == (5e-4, 0.1) and all("self_attn" in n for n in attention[2]) and len(attention[2]) == 8
    assert sum(len(g["params"]) for g in out) == len(list(model.parameters()))
    only_lr = groups(model, _trainer(model), ParamGroupOptions(embedding_lr=1e-5), 2e-3)
    assert only_lr[1]["lr"] == 1e-5  # embedding_lr when no scale is given


def test_loraplus_is_peft_helper_with_the_trainers_optimizer():
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    model = get_peft_model(_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"]))
    trainer = SimpleNamespace(model=model, optimizer=None, args=TrainingArguments("out", learning_rate=1e-3,
                                                                                    use_cpu=True, report_to=[]),
                              get_optimizer_cls_and_kwargs=Trainer.get_optimizer_cls_and_kwargs)
    use_param_groups(trainer, ParamGroupOptions(loraplus_lr_ratio=16, loraplus_lr_embedding=1e-4))
    optimizer = trainer.create_optimizer()
    assert isinstance(optimizer, torch.optim.AdamW)
    rates = {n: g["lr"] for g in optimizer.param_groups for n, p in model.named_parameters()
             if any(p is q for q in g["params"])}
    assert {r for n, r in rates.items() if "q_proj.lora_A" in n} == {1e-3}
    assert {r for n, r in rates.items() if "q_proj.lora_B" in n} == {16e-3}
    assert {r for n, r in rates.items() if "embed_tokens" in n} == {1e-4}


def test_schema_keys_are_read_or_accepted_with_their_meaning(tmp_path):
    """Keys of Axolotl's schema that were refused as not implemented: peft's patterns and init, Axolotl's aliases,
    the scheduler's and optimizer's extra arguments act; housekeeping keys are accepted; an evaluation-only key is
    accepted with a line; an init that rewrites the base weights is refused with the alternative."""
    import json

    import pytest

    from nd_parallel.cli.train.config import load_train_config
    from nd_parallel.cli.train.job import trainer_arguments
    from nd_parallel.cli.train.objective import adapter_kwargs
    from nd_parallel.config import ConfigError

    base = {"base_model": "./m", "datasets": [{"path": "d.jsonl", "type": "completion"}], "adapter": "lora"}
    keys = {"lora_rank_pattern": {"q_proj": 8}, "lora_alpha_pattern": {"q_proj": 32}, "peft_layers_to_transform": [1],
            "peft_layers_pattern": "layers", "peft_init_lora_weights": "gaussian", "model_revision": "main",
            "lr_scheduler_kwargs": {"num_cycles": 1.0}, "optim_args": {"foo": 1, "bar": "x"}, "gc_collect_steps": 10,
            "gradio_title": "t", "world_size": 8, "do_bench_eval": True, "dpo_beta": 0.1, "torch_dtype": "bfloat16",
            "cosine_min_lr_ratio": 0.1}
    (tmp_path / "c.yml").write_text(json.dumps({**base, **keys}))
    cfg = load_train_config(tmp_path / "c.yml", environ={})
    assert cfg.revision_of_model == "main"
    assert adapter_kwargs(cfg) == {"layers_to_transform": [1], "layers_pattern": "layers", "rank_pattern":
                                   {"q_proj": 8}, "alpha_pattern": {"q_proj": 32}, "init_lora_weights": "gaussian"}
    args = trainer_arguments(cfg, "c", 100, 0, 1)
    assert args["lr_scheduler_kwargs"] == {"min_lr_rate": 0.1, "num_cycles": 1.0}
    assert args["optim_args"] == "foo=1,bar=x"
    notes = "\n".join(cfg.notes)
    assert "multiple-choice benchmark" in notes and "dpo_beta: deprecated" in notes, notes
    (tmp_path / "c.yml").write_text(json.dumps({**base, "peft_init_lora_weights": "pissa", "lora_rank_pattern": 8}))
    with pytest.raises(ConfigError) as err:
        load_train_config(tmp_path / "c.yml", environ={})
    assert "peft_init_lora_weights='pissa'" in str(err.value) and "lora_rank_pattern=8" in str(err.value)
