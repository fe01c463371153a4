"""Quantized MoE expert tensors (quantize_moe_experts) under layouts: LoRA on a tiny qwen3_moe whose attention
Linears AND fused expert tensors are a 4-bit NF4 base (8-bit int8 rows for the 8-bit rows) trains under FSDP2, DDP
(dp_replicate_size), PP2 and CP2 exactly as in one process on the same quantized base; and a run resumed from
save_state equals the uninterrupted one (FSDP2 and PP2 4-bit, FSDP2 8-bit). One 2-rank launch (qlora_worker.py).
The adapter (peft_recipe.TARGETS) sits on the attention Linears and on the quantized expert tensors themselves: peft
turns the v4 names gate_proj / up_proj / down_proj into target_parameters on transformers 5's fused experts, and a
ParamWrapper over the dequantizing parametrization (models/peft.py) adapts each; before that fix they matched nothing
on a quantized base, and the adapter was on attention only.

Tolerance, derived as for the Linears' QLoRA rows (test_qlora.py): quantization is a deterministic function of the
checkpoint (the same bytes on every load, tests/unit/test_quantized_experts.py), so every rank and the reference
dequantize the same packed experts to the same fp32 tensors; every rank holds them whole (FSDP2 and CP: left out of
sharding, replicated; PP: its own stage's layers), so the base adds no error, and what differs between layouts is
the fp32 reduction order of the adapter's gradients (FSDP2's reduce-scatter of two ranks' partial sums; PP's sum
over micro-batches). The routing is computed by the float router from the same activations. So the unquantized
parity tolerances hold unchanged: loss and grad norm rtol 1e-5, adapter parameters atol 1e-5 (measured: loss
<= 1.8e-7 relative, grad norms <= 1.1e-7, adapter <= 1.6e-6 for the 8-bit row, <= 2.1e-7 otherwise). Also checked from
the bytes each rank reports: FSDP2 / CP ranks hold the whole quantized base (experts included), PP stages a part.
"""

import sys
from pathlib import Path

import pytest
import torch

from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, train_reference

sys.path.insert(0, str(Path(__file__).parent))
from qlora_recipe import assert_adapter_matches, assert_resume_equals, qlora_model  # noqa: E402

pytest.importorskip("bitsandbytes")

WORKER = "tests/distributed/qlora_worker.py"
RECIPE = dict(steps=3)
SAMPLES = dict(n=16, seq_len=32, seed=1)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
# name -> (bits, layout, data-parallel ranks)
ROWS = {"fsdp2": (4, {"dp_shard_size": 2}, 2), "ddp": (4, {"dp_replicate_size": 2}, 2), "pp2": (4, {"pp_size": 2}, 1),
        "cp2": (4, {"cp_size": 2}, 1), "fsdp2_8bit": (8, {"dp_shard_size": 2}, 2), "pp2_8bit": (8, {"pp_size": 2}, 1)}
# Checkpoint rows, as in test_qlora.py: save_state after step SAVE_AT, "resume_<row>" resumes under the same layout.
RESUME, SAVE_AT = ("fsdp2", "pp2", "fsdp2_8bit"), 1


def _spec(out, tiny_model):
    saving = {n: {"save_at": SAVE_AT, "ckpt": str(out / f"ckpt_{n}")} for n in RESUME}
    return {"models": {"qwen3_moe": tiny_model("qwen3_moe", **MOE)}, "recipe": RECIPE, "samples": SAMPLES,
            "quantize_experts": True,
            "runs": [["qwen3_moe", bits, layout, name, {}, saving.get(name, {})]
                     for name, (bits, layout, _) in ROWS.items()]
            + [["qwen3_moe", ROWS[n][0], ROWS[n][1], f"resume_{n}", {}, {"resume": saving[n]["ckpt"]}]
               for n in RESUME]}


@pytest.fixture(scope="module")
def launched(launch_worker, tiny_model):
    return launch_worker("qlora_experts_2r", WORKER, 2, lambda out: _spec(out, tiny_model))


def _reference(model_dir, bits, dp):
    from nd_parallel.models.quantized import quantized_params
    from nd_parallel.models.quantized_experts import quantized_experts

    model = qlora_model(model_dir, bits, experts=True)
    assert len(quantized_experts(model)) == 4  # gate_up_proj and down_proj of both layers
    base = sum(p.numel() * p.element_size() for p in quantized_params(model))
    ref = train_reference(None, make_samples(**SAMPLES), dp, Recipe(**RECIPE), model=model)
    ref.base_bytes = base
    return ref


@pytest.mark.parametrize("name", list(ROWS))
def test_quantized_experts_match_one_process_on_the_same_quantized_base(launched, tiny_model, memo, name):
    bits, _, dp = ROWS[name]
    ref = memo((bits, dp), lambda: _reference(tiny_model("qwen3_moe", **MOE), bits, dp))
    got = torch.load(launched / f"{name}.pt")
    assert_adapter_matches(ref, got)
    on_experts = [k for k in got["state"] if ".experts." in k and "lora_B" in k]
    assert len(on_experts) == 4, sorted(on_experts)  # the adapter on both quantized tensors of both layers
    assert all(got["state"][k].abs().max() > 0 for k in on_experts)  # each moved from its zero init
    held = got["memory"]["quantized"]
    assert held == ref.base_bytes if not name.startswith("pp2") else 0 < held < ref.base_bytes, (held, ref.base_bytes)


@pytest.mark.parametrize("name", RESUME)
def test_quantized_experts_resume_equals_the_uninterrupted_run(launched, name):
    """save_state after step SAVE_AT, load_state under the same layout, the remaining steps: losses, grad norms and
    the final adapter bit-equal to the uninterrupted run (same layout, same sums, exact restore), and the same
    quantized base, experts included: packed bytes and their statistics (saved with them, quantized_experts.py)."""
    whole, resumed = torch.load(launched / f"{name}.pt"), torch.load(launched / f"resume_{name}.pt")
    assert_resume_equals(whole, resumed, SAVE_AT, RECIPE["steps"])
