"""Axolotl's `use_eaft` (nd_parallel/distributed/eaft.py, cli/train/objective.py): the loss equals Axolotl's own
eaft_loss bit for bit (its venv), is installed as the model's loss function, makes the chunked loss stand aside, and
the keys are checked in the config stage. Under FSDP2 / TP2 / PP2 / CP2: tests/distributed/test_train_yaml_parity.py
(completion_eaft). Also `use_onebitllms`' layers (nd_parallel/models/bitnet.py) against transformers' BitNet
quantizers; under FSDP2 / PP2 / CP2: tests/distributed/test_train_bitnet.py."""

import json
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from nd_parallel.config import ConfigError
from nd_parallel.distributed.chunked_loss import ChunkedLoss
from nd_parallel.distributed.eaft import eaft_causal_lm_loss, is_default_causal_lm_loss, use_eaft_loss
from tests.unit.axolotl_venv import run_in_axolotl

# Run in either venv: seeded logits and labels (some ignored), the loss with and without a token count, as JSON.
SCRIPT = """
import json, sys, torch
from types import SimpleNamespace
gen = torch.Generator().manual_seed(0)
logits = torch.randn(2, 7, 50, generator=gen)
labels = torch.randint(0, 50, (2, 7), generator=gen)
labels[0, :3] = -100
labels[1, 5] = -100
cases = [(None, 1.0, 20), (17, 0.5, 5), (9, 2.0, 80)]
out = []
for count, alpha, k in cases:
    n = None if count is None else torch.tensor(count)
    if sys.argv[1] == "axolotl":
        from axolotl.monkeypatch.loss.eaft import eaft_loss
        out.append(eaft_loss(SimpleNamespace(logits=logits), labels, num_items_in_batch=n, alpha=alpha, k=k).item())
    else:
        from nd_parallel.distributed.eaft import eaft_causal_lm_loss
        out.append(eaft_causal_lm_loss(logits, labels, 50, num_items_in_batch=n, alpha=alpha, k=k).item())
print(json.dumps(out))
"""


