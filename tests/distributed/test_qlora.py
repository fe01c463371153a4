"""QLoRA parity: a LoRA adapter on a 4-bit NF4 base (double quantization) trains under FSDP2, PP2 and TP2 exactly as
in one process on the same quantized base. One 2-rank launch. (8-bit bases are refused: test_quantized.py.)

Tolerance, derived: quantization is a deterministic function of the checkpoint's weights (every load gives the same
packed bytes and statistics, test_quantized.py), so every rank and the reference compute with the same dequantized
base; what differs between layouts is the fp32 reduction order of the adapter's gradients (FSDP2's reduce-scatter
sums two ranks' partial gradients; PP sums micro-batches; TP sums row-wise layers' partial outputs and column-wise
layers' partial input gradients), as for unquantized LoRA. Under TP each rank dequantizes only its rows (or its
columns) of the same packed weight, which gives exactly those rows of the whole dequantized weight (the block scales
are the same fp32 numbers), so the base adds no error of its own. So the parity tolerances of
unquantized training hold unchanged: loss and grad norm rtol 1e-5, adapter parameters atol 1e-5 (measured: loss
<= 1e-7 relative, grad norms <= 2e-7, parameters <= 2e-7, all three rows). Every rank also holds the quantized base whole (replicated, not sharded
under FSDP2; only its own stage's layers under PP; under TP half of each layer whose blocks line up with the
split, the others whole): checked from the bytes each rank reports.
"""

import sys
from pathlib import Path

import pytest
import torch

from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, RunResult, compare, train_reference

sys.path.insert(0, str(Path(__file__).parent))
from qlora_recipe import qlora_model  # noqa: E402

pytest.importorskip("bitsandbytes")

WORKER = "tests/distributed/qlora_worker.py"
RECIPE = dict(steps=3)
SAMPLES = dict(n=16, seq_len=32, seed=1)
# name -> (bits, layout, data-parallel ranks)
ROWS = {"fsdp2": (4, {"dp_shard_size": 2}, 2), "pp2": (4, {"pp_size": 2}, 1), "tp2": (4, {"tp_size": 2}, 1)}


@pytest.fixture(scope="module")
def launched(launch_worker, tiny_model):
    spec = {"models": {"llama": tiny_model("llama")}, "recipe": RECIPE, "samples": SAMPLES,
            "runs": [["llama", bits, layout, name] for name, (bits, layout, _) in ROWS.items()]}
    return launch_worker("qlora_2r", WORKER, 2, spec)


def _reference(model_dir, bits, dp):
    from nd_parallel.models.quantized import quantized_params

    model = qlora_model(model_dir, bits)
    quantized = quantized_params(model)
    ref = train_reference(None, make_samples(**SAMPLES), dp, Recipe(**RECIPE), model=model)
    ref.model_quantized = quantized
    ref.tp2_bytes = _tp2_bytes(model)
    return ref


def _tp2_bytes(model) -> int:
    """Quantized bytes one TP2 rank should hold: half of each layer whose blocks line up with its split, all of the
    others (replicated), from the model's own tp_plan."""
    from nd_parallel.distributed.tensor_parallel import expand_plan, match_plan, resolve_plan
    from nd_parallel.distributed.tensor_parallel_quantized import QUANTIZED_STYLES, _aligned, is_quantized_linear

    model = model.get_base_model()  # the HF model inside PEFT's wrapper, as TP sees it
    plan = expand_plan(model, match_plan(model, resolve_plan(model, None)))
    total = 0
    for name, module in model.named_modules():
        if is_quantized_linear(module) and not hasattr(module, "base_layer"):
            size = module.weight.numel() * module.weight.element_size()
            style = plan.get(name)
            split = style is not None and _aligned(module.weight.quant_state, QUANTIZED_STYLES[style], 2)
            total += size // 2 if split else size
    return total


@pytest.mark.parametrize("name", list(ROWS))
def test_qlora_matches_one_process_on_the_same_quantized_base(launched, tiny_model, memo, name):
    bits, _, dp = ROWS[name]
    ref = memo((bits, dp), lambda: _reference(tiny_model("llama"), bits, dp))
    got = torch.load(launched / f"{name}.pt")
    adapter = {k: v for k, v in ref.state.items() if "lora_" in k}
    assert adapter and set(got["state"]) == set(adapter)
    diff = compare(RunResult(ref.losses, ref.norms, adapter), RunResult(got["losses"], got["norms"], got["state"]))
    assert diff["loss_rel"] <= 1e-5 and diff["norm_rel"] <= 1e-5 and diff["param_abs"] <= 1e-5, diff
    assert got["rank_spread"] == 0.0
    assert ref.losses[-1] < ref.losses[0]  # the adapter trains
    # The quantized base (packed NF4 bytes) is held whole by every FSDP2 rank, in part by each PP stage, and split
    # by TP where its blocks line up with the split (the tiny model's 64-wide o_proj stays whole).
    base = sum(p.numel() * p.element_size() for p in ref.model_quantized)
    held = got["memory"]["quantized"]
    if name == "tp2":
        assert held == ref.tp2_bytes < base, (held, ref.tp2_bytes, base)
    else:
        assert held == base if name != "pp2" else 0 < held < base, (held, base)
