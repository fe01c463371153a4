"""Context parallelism refuses, before any collective, a model that mixes tokens where its attention kernels do not
see it, naming the module; found from the model's modules, not from family names. And gpt-oss' attention sinks
(which CP does apply) match transformers' own attention in one process."""

import pytest
import torch
import torch.nn as nn

from nd_parallel import ParallelismConfig
from nd_parallel.distributed.context_parallel import check_model
from nd_parallel.distributed.context_parallel.attention import KVMeta, local_attention
from nd_parallel.models.hf import sequence_mixers
from nd_parallel.testing.models import tiny_config

CP2 = ParallelismConfig(cp_size=2)


def build(model_type: str, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))


@pytest.mark.parametrize("model_type,overrides,module,how", [
    ("lfm2", dict(layer_types=["conv", "full_attention"]), "model.layers.0.conv.conv", "Conv1d over the sequence"),
    ("qwen3_next", {}, "model.layers.0.linear_attn", "state-space scan"),
    ("jamba", {}, "model.layers.0.mamba", "state-space scan"),
    ("falcon_h1", {}, "model.layers.0.mamba", "state-space scan"),
    ("bamba", {}, "model.layers.0.mamba", "state-space scan"),
    ("minimax", {}, "model.layers.1.self_attn", "state-space scan"),
    ("recurrent_gemma", {}, "model.layers.0.temporal_block", ""),
])
def test_token_mixing_outside_attention_is_refused_naming_the_module(model_type, overrides, module, how):
    model = build(model_type, **overrides)
    with pytest.raises(NotImplementedError, match=r"mixes tokens along the sequence outside attention: "
                                                  rf"{module}\S* \(\w+: [^)]*{how}.*use cp_size=1"):
        check_model(model, CP2, "cpu")


def test_a_new_family_with_a_convolution_is_refused():
    """No family name anywhere: a llama whose layers gained a depthwise causal convolution (a family transformers
    does not have) is refused the same way."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class ConvMixer(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.conv = nn.Conv1d(width, width, kernel_size=3, groups=width, padding=2)

        def forward(self, x):
            return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)

    class ConvLayer(LlamaDecoderLayer):
        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            self.token_mixer = ConvMixer(config.hidden_size)

        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states + self.token_mixer(hidden_states), *args, **kwargs)

    model = build("llama")
    model.model.layers = nn.ModuleList(ConvLayer(model.config, i) for i in range(len(model.model.layers)))
    assert check_model(build("llama"), CP2, "cpu") is None  # the plain family passes
    with pytest.raises(NotImplementedError, match=r"model.layers.0.token_mixer.conv \(Conv1d: Conv1d over the "
                                                  r"sequence, kernel 3\) \(and 1 more\)"):
        check_model(model, CP2, "cpu")


def test_pointwise_convolutions_and_plain_attention_mix_nothing():
    """GPT-2's Conv1D is a linear layer, and a kernel-1 Conv1d sees one token: neither is reported."""
    assert sequence_mixers(build("gpt2")) == []
    assert sequence_mixers(build("llama")) == []
    model = build("llama")
    model.model.layers[0].mlp.pointwise = nn.Conv1d(8, 8, kernel_size=1)
    assert sequence_mixers(model) == []


@pytest.mark.parametrize("model_type,keyword", [("deepseek_v32", "indices"), ("glm_moe_dsa", "indices")])
def test_attention_inputs_the_kernels_do_not_apply_are_refused(model_type, keyword):
    """Sparse attention hands the attention function the key indices each query may see; the CP kernels would
    silently attend to every key."""
    with pytest.raises(NotImplementedError, match=rf"passes \['{keyword}'\] to its attention function"):
        check_model(build(model_type), CP2, "cpu")