def test_loss_is_axolotls_eaft_loss_bit_for_bit():
    """fp32 logits (where both take the cross-entropy in fp32): Axolotl's shifted logits[:-1] / labels[1:] and
    transformers' padded shift pick the same pairs; k above the vocabulary is clamped by both."""
    theirs = run_in_axolotl("-c", SCRIPT, "axolotl")
    out = subprocess.run([sys.executable, "-c", SCRIPT, "ours"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == theirs


def test_weights_are_the_top_k_entropy():
    """One label token: the loss is its cross-entropy times the entropy of its top-k softmax, raised to alpha; a
    confident prediction (one large logit) weighs less than a flat one."""
    logits = torch.tensor([[[0.0, 1.0, 2.0, 3.0], [5.0, 0.0, 0.0, 0.0]]])
    labels = torch.tensor([[-100, 2]])
    p = torch.softmax(torch.tensor([3.0, 2.0]), 0)
    entropy = -(p * torch.log(p + 1e-10)).sum()
    ce = torch.nn.functional.cross_entropy(logits[0, :1], torch.tensor([2]))
    got = eaft_causal_lm_loss(logits, labels, 4, alpha=2.0, k=2)
    torch.testing.assert_close(got, ce * entropy ** 2)
    sharp = eaft_causal_lm_loss(torch.tensor([[[9.0, 0, 0, 0], [0.0] * 4]]), torch.tensor([[-100, 1]]), 4)
    flat = eaft_causal_lm_loss(torch.tensor([[[0.1, 0, 0, 0], [0.0] * 4]]), torch.tensor([[-100, 1]]), 4)
    assert sharp < flat  # the sharp one's label is wrong, yet its weight (low entropy) makes its loss small
    # shift_labels (as context parallelism passes them) is taken as given; no label token gives 0, not nan
    assert eaft_causal_lm_loss(logits, None, 4, shift_labels=torch.tensor([[2, -100]]), alpha=2.0, k=2) == got
    assert eaft_causal_lm_loss(logits, torch.full((1, 2), -100), 4).item() == 0.0


@pytest.fixture(scope="module")
def tiny_llama():
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_installed_as_the_models_loss_and_the_chunked_loss_stands_aside(tiny_llama):
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    plain = tiny_llama(input_ids=ids, labels=ids).loss
    assert is_default_causal_lm_loss(tiny_llama)
    use_eaft_loss(tiny_llama, alpha=1.0, k=20)
    try:
        assert not is_default_causal_lm_loss(tiny_llama)
        out = tiny_llama(input_ids=ids, labels=ids)
        torch.testing.assert_close(out.loss, eaft_causal_lm_loss(out.logits, ids, 64))
        assert not torch.allclose(out.loss, plain)
        chunked = ChunkedLoss(tiny_llama, 4)
        assert not chunked.head.enabled and "forward" not in tiny_llama.__dict__  # the full logits, EAFT's loss
        with pytest.raises(ValueError, match="k >= 1"):
            use_eaft_loss(tiny_llama, k=0)
    finally:
        del tiny_llama._loss_function
    chunked = ChunkedLoss(tiny_llama, 4)
    assert chunked.head.enabled  # plain cross-entropy again: chunked
    chunked.remove()


def _stage(tmp_path, extra: str):
    from nd_parallel.cli.train.config import load_train_config

    path = tmp_path / "eaft.yml"
    path.write_text("base_model: m\ndatasets:\n  - path: d.jsonl\n    type: completion\n" + extra)
    return load_train_config(path)


def test_yaml_keys(tmp_path):
    cfg = _stage(tmp_path, "use_eaft: true\neaft_alpha: 0.5\neaft_k: 8\ncls_model_config: Gemma3TextConfig\n"
                           "evaluation_strategy: 'no'\n")
    assert (cfg.use_eaft, cfg.eaft_alpha, cfg.eaft_k, cfg.cls_model_config) == (True, 0.5, 8, "Gemma3TextConfig")
    assert cfg.eval_strategy == "no"  # Axolotl's old name, read as eval_strategy
    assert any("use_eaft" in note and "full logits" in note for note in cfg.notes)
    assert _stage(tmp_path, "evaluation_strategy: steps\neval_strategy: epoch\n").eval_strategy == "epoch"


def test_yaml_refusals_in_one_message(tmp_path):
    with pytest.raises(ConfigError) as err:
        _stage(tmp_path, "use_eaft: true\neaft_alpha: -1\neaft_k: 0\nloss_chunk_size: 512\nrl: dpo\n"
                         "cls_model_config: NotAConfig\n")
    message = str(err.value)
    for needle in ("eaft_alpha=-1: write a number >= 0", "eaft_k=0: write an integer >= 1",
                   "use_eaft with loss_chunk_size=512", "use_eaft with rl='dpo'",
                   "cls_model_config='NotAConfig' is not a transformers config class"):
        assert needle in message, (needle, message)
    with pytest.raises(ConfigError, match="use_eaft='yes'; use true or false"):
        _stage(tmp_path, "use_eaft: 'yes'\n")


def test_bitnet_layers_are_transformers_bitnet_arithmetic_with_onebitllms_rounding():
    """models/bitnet.py against transformers' own BitNet quantizers (WeightQuant / ActQuant, straight-through):
    the same forward and gradients on random values; on an exact tie the rounding is onebitllms' (half up), where
    torch.round (transformers') rounds half to even."""
    from transformers.integrations.bitnet import ActQuant, WeightQuant

    from nd_parallel.models.bitnet import BitNetLinear, int8_activation, ternary_weight, to_bitnet

    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(24, 8, bias=True)
    x = torch.randn(3, 5, 24, generator=gen, requires_grad=True)
    theirs = torch.nn.functional.linear(ActQuant.apply(x), WeightQuant.apply(layer.weight), layer.bias)
    theirs.square().sum().backward()
    want = [x.grad.clone(), layer.weight.grad.clone()]
    x.grad, layer.weight.grad = None, None
    layer.__class__ = BitNetLinear
    ours = layer(x)
    ours.square().sum().backward()
    # the same levels; the scale's last bit and onebitllms' straight-through form v + (q - v).detach() (ours: q to
    # within an ulp, where transformers' Functions return q itself) allow fp32 closeness, not bit equality
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close([x.grad, layer.weight.grad], want)
    torch.testing.assert_close(int8_activation(x), ActQuant.apply(x), rtol=1e-6, atol=0)
    torch.testing.assert_close(ternary_weight(layer.weight), WeightQuant.apply(layer.weight), rtol=1e-6, atol=0)
    tie = torch.tensor([0.25, -0.75, 0.5, 0.5])  # mean |w| 0.5: w·s = [0.5, -1.5, 1, 1]
    assert ternary_weight(tie).tolist() == [0.5, -0.5, 0.5, 0.5]  # 0.5 rounds up (torch.round: 0)
    assert WeightQuant.apply(tie).tolist() == [0.0, -0.5, 0.5, 0.5]
    assert int8_activation(torch.tensor([[127.0, 0.5, -0.5]])).tolist() == [[127.0, 1.0, 0.0]]  # half up
    model = torch.nn.ModuleDict({"q": torch.nn.Linear(4, 4), "lm_head": torch.nn.Linear(4, 9)})
    assert to_bitnet(model) == ["q"] and type(model["lm_head"]) is torch.nn.Linear


def test_onebitllms_refusals(tmp_path):
    from nd_parallel.cli.train import extras
    from nd_parallel.config import ParallelismConfig

    cfg = _stage(tmp_path, "use_onebitllms: true\n")
    assert cfg.use_onebitllms
    extras.check_layout(cfg, ParallelismConfig(dp_shard_size=2), "c.yml")
    with pytest.raises(ConfigError, match=r"c.yml: use_onebitllms with tp_size=2: a TP shard would take the weight "
                                          r"scale over its slice"):
        extras.check_layout(cfg, ParallelismConfig(tp_size=2), "c.yml")
    with pytest.raises(ConfigError) as err:
        _stage(tmp_path, "use_onebitllms: true\nadapter: qlora\nload_in_4bit: true\n")
    assert "use_onebitllms with adapter='qlora'" in str(err.value)
    assert "use_onebitllms with load_in_4bit / load_in_8bit / qat" in str(err.value)


def test_loftq_on_cpu_replaces_the_base_by_its_nf4_round_trip_and_starts_lora_from_the_error(tiny_llama):
    """peft's init_lora_weights="loftq" through models/loftq.py on CPU: each adapted base weight becomes its NF4
    round trip (bitsandbytes', as peft's loftq_init computes it) and B A the rank-r SVD of the rest, so with
    lora_alpha = r the adapted layer starts closer to the original weight than the quantized base alone."""
    import copy

    import bitsandbytes as bnb
    from peft import LoftQConfig, LoraConfig, get_peft_model

    from nd_parallel.models.loftq import cpu_loftq

    model = copy.deepcopy(tiny_llama)
    original = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    with cpu_loftq():
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj"],
                                                      init_lora_weights="loftq", loftq_config=LoftQConfig(4)))
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    q = bnb.nn.Params4bit(original.clone(), requires_grad=False, compress_statistics=False, quant_type="nf4").to("cpu")
    assert torch.equal(layer.base_layer.weight, bnb.functional.dequantize_4bit(q.data, q.quant_state))
    delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    assert (original - layer.base_layer.weight - delta).norm() < 0.9 * (original - layer.base_layer.weight).norm()


