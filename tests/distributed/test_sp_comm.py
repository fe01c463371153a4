"""Sequence parallelism's backward communication (distributed/sequence_parallel.py): one 2-rank launch, one step of a
tiny 2-layer Llama under TP2, its collectives counted in forward and backward (sp_comm_worker.py).

- With SP the backward of each TP region's input is **one reduce-scatter** (Megatron's), not an all-reduce per
  colwise linear (q, k, v, gate, up: 5 per layer) followed by a slice.
- Where a region's gathered input has a use that is not a colwise linear's (here: up_proj reads a copy of it), that
  region falls back to the per-linear all-reduce, and the gradients still equal plain TP's: summing a replicated
  gradient into the reduce-scatter would have counted it twice.
- Every variant's gradients equal plain TP's (same checkpoint, same batch; the sequence, 23 tokens, is split 12/11).
"""

import pytest
import torch

WORKER = "tests/distributed/sp_comm_worker.py"
LAYERS = 2
COLWISE_PER_LAYER = 5  # q, k, v, gate, up
# fp32; SP changes only the order in which the tp partial sums of each input gradient are added (reduce-scatter of
# their local sum vs all-reduce of each, then summed): a few roundings of ~6e-8 relative per element, carried
# through two layers' backward; 1e-6 absolute covers elements near zero, 1e-5 relative the rest with ~10x headroom.
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def comm(tiny_model, launch_worker):
    spec = {"model": tiny_model("llama", num_hidden_layers=LAYERS), "samples": dict(n=2, seq_len=23, min_len=23)}
    out = launch_worker("sp_comm", WORKER, 2, spec, timeout=900)
    return torch.load(out / "comm.pt", weights_only=True)


def _same_grads(run, ref):
    assert run["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(run["grads"][name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


def test_backward_reduce_scatters_each_region_input_once(comm):
    sp, plain = comm["sp"], comm["no_sp"]
    assert sp["applied"] and not plain["applied"]
    bwd, ref = sp["backward"], plain["backward"]
    print("backward collectives: SP", bwd, sp["backward_bytes"], "| plain TP", ref, plain["backward_bytes"])
    regions = 2 * LAYERS
    assert bwd.get("reduce_scatter_tensor", 0) == regions
    # the per-linear all-reduces of the region inputs are gone; what is left is what plain TP has besides them
    assert ref.get("all_reduce", 0) >= COLWISE_PER_LAYER * LAYERS
    assert bwd.get("all_reduce", 0) == ref["all_reduce"] - COLWISE_PER_LAYER * LAYERS
    # the rowwise outputs' reduce-scatters and the entry's split each all-gather their gradient
    assert bwd.get("all_gather_into_tensor", 0) == regions + 1
    _same_grads(sp, plain)


def test_a_region_whose_input_has_another_use_keeps_the_all_reduce(comm):
    mixed, plain = comm["sp_mixed"], comm["no_sp"]
    bwd = mixed["backward"]
    assert bwd.get("reduce_scatter_tensor", 0) == LAYERS  # the attention regions only
    # the MLP regions all-reduce gate's and up's input gradient again, q/k/v's are still reduce-scattered
    assert bwd.get("all_reduce", 0) == plain["backward"]["all_reduce"] - 3 * LAYERS
    _same_grads(mixed, plain)


def test_fallback_everywhere_is_the_per_linear_all_reduce(comm):
    old, sp = comm["sp_fallback"], comm["sp"]
    assert old["backward"].get("reduce_scatter_tensor", 0) == 0
    assert old["backward"].get("all_reduce", 0) == comm["no_sp"]["backward"]["all_reduce"]
    _same_grads(old, comm["no_sp"])
    # bytes handed to the backward's collectives (per rank): Megatron's backward moves less than the old one
    total = lambda run: sum(run["backward_bytes"].values())  # noqa: E731
    print(f"backward bytes into collectives per rank: SP {total(sp)}, SP before (fallback) {total(old)}, "
          f"plain TP {total(comm['no_sp'])}")
    assert total(sp) < total(old)