@pytest.mark.parametrize("kernel", ["math", "flash_cpu"])
def test_sinks_match_gpt_oss_eager_attention(kernel):
    """The sink logit enters every row's softmax as transformers' gpt-oss eager attention puts it there: output
    and the gradients of q, k, v and the sinks, with a sliding window."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    q = torch.randn(2, 4, 12, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 12, 16, requires_grad=True) for _ in range(2))
    holder = nn.Module()
    holder.sinks, holder.num_key_value_groups = nn.Parameter(torch.randn(4)), 2
    i = torch.arange(12)
    visible = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 5)
    mask = torch.zeros(12, 12).masked_fill(~visible, float("-inf"))[None, None]
    ref, _ = eager_attention_forward(holder, q, k, v, mask, scaling=0.25)
    weight = torch.randn_like(ref)
    expected = torch.autograd.grad((ref * weight).sum(), (q, k, v, holder.sinks))
    sinks = holder.sinks.detach().clone().requires_grad_()
    out = local_attention(q, k, v, KVMeta(i), scale=0.25, sliding_window=5, sinks=sinks, kernel=kernel)
    got = torch.autograd.grad((out.transpose(1, 2) * weight).sum(), (q, k, v, sinks))
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=0, atol=1e-5)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_sinks_of_the_wrong_shape_are_refused():
    q = k = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match=r"sinks of shape \(2,\) for 4 query heads"):
        local_attention(q, k[:, :2], k[:, :2], KVMeta(torch.arange(8)), scale=1.0, sinks=torch.zeros(2))


def test_sinks_are_applied_by_ring_and_ulysses_and_refused_by_torchs_sdpa():
    """gpt-oss passes its sinks (s_aux) to the attention function: the ring and Ulysses add them to the softmax;
    torch's context-parallel SDPA cannot, and is refused up front rather than when the first forward runs."""
    model = build("gpt_oss", num_local_experts=4, num_experts_per_tok=2)
    for backend in ("ring", "ulysses"):
        assert check_model(model, ParallelismConfig(cp_size=2, cp_backend=backend), "cpu") is None
    with pytest.raises(NotImplementedError, match=r"GptOssForCausalLM has attention sinks \(s_aux\), which "
                                                  r"cp_backend='torch'.*use cp_backend='ring' or 'ulysses'"):
        check_model(model, ParallelismConfig(cp_size=2, cp_backend="torch"), "cuda")


def test_the_orchestrators_checks_refuse_it_before_the_mesh():
    """parallelize.check_model (step 1, no process group exists here) is where the refusal happens in prepare."""
    from nd_parallel.distributed.parallelize import check_model as check_layout

    model = build("lfm2", layer_types=["full_attention", "conv"])
    with pytest.raises(NotImplementedError, match=r"model.layers.1.conv.conv \(Conv1d: Conv1d over the sequence"):
        check_layout(model, CP2, "cpu")
    assert check_layout(model, ParallelismConfig(pp_size=2), "cpu") is None  # only CP is refused


def test_an_attention_mask_computed_in_the_layer_is_refused_under_cp_and_tp():
    """Doge's attention builds a dynamic mask from its value states and passes it as the mask: the ring builds its
    masks from global positions, and under TP the mask's heads are not this rank's; both refused up front, found
    from the attention's source (the mask passed is not the forward's own argument)."""
    from transformers import AutoModelForCausalLM

    from nd_parallel.distributed.tensor_parallel import check_model as check_tp
    from nd_parallel.models.attention_calls import computed_attention_masks
    from nd_parallel.testing.tiny_configs import tiny_sweep_config

    model = AutoModelForCausalLM.from_config(tiny_sweep_config("doge"))
    attention = type(model.model.layers[0].self_attn)
    assert computed_attention_masks(attention) == ("attn_mask",)
    assert computed_attention_masks(type(build("llama").model.layers[0].self_attn)) == ()
    with pytest.raises(NotImplementedError, match=r"DogeAttention computes its own attention mask \(attn_mask\).*"
                                                  r"use cp_size=1"):
        check_model(model, CP2, "cpu")
    with pytest.raises(NotImplementedError, match=r"self_attn \(DogeAttention\) computes its own attention mask.*"
                                                  r"tp_size=1"):
        check_tp(model, ParallelismConfig(tp_size=2))