def test_loftq_keys(tmp_path):
    cfg = _stage(tmp_path, "adapter: lora\npeft:\n  loftq_config:\n    loftq_bits: 4\n")
    from nd_parallel.cli.train.objective import adapter_kwargs

    kwargs = adapter_kwargs(cfg)
    assert kwargs["init_lora_weights"] == "loftq" and kwargs["loftq_config"].loftq_bits == 4
    for extra, needle in [("adapter: qlora\nload_in_4bit: true\npeft: {loftq_config: {loftq_bits: 4}}\n",
                           "LoftQ starts a new LoRA adapter on an unquantized base"),
                          ("adapter: lora\npeft: {loftq_config: {loftq_bits: 3}}\n", "peft={'loftq_config'")]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            _stage(tmp_path, extra)


def test_llama4_experts_split_and_linearized_checkpoints_load_as_linears(tmp_path):
    """A fused Llama 4 checkpoint split after loading computes the same logits; saved, it is a linearized checkpoint,
    which loads straight into Linears (the class swapped while transformers builds the model), bitsandbytes' 4-bit
    Linears under load_in_4bit; the parent's checks name what cannot work."""
    from transformers import BitsAndBytesConfig

    from nd_parallel.cli.train.objective import check_llama4_experts
    from nd_parallel.config import ParallelismConfig
    from nd_parallel.models.llama4_linear import checkpoint_experts, linearize_experts, linearized_class
    from nd_parallel.testing.models import save_tiny_model

    fused = save_tiny_model("llama4_text", tmp_path / "fused", seed=1)
    model = AutoModelForCausalLM.from_pretrained(fused, dtype=torch.float32)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids).logits
    assert linearize_experts(model) == 2 and torch.equal(model(input_ids=ids).logits, want)
    model.save_pretrained(tmp_path / "linear")
    assert (checkpoint_experts(fused), checkpoint_experts(tmp_path / "linear")) == ("fused", "linearized")
    with linearized_class():
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "linear", dtype=torch.float32)
        four = AutoModelForCausalLM.from_pretrained(tmp_path / "linear", dtype=torch.float32,
                                                    quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    assert torch.equal(again(input_ids=ids).logits, want)
    assert type(four.model.layers[0].feed_forward.experts.down_projs[0]).__name__ == "Linear4bit"
    cfg = _stage(tmp_path, "llama4_linearized_experts: true\nadapter: qlora\nload_in_4bit: true\n")
    check_llama4_experts(cfg, str(tmp_path / "linear"), ParallelismConfig(dp_shard_size=2), "c.yml")
    for source, layout, needle in [(fused, ParallelismConfig(), "experts are stored fused"),
                                   (tmp_path / "linear", ParallelismConfig(tp_size=2), "with tp_size=2"),
                                   (save_tiny_model("llama", tmp_path / "dense"), ParallelismConfig(),
                                    "holds no Llama 4 expert tensors")]:
        with pytest.raises(ConfigError, match=needle):
            check_llama4_experts(cfg, str(source), layout, "c.yml")


@pytest.mark.parametrize("key", ["cls_model_config: LlamaConfig", "base_model_config: {model}"])
def test_model_config_overrides_reach_a_config_read_by_class(tmp_path, tiny_llama, key):
    """model_config with cls_model_config (or base_model_config): the overrides are set on the config object the
    ranks pass to from_pretrained, as Axolotl sets them; passed as keywords, from_pretrained would hand them to the
    model's __init__ (TypeError: unexpected keyword argument) on every rank."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from nd_parallel.cli.train.rank import _model

    tiny_llama.save_pretrained(tmp_path / "model")
    cfg = _stage(tmp_path, key.format(model=tmp_path / "model") + "\nmodel_config: {attention_dropout: 0.125}\n")
    cfg.base_model = str(tmp_path / "model")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])))
    model = _model(cfg, tokenizer)
    assert model.config.attention_dropout == 0.125
    assert torch.equal(model.lm_head.weight, tiny_llama.lm_head.weight)  # the checkpoint's weights


def test_llama4_experts_of_a_hub_checkpoint_are_read_from_its_cached_index(tmp_path, monkeypatch):
    """Axolotl's llama-4 examples name hub checkpoints (axolotl-quants/...-Linearized-...): the ranks read the index
    transformers caches for them, so the linearized class is built; a hub name counted as no experts built fused
    modules, which the linearized weights do not fill (left at their init, silently)."""
    import transformers.utils

    from nd_parallel.models.llama4_linear import checkpoint_experts

    index = tmp_path / "model.safetensors.index.json"
    asked = []

    def cached_file(repo, name, **kwargs):
        asked.append((repo, name, kwargs.get("revision")))
        return str(index) if name == index.name else None

    monkeypatch.setattr(transformers.utils, "cached_file", cached_file)
    for key, kind in [("model.layers.0.feed_forward.experts.gate_projs.0.weight", "linearized"),
                      ("model.layers.0.feed_forward.experts.gate_up_proj", "fused"),
                      ("model.layers.0.mlp.up_proj.weight", None)]:
        index.write_text(json.dumps({"weight_map": {key: "model-00001.safetensors"}}))
        assert checkpoint_experts("org/Llama-4-Linearized", revision="r1") == kind
    assert asked[0] == ("org/Llama-4-Linearized", "model.safetensors.index.json", "r1")


def test_eaft_refuses_a_model_whose_forward_computes_its_own_loss():
    """cpmant's forward takes a CrossEntropyLoss itself, never self.loss_function: EAFT would silently not apply."""
    from transformers import CpmAntConfig, CpmAntForCausalLM

    model = CpmAntForCausalLM(CpmAntConfig(vocab_size=32, hidden_size=8, num_attention_heads=2, dim_head=4,
                                           dim_ff=16, num_hidden_layers=1, prompt_length=2, segment_types=2))
    with pytest.raises(ValueError, match="CpmAntForCausalLM's forward does not compute its loss with"):
        use_eaft_loss(model)


def test_bitnet_takes_linear_subclasses_as_onebitllms_does():
    from nd_parallel.models.bitnet import BitNetLinear, to_bitnet

    class Own(torch.nn.Linear):
        pass

    model = torch.nn.ModuleDict({"a": Own(4, 4), "b": torch.nn.Linear(4, 4)})
    assert sorted(to_bitnet(model)) == ["a", "b"] and all(type(m) is BitNetLinear for m in model.values())
    assert to_bitnet(model) == []  # already converted
