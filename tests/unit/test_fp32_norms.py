"""fp32_norms (cli/train/norms.py, distributed/fsdp.FP32_TAG): under a bf16 policy the tagged norm modules run with
fp32 parameters on fp32 inputs and the projections after them get bf16 back, every other module computes in bf16;
the class patterns read as Axolotl's (suffix, or dotted module.Class); a line in fp32 training. Training parity:
test_train_fp32_norms.py."""

import json
from types import SimpleNamespace

import pytest
import torch

from nd_parallel.cli.train import norms


def test_tagged_norms_compute_in_fp32_under_a_bf16_policy(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM

    from nd_parallel.distributed.fsdp import apply_fsdp
    from nd_parallel.distributed.mesh import single_process_group
    from nd_parallel.testing.models import save_tiny_model

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model("llama", tmp_path / "m", seed=0), dtype=torch.float32)
    assert norms.tag(model, SimpleNamespace(fp32_norms=True, fp32_norm_classes=None)) == 5  # 2 layers x 2 + final
    seen = {}

    def record(module, args, out):
        kind = "norm" if norms.matches(module, norms.DEFAULT) else "linear"
        seen.setdefault(kind, set()).add((module.weight.dtype, args[0].dtype, out.dtype))

    for m in model.modules():
        if norms.matches(m, norms.DEFAULT) or isinstance(m, torch.nn.Linear):
            m.register_forward_hook(record)
    single_process_group("cpu")
    try:
        apply_fsdp(model, init_device_mesh("cpu", (1,)), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        model(torch.randint(5, 100, (1, 8)))
    finally:
        dist.destroy_process_group()
    # the norm computes in fp32 (its hook sees the output before FSDP2 casts it); the projections after it get bf16
    assert seen["norm"] == {(torch.float32, torch.float32, torch.float32)}, seen
    assert seen["linear"] == {(torch.bfloat16, torch.bfloat16, torch.bfloat16)}, seen


def test_patterns_and_config(tmp_path):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(4)
    assert norms.matches(norm, ["RMSNorm"]) and norms.matches(norm, [f"{LlamaRMSNorm.__module__}.LlamaRMSNorm"])
    assert not norms.matches(norm, ["LayerNorm", "llama.LlamaRMSNorm"])
    from nd_parallel.cli.train.config import load_train_config
    from nd_parallel.config import ConfigError

    base = {"base_model": "./m", "datasets": [{"path": "d.jsonl", "type": "completion"}]}
    (tmp_path / "c.yml").write_text(json.dumps({**base, "fp32_norms": True}))
    assert any(n.startswith("fp32_norms: this run computes in fp32") for n in load_train_config(
        tmp_path / "c.yml", environ={}).notes)
    (tmp_path / "c.yml").write_text(json.dumps({**base, "fp32_norm_classes": ["RMSNorm"]}))
    with pytest.raises(ConfigError, match="fp32_norm_classes without fp32_norms"):
        load_train_config(tmp_path / "c.yml", environ={})
