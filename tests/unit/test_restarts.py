"""LISA, ReLoRA and jagged LR restarts (cli/train/restarts.py, plugins/trainer/lisa.py and relora.py,
schedules.JaggedRestarts): Axolotl 0.19's own code run in its venv as the reference (the schedule, the step rule,
the merge and the magnitude pruning), the one-process invariants, and the config stage's refusals."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.restarts import check_layout
from nd_parallel.config import ConfigError, ParallelismConfig
from nd_parallel.plugins.trainer.lisa import (
    LISACallback,
    count_layers,
    draw_layers,
    last_switch,
    set_active_layers,
    switches_at,
)
from nd_parallel.plugins.trainer.relora import merge_and_reinit, prune_moments, prune_ratio
from tests.unit.axolotl_venv import run_in_axolotl

# Run in either venv: the LR of every step of a jagged schedule around transformers' schedules, the steps LISA's
# callback switches at, and one ReLoRA restart (merge, then magnitude pruning at 0.9) of a seeded LoRA layer.
SCRIPT = """
import json, sys, torch
from types import SimpleNamespace
from transformers import get_scheduler
from peft import LoraConfig, get_peft_model
which = sys.argv[1]
out = {}
for name, every, warm, anneal, total in (("cosine", 6, 2, 2, 20), ("linear", 5, 3, 1, 16), ("constant", 4, 10, 1, 12)):
    p = torch.nn.Parameter(torch.zeros(1)); opt = torch.optim.AdamW([p], lr=1e-3)
    inner = get_scheduler(name, opt, num_warmup_steps=2, num_training_steps=total)
    if which == "axolotl":
        from axolotl.utils.schedulers import JaggedLRRestartScheduler as J
        s = J(opt, inner, every, warm, anneal, min_lr_scale=0.001)
    else:
        from nd_parallel.cli.train.schedules import JaggedRestarts
        s = JaggedRestarts(opt, inner, every, warm, anneal, min_scale=0.001)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"]); opt.step(); s.step()
    out[name] = lrs
if which == "axolotl":
    from axolotl.utils.callbacks.lisa import lisa_callback_factory
    layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(4))
    trainer = SimpleNamespace(model=SimpleNamespace(model=SimpleNamespace(layers=layers)),
                              args=SimpleNamespace(lisa_n_layers=1, lisa_step_interval=3,
                                                   lisa_layers_attribute="model.layers"))
    cb = lisa_callback_factory(trainer); seen = []
    cb.switch_active_layers = lambda: seen.append(step)
    for step in range(10):
        cb.on_step_begin(None, SimpleNamespace(global_step=step), None)
    out["lisa"] = seen
else:
    from nd_parallel.plugins.trainer.lisa import switches_at
    out["lisa"] = [step for step in range(10) if switches_at(step, 3)]
class M(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.lin = torch.nn.Linear(16, 24, bias=False)
g = torch.Generator().manual_seed(0)
torch.manual_seed(0)
model = get_peft_model(M(), LoraConfig(target_modules=["lin"], r=4, lora_alpha=8))
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=g))
lora = [p for n, p in model.named_parameters() if "lora_" in n]
opt = torch.optim.AdamW(lora, lr=1e-2)
for _ in range(2):
    for p in lora:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
with torch.no_grad():
    if which == "axolotl":
        from axolotl.monkeypatch.relora import merge_and_save, reset_optimizer
        merge_and_save(model, "-", "-", reinit=True, quantized=False)
        reset_optimizer(opt, reset_params=lora, optimizer_state_keys=["exp_avg", "exp_avg_sq"],
                        prune_method="magnitude", prune_ratio=0.9)
    else:
        from nd_parallel.plugins.trainer.relora import merge_and_reinit, prune_moments
        merge_and_reinit(model, 0, 2)
        prune_moments(model, opt, 0, 2, "magnitude", 0.9)
