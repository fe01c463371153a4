"""QLoRA parity: a LoRA adapter on a 4-bit NF4 base (double quantization) trains under FSDP2, PP2, TP2 and CP2 exactly
as in one process on the same quantized base; LoRA on an 8-bit (LLM.int8) base under FSDP2, PP2 and CP2 likewise; and
bitsandbytes' AdamW8bit under FSDP2 as in one process (last test, its own tolerance); and a run resumed from
save_state equals the uninterrupted one (FSDP2 and PP2 4-bit, FSDP2 8-bit; issue 19). One 2-rank launch.

The 8-bit base on CPU: bitsandbytes (0.50) runs a Linear8bitLt in training mode as ``MatMul8bitFp``: the int8 rows
times their per-row scale / 127, then an fp32 matmul, forward and backward; a per-row function of the frozen weight,
independent of the batch, so it adds no layout-dependent error either. (In eval mode it takes LLM.int8's
outlier-decomposition path, whose outlier columns depend on the batch each rank sees: not compared here.)

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
from qlora_recipe import assert_adapter_matches, assert_resume_equals, qlora_model  # noqa: E402

pytest.importorskip("bitsandbytes")

WORKER = "tests/distributed/qlora_worker.py"
RECIPE = dict(steps=3)
SAMPLES = dict(n=16, seq_len=32, seed=1)
# name -> (bits, layout, data-parallel ranks)
ROWS = {"fsdp2": (4, {"dp_shard_size": 2}, 2), "pp2": (4, {"pp_size": 2}, 1), "tp2": (4, {"tp_size": 2}, 1),
        "cp2": (4, {"cp_size": 2}, 1), "fsdp2_8bit": (8, {"dp_shard_size": 2}, 2), "pp2_8bit": (8, {"pp_size": 2}, 1),
        "cp2_8bit": (8, {"cp_size": 2}, 1)}
# Checkpoint rows: these rows save_state after step SAVE_AT (training goes on); "resume_<row>" loads it under the same
# layout and runs the remaining steps (test_qlora_resume_equals_the_uninterrupted_run).
RESUME, SAVE_AT = ("fsdp2", "pp2", "fsdp2_8bit"), 1
# Full fine-tuning of the unquantized model with bitsandbytes' AdamW8bit, one process vs FSDP2 (test_8bit_optimizer...)
OPTIM_ROW = ("fsdp2_adamw8bit", {"dp_shard_size": 2}, 2, {"optim": "adamw_8bit"})


def _spec(out, tiny_model):
    name, layout, _, overrides = OPTIM_ROW
    saving = {n: {"save_at": SAVE_AT, "ckpt": str(out / f"ckpt_{n}")} for n in RESUME}
    return {"models": {"llama": tiny_model("llama")}, "recipe": RECIPE, "samples": SAMPLES,
            "runs": [["llama", bits, layout, name, {}, saving.get(name, {})]
                     for name, (bits, layout, _) in ROWS.items()]
            + [["llama", ROWS[n][0], ROWS[n][1], f"resume_{n}", {}, {"resume": saving[n]["ckpt"]}] for n in RESUME]
            + [["llama", 0, layout, name, overrides]]}


@pytest.fixture(scope="module")
def launched(launch_worker, tiny_model):
    return launch_worker("qlora_2r", WORKER, 2, lambda out: _spec(out, tiny_model))


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
    assert_adapter_matches(ref, got)
    # The quantized base (packed NF4 bytes, or int8 rows) is held whole by every FSDP2 and CP rank, in part by each
    # PP stage, and split by TP where its blocks line up with the split (the tiny model's 64-wide o_proj stays whole).
    base = sum(p.numel() * p.element_size() for p in ref.model_quantized)
    held = got["memory"]["quantized"]
    if name == "tp2":
        assert held == ref.tp2_bytes < base, (held, ref.tp2_bytes, base)
    else:
        assert held == base if not name.startswith("pp2") else 0 < held < base, (held, base)


def test_8bit_optimizer_under_fsdp2_matches_one_process(launched, tiny_model, memo):
    """bitsandbytes' AdamW8bit, one process vs FSDP2 on 2 ranks, full fine-tuning of the unquantized tiny model.

    Tolerance, derived (nd_parallel/distributed/optimizer_8bit.py): every parameter with 8-bit state has a dim-0 shard
    whose ends fall on 256-value blocks here (rows-per-rank x row length: 128x64, 32x64, 64x64, 32x128), so each rank's
    blocks are one process's blocks, and given the same gradients the step is bit-equal (test_quantized.py). The
    gradients are not bit-equal: FSDP2 sums two ranks' partial gradients, one process sums the whole batch, a fp32
    reduction-order difference (~1e-7 relative). That difference reaches the 8-bit state only where a state value lies
    within ~1e-7 of a rounding boundary of the dynamic map: there the stored code moves to the adjacent one, for that
    one element. So: loss and grad norm rtol 1e-5 as any fp32 parity; block absmax rtol 1e-5; codes equal except a
    few (<= 0.1%), each exactly one map step apart; parameters atol 1e-5 except the few elements such a code touched
    (<= 0.1%), each bounded by Adam's own step size (|m_hat / sqrt(v_hat)| <= ~1, so <= 2 lr per later step: 2 lr x
    (steps - 1)). A misaligned block or a wrong reduction would change the absmax and nearly every code of a block.
    Measured: loss <= 2e-7 relative, norms <= 5e-7, 2 of 81,920 codes one step apart, 3 parameter elements over 1e-5
    (max 3.4e-5)."""
    from transformers import AutoModelForCausalLM

    name, _, dp, overrides = OPTIM_ROW
    recipe = Recipe(**RECIPE, **overrides)
    ref = memo(name, lambda: train_reference(tiny_model("llama"), make_samples(**SAMPLES), dp, recipe))
    got = torch.load(launched / f"{name}.pt")
    diff = compare(ref, RunResult(got["losses"], got["norms"], got["state"]))
    assert diff["loss_rel"] <= 1e-5 and diff["norm_rel"] <= 1e-5, diff
    assert got["rank_spread"] == 0.0 and ref.losses[-1] < ref.losses[0]
    total = sum(v.numel() for v in ref.state.values())
    over = sum(int(((ref.state[k] - got["state"][k]).abs() > 1e-5).sum()) for k in ref.state)
    assert over <= total // 1000 and diff["param_abs"] <= 2 * recipe.lr * (recipe.steps - 1), (over, total, diff)

    names = [n for n, _ in AutoModelForCausalLM.from_pretrained(tiny_model("llama")).named_parameters()]
    ref_state = dict(zip(names, ref.optimizer.param_groups[0]["params"]))  # rank 0 holds each tensor's first rows
    codes = differ = 0
    for pname, (aligned, local) in got["shard_states"].items():
        full = ref.optimizer.state[ref_state[pname]]
        if local["state1"].dtype != torch.uint8:
            continue  # under min_8bit_size: fp32 state, compared through the parameters
        assert aligned, pname  # the sizes above put every 8-bit shard on block boundaries
        blocks = local["absmax1"].numel()
        for key in ("absmax1", "absmax2"):
            torch.testing.assert_close(local[key], full[key][:blocks], rtol=1e-5, atol=0, msg=f"{pname}.{key}")
        for key, qmap in (("state1", full["qmap1"]), ("state2", full["qmap2"])):
            order = torch.argsort(torch.argsort(qmap))  # code -> its place among the map's values
            mine, theirs = order[local[key].long()], order[full[key][:local[key].shape[0]].long()]
            codes, differ = codes + mine.numel(), differ + int((mine != theirs).sum())
            assert int((mine - theirs).abs().max()) <= 1, (pname, key)
    assert codes and differ <= codes // 1000, (differ, codes)


@pytest.mark.parametrize("name", RESUME)
def test_qlora_resume_equals_the_uninterrupted_run(launched, name):
    """Issue 19: save_state after step SAVE_AT, then load_state under the same layout and train the remaining steps:
    every loss, grad norm and the final adapter equal the uninterrupted run's, bit for bit (the same layout sums in
    the same order, and the checkpoint restores adapter, AdamW state, scheduler, RNG and data position exactly), and
    the resumed run holds the same quantized base: packed bytes and every quantization statistic (for a 4-bit base
    also the ones its checkpoint keys hold beside the weight, absmax, quant_map and the nested ones, which a strict
    load refused before models/quantized.accept_4bit_state)."""
    whole, resumed = torch.load(launched / f"{name}.pt"), torch.load(launched / f"resume_{name}.pt")
    assert_resume_equals(whole, resumed, SAVE_AT, RECIPE["steps"])
