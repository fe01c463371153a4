"""QLoRA parity: a LoRA adapter on a 4-bit NF4 base (double quantization) trains under FSDP2 and PP2 exactly as in
one process on the same quantized base. One 2-rank launch. (TP and 8-bit bases are refused: test_quantized.py.)

Tolerance, derived: quantization is a deterministic function of the checkpoint's weights (every load gives the same
packed bytes and statistics, test_quantized.py), so every rank and the reference compute with the same dequantized
base; what differs between layouts is the fp32 reduction order of the adapter's gradients (FSDP2's reduce-scatter
sums two ranks' partial gradients; PP sums micro-batches), as for unquantized LoRA. So the parity tolerances of
unquantized training hold unchanged: loss and grad norm rtol 1e-5, adapter parameters atol 1e-5 (measured: loss
<= 2e-7 relative, parameters <= 1e-7). Every rank also holds the quantized base whole (replicated, not sharded
under FSDP2; only its own stage's layers under PP): checked from the bytes each rank reports.
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
ROWS = {"fsdp2": (4, {"dp_shard_size": 2}, 2), "pp2": (4, {"pp_size": 2}, 1)}


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
    return ref


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
    # The quantized base (packed NF4 / int8 bytes) is held whole by every FSDP2 rank, and in part by each PP stage.
    base = sum(p.numel() * p.element_size() for p in ref.model_quantized)
    held = got["memory"]["quantized"]
    assert held == base if name != "pp2" else 0 < held < base, (held, base)