layer = model.base_model.model.lin
out["weight"] = layer.base_layer.weight.tolist()
out["b"] = layer.lora_B["default"].weight.abs().max().item()
out["a_bound"] = layer.lora_A["default"].weight.abs().max().item()
out["moments"] = [opt.state[p][k].tolist() for p in lora for k in ("exp_avg", "exp_avg_sq")]
print(json.dumps(out))
"""


def test_schedule_step_rule_and_restart_equal_axolotl():
    """Axolotl 0.19's JaggedLRRestartScheduler, LISA's switch steps, and ReLoRA's merge + magnitude pruning on the
    same seeded layer: equal (the new adapter A is random in both, drawn from other generators: its bound only)."""
    theirs = run_in_axolotl("-c", SCRIPT, "axolotl")
    out = subprocess.run([sys.executable, "-c", SCRIPT, "ours"], capture_output=True, text=True, check=True)
    ours = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("cosine", "linear", "constant", "lisa", "weight", "moments"):
        assert ours[name] == theirs[name], name
    assert ours["b"] == theirs["b"] == 0.0
    assert ours["a_bound"] <= 0.25 and theirs["a_bound"] <= 0.25  # kaiming_uniform(a=sqrt(5)): 1/sqrt(16)


def _tiny_llama(layers=4):
    from transformers import AutoModelForCausalLM

    from nd_parallel.testing.models import tiny_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=layers))


def test_lisa_draws_and_switches_by_name():
    assert draw_layers(3, 4, 8, 3) == draw_layers(3, 4, 8, 3) != draw_layers(3, 6, 8, 3)
    assert all(len(set(draw_layers(1, s, 8, 3))) == 3 for s in range(20))
    assert {i for s in range(40) for i in draw_layers(1, s, 8, 1)} == set(range(8))  # uniform over the layers
    assert [s for s in range(9) if switches_at(s, 4)] == [0, 1, 4, 8]
    model = _tiny_llama()
    assert count_layers(model, "model.layers") == 4
    set_active_layers(model, "model.layers", [1, 3])
    trained = {n.split(".")[2] for n, p in model.named_parameters() if p.requires_grad and ".layers." in n}
    assert trained == {"1", "3"} and model.model.embed_tokens.weight.requires_grad
    with pytest.raises(ValueError, match="lisa_layers_attribute='model.blocks' does not name a list of layers"):
        count_layers(model, "model.blocks")


def test_lisa_callback_switches_the_prepared_model():
    model = _tiny_llama()
    trainer = SimpleNamespace(model=model, model_wrapped=model, is_world_process_zero=lambda: True)
    with pytest.raises(ValueError, match="lisa_n_layers=5: the model has 4 layers"):
        LISACallback(trainer, 5, 2)
    callback = LISACallback(trainer, 2, 2)
    callback.on_step_begin(SimpleNamespace(seed=9), SimpleNamespace(global_step=0, is_world_process_zero=False), None)
    assert callback.active == draw_layers(9, 0, 4, 2)
    frozen = {n.split(".")[2] for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {str(i) for i in range(4)} - {str(i) for i in callback.active}
    resumed = LISACallback(trainer, 2, 4)  # a run resumed at step 6 trains the layers drawn at step 4
    resumed.on_step_begin(SimpleNamespace(seed=9), SimpleNamespace(global_step=6, is_world_process_zero=False), None)
    assert resumed.active == draw_layers(9, 4, 4, 2)
    assert [last_switch(s, 4) for s in range(10)] == [0, 1, 1, 1, 4, 4, 4, 4, 8, 8]


def test_relora_restart_keeps_the_function_and_prunes_the_share_asked():
    """After a restart the model computes what it computed before (delta merged, B = 0); magnitude pruning zeroes
    the ratio asked and keeps the largest values; the defaults are Axolotl's."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny_llama(2), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ids = torch.arange(12).reshape(2, 6)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    before = model(input_ids=ids).logits
    assert merge_and_reinit(model, 0, 1) == 4
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
    zeros, total = prune_moments(model, opt, 0, 1, "magnitude", 0.75)
    assert abs(zeros / total - 0.75) < 0.01
    zeros, total = prune_moments(model, opt, 0, 1, "random", 1.0)
    assert zeros == total
    assert (prune_ratio("reset", None), prune_ratio("magnitude", None), prune_ratio("random", 0.3)) == (0.999, 0.9, 0.3)


def _load(tmp_path, text: str):
    path = tmp_path / "c.yml"
    path.write_text("base_model: ./m\ndatasets:\n  - path: ./d.jsonl\n    type: completion\n" + text)
    return load_train_config(path, environ={})