def test_cp_on_a_local_mamba_hybrid_is_refused_before_any_rank_starts(tmp_path):
    """Axolotl's examples/nemotron-h/nano-30b-a3b-qlora-cp.yaml: the ranks refused CP on NemotronH's Mamba2 mixer
    after launch; build_job now refuses it from the local config.json (meta device), with the same message."""
    from types import SimpleNamespace

    from nd_parallel.cli.train.job import check_local_model
    from nd_parallel.config import ConfigError

    for family in ("nemotron_h", "llama"):
        tiny_config(family).save_pretrained(tmp_path / family)
    cfg = SimpleNamespace(base_model=str(tmp_path / "nemotron_h"), base_model_config=None, trust_remote_code=True,
                          qat=None, model_config={"output_router_logits": False}, processor_type=None,
                          model_type=None, fsdp_wrap_classes=[])
    cp2 = ParallelismConfig(dp_shard_size=1, cp_size=2).resolve(2)
    with pytest.raises(ConfigError, match=r"c.yml: context_parallel_size=2 with base_model .*nemotron_h: "
                                          r"NemotronHForCausalLM mixes tokens along the sequence outside attention: "
                                          r"model.layers.0.mixer \(NemotronHMamba2Mixer.*use cp_size=1"):
        check_local_model(cfg, cp2, "c.yml")
    check_local_model(cfg, ParallelismConfig(dp_shard_size=2).resolve(2), "c.yml")  # no CP: no check
    check_local_model(SimpleNamespace(**{**vars(cfg), "base_model": str(tmp_path / "llama")}), cp2, "c.yml")
    hub = SimpleNamespace(**{**vars(cfg), "base_model": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"})
    check_local_model(hub, cp2, "c.yml")  # not local: the ranks check the loaded model


def test_tp_on_a_local_model_without_a_tp_plan_is_refused_before_any_rank_starts(tmp_path):
    """Llama 3.2 Vision (Mllama): transformers gives it no tp_plan; the ranks refused tensor_parallel_size=2 after
    launch, build_job now refuses it from the local config.json (meta device, the class the ranks load)."""
    from types import SimpleNamespace

    from nd_parallel.cli.train.job import check_local_model
    from nd_parallel.config import ConfigError
    from nd_parallel.testing.multimodal import save_tiny_vlm

    mllama = save_tiny_vlm("mllama", tmp_path / "mllama")
    tiny_config("llama").save_pretrained(tmp_path / "llama")
    cfg = SimpleNamespace(base_model=str(mllama), base_model_config=None, trust_remote_code=None, qat=None,
                          model_config=None, processor_type="AutoProcessor", model_type=None, fsdp_wrap_classes=[])
    tp2 = ParallelismConfig(tp_size=2).resolve(2)
    with pytest.raises(ConfigError, match=r"c.yml: tensor_parallel_size=2 with base_model .*mllama: "
                                          r"MllamaForConditionalGeneration has no tp_plan"):
        check_local_model(cfg, tp2, "c.yml")
    check_local_model(cfg, ParallelismConfig(dp_shard_size=2).resolve(2), "c.yml")  # no TP: no check
    llama = SimpleNamespace(**{**vars(cfg), "base_model": str(tmp_path / "llama"), "processor_type": None})
    check_local_model(llama, tp2, "c.yml")  # Llama has a tp_plan


def test_fsdp_wrap_class_the_model_does_not_have_is_refused_before_any_rank_starts(tmp_path):
    """fsdp_config transformer_layer_cls_to_wrap (either spelling; a comma-separated string as Accelerate reads it,
    or a list) must name classes of the model: FSDP2 here shards per decoder layer whatever it names, and a name the
    model lacks (a config copied from another family) is refused from the local config.json with the model's own
    decoder-layer class, as Accelerate's wrap policy refuses it; a hub name is left to the ranks."""
    from types import SimpleNamespace

    from nd_parallel.cli.train.job import check_local_model
    from nd_parallel.cli.train.keys import wrap_classes
    from nd_parallel.config import ConfigError

    assert wrap_classes({"transformer_layer_cls_to_wrap": "JambaAttentionDecoderLayer, JambaMambaDecoderLayer"}) == [
        "JambaAttentionDecoderLayer", "JambaMambaDecoderLayer"]
    assert wrap_classes({"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}) == ["LlamaDecoderLayer"]
    assert wrap_classes({"offload_params": True}) == [] and wrap_classes(None) == []
    tiny_config("llama").save_pretrained(tmp_path / "llama")
    cfg = SimpleNamespace(base_model=str(tmp_path / "llama"), base_model_config=None, trust_remote_code=None,
                          qat=None, model_config=None, processor_type=None, model_type=None,
                          fsdp_wrap_classes=["Qwen3_5DecoderLayer", "LlamaDecoderLayer"])
    fsdp2 = ParallelismConfig(dp_shard_size=2).resolve(2)
    with pytest.raises(ConfigError, match=r"c.yml: fsdp_config transformer_layer_cls_to_wrap names "
                                          r"Qwen3_5DecoderLayer, which LlamaForCausalLM .* its decoder layers are "
                                          r"LlamaDecoderLayer: set transformer_layer_cls_to_wrap: LlamaDecoderLayer"):
        check_local_model(cfg, fsdp2, "c.yml")
    for names in (["LlamaDecoderLayer"], ["LlamaDecoderLayer", "LlamaAttention"], []):
        check_local_model(SimpleNamespace(**{**vars(cfg), "fsdp_wrap_classes": names}), fsdp2, "c.yml")
    hub = SimpleNamespace(**{**vars(cfg), "base_model": "Qwen/Qwen3.5-9B"})
    check_local_model(hub, fsdp2, "c.yml")  # not local: nothing to read here