def test_config_refusals_name_the_value_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, "relora: true\nadapter: qlora\nload_in_4bit: true\noptimizer: sgd\n"
                        "relora_prune_method: top\nrelora_prune_ratio: 2\nlisa_n_layers: 2\nrelora_steps: 10\n")
    message = str(err.value)
    for needle in ("relora: true without jagged_restart_steps", "relora_prune_method='top'",
                   "relora_prune_ratio=2: write a share between 0 and 1", "relora with optimizer='sgd'",
                   "lisa_n_layers without lisa_step_interval", "relora_steps=10: Axolotl's older name"):
        assert needle in message, (needle, message)
    with pytest.raises(ConfigError, match="lisa_n_layers with adapter='lora': LISA trains whole decoder layers"):
        _load(tmp_path, "adapter: lora\nlisa_n_layers: 2\nlisa_step_interval: 5\n")
    with pytest.raises(ConfigError, match="relora with lora_modules_to_save=\\['lm_head'\\]: a ReLoRA run ends by"):
        _load(tmp_path, "adapter: lora\nrelora: true\njagged_restart_steps: 5\nlora_modules_to_save: [lm_head]\n")
    with pytest.raises(ConfigError, match="relora with adapter=None: ReLoRA restarts a LoRA adapter"):
        _load(tmp_path, "relora: true\njagged_restart_steps: 5\n")
    cfg = _load(tmp_path, "adapter: lora\nrelora: true\njagged_restart_steps: 5\njagged_restart_anneal_steps: false\n")
    assert cfg.relora and cfg.jagged_restart_steps == 5 and cfg.jagged_restart_anneal_steps is None
    assert cfg.relora_prune_method == "magnitude" and cfg.relora_prune_ratio is None
    with pytest.raises(ConfigError, match="relora with pp_backend='deepspeed'"):
        check_layout(cfg, ParallelismConfig(pp_size=2, pp_backend="deepspeed"), "c.yml")
    check_layout(cfg, ParallelismConfig(pp_size=2), "c.yml")  # torch's pipeline: each stage restarts its layers


def test_relora_restart_merges_an_embedding_lora():
    """LoRA on the embeddings (lora_target_modules: [embed_tokens]): the restart merges (B @ A)^T * scaling into the
    embedding and starts A at 0 and B ~ N(0, 1) as peft does (Axolotl's merge_and_save); it used to raise
    NotImplementedError in every rank at the first restart."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from nd_parallel.testing.models import tiny_config

    torch.manual_seed(0)  # untied: a delta merged into a tied embedding moves the head too (as in Axolotl)
    untied = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2, tie_word_embeddings=False))
    model = get_peft_model(untied, LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]))
    layer = model.base_model.model.model.embed_tokens
    with torch.no_grad():
        layer.lora_embedding_A["default"].normal_(0, 0.1)  # peft starts A at 0: make the delta non-zero
    ids = torch.arange(12).reshape(2, 6)
    before, base = model(input_ids=ids).logits, layer.get_base_layer().weight.clone()
    delta = (layer.lora_embedding_B["default"] @ layer.lora_embedding_A["default"]).T * layer.scaling["default"]
    assert merge_and_reinit(model, 0, 1) == 3  # the embedding and two layers' q_proj
    torch.testing.assert_close(layer.get_base_layer().weight, base + delta)
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
    assert not layer.lora_embedding_A["default"].any()
    fresh = layer.lora_embedding_B["default"].clone()
    assert 0.5 < fresh.std().item() < 1.5  # N(0, 1), seeded: the same values on every rank
    merge_and_reinit(model, 0, 1)
    torch.testing.assert_close(layer.lora_embedding_B["default"], fresh, rtol=0, atol=0)


def test_lisa_layer_count_refused_in_the_parent(tmp_path):
    """lisa_n_layers above a local checkpoint's num_hidden_layers is refused in the job stage (before any rank starts;
    the ranks' LISACallback would raise after loading the model); within it, or without a local config, it passes."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4}))
    cfg = _load(tmp_path, "lisa_n_layers: 5\nlisa_step_interval: 2\n")
    cfg.base_model = str(tmp_path / "m")
    with pytest.raises(ConfigError, match="lisa_n_layers=5: .* has 4 decoder layers"):
        check_layout(cfg, ParallelismConfig(), "c.yml")
    cfg.lisa_n_layers = 4
    check_layout(cfg, ParallelismConfig(), "c.yml")
    cfg.lisa_n_layers, cfg.base_model = 5, str(tmp_path / "absent")
    check_layout(cfg, ParallelismConfig(), "c.yml")


def test_merged_export_folds_an_embedding_lora_as_peft(tmp_path):
    """The merged save a ReLoRA run ends with (checkpoint/export/adapter.save_merged), on one process: with LoRA on
    the embeddings too it equals peft's merge_and_unload bit for bit (it raised KeyError on lora_A.<adapter>.weight,
    which an embedding's LoRA does not have, after the whole run had trained)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from nd_parallel.checkpoint.export.adapter import save_merged
    from nd_parallel.testing.models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2, tie_word_embeddings=False))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.1)
    state = SimpleNamespace(is_main_process=True, num_processes=1, device=torch.device("cpu"), distributed=False,
                            barrier=lambda: None)
    save_merged(state, model, tmp_path, "10GB")
    got = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    want = model.merge_and_unload().state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
