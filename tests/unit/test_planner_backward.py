"""Planner: what a layer saves (against autograd's saved tensors) and the moment inside the layers' backward, where the
peak sits once the chunked loss made the loss's own term small (issue 21). The multi-rank rows that fixed these terms
are benchmarks/bench_planner.py's (docs/benchmarks.md, "Planner")."""

from __future__ import annotations

import pytest
import torch

from nd_parallel.planner import Cluster, Layout, Training, model_spec, peak_memory
from nd_parallel.planner.memory import layer_activation_bytes, layer_params_per_rank, rank_memory, unsharded_layer
from nd_parallel.planner.meta import meta_model
from nd_parallel.testing.models import tiny_config

CPU = Cluster(nodes=1, gpus_per_node=4, gpu_memory=10**12, device="cpu")
SHAPE = dict(hidden_size=192, intermediate_size=512, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
             vocab_size=256)
LLAMA = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             head_dim=32, vocab_size=4096, tie_word_embeddings=False)


def _saved_bytes(family: str, layers: int, lora: bool) -> int:
    """Bytes autograd saves in one forward (parameters left out) of a `layers`-layer model, 2 x 128 tokens."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, num_hidden_layers=layers, **SHAPE),
                                             attn_implementation="sdpa")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    from nd_parallel.planner.measure import saved_tensor_bytes

    return saved_tensor_bytes(lambda: model(input_ids=torch.randint(1, 256, (2, 128))), list(model.parameters()))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("lora", [False, True])
def test_one_layer_saves_what_the_planner_counts(family, lora):
    """Two layers minus one: exactly the planner's per-token layer term, fp32. Qwen3's q/k norms save their input and
    normalised value and a per-head rsqrt, not their output (RoPE saves none of it); LoRA's B saves A's r-wide output
    (before this test: +32 and -224 bytes per token)."""
    measured = (_saved_bytes(family, 2, lora) - _saved_bytes(family, 1, lora)) / 256
    spec = model_spec(meta_model(tiny_config(family, num_hidden_layers=2, **SHAPE)))
    train = Training(seq_len=128, global_batch=2, dtype="fp32", lora_rank=8 if lora else None)
    assert layer_activation_bytes(spec, train, 1, "none")[0] == measured


@pytest.fixture(scope="module")
def llama():
    return model_spec(meta_model(tiny_config("llama", **LLAMA)))


def test_chunked_loss_peak_is_in_the_top_layers_backward(llama):
    """One process, fp32, chunked loss: the loss's moment holds one chunk; the top layer's backward holds more: the
    head's gradient (formed at the loss, kept until the optimizer step), the MLP's input gradients (2 token x ffn net
    of the freed down_proj input), the residual's gradient and down_proj's weight gradient. The measured step is in
    test_planner.py (within 2%)."""
    tokens, h, f, V = 1024, 256, 688, 4096
    mem = peak_memory(llama, Training(seq_len=512, global_batch=2, dtype="fp32", loss_chunk=128),
                      Layout(1, 1, 1, 1, 1, micro_batch=2), CPU)
    start = mem.moments["backward start"]
    assert mem.phase == "layer backward" and mem.peak > sum(start.values())
    assert mem.parts["logits"] == 4 * V * h  # the hidden states' gradient is consumed by the top layer
    assert mem.parts["layer_backward"] == 4 * tokens * (2 * f + h) + 4 * h * f
    assert mem.parts["activations"] == start["activations"] - tokens * (12 * h + 4)  # the final norm's are freed
    assert mem.parts["grads"] == 0 and mem.parts["comm_buffers"] == 0  # the top layer: none done yet, no FSDP


def test_fsdp_full_checkpointing_peaks_one_layer_before_the_last(llama):
    """FSDP4, full checkpointing (bench_planner's fsdp4_full_ckpt, measured 50.85 MiB): the largest layer moment is the
    one before last, with FSDP2's two layer-sized buffers (the next layer's prefetched all-gather, the previous
    layer's reduce-scatter input) and two layers' reduce-scattered gradient shards alive."""
    lay = Layout(1, 4, 1, 1, 1, micro_batch=2, checkpointing="full")
    train = Training(seq_len=256, global_batch=8, dtype="fp32")
    mem = peak_memory(llama, train, lay, CPU)
    layer = layer_params_per_rank(llama, lay)
    root = 2 * 4096 * 256 + 256  # embedding, head, final norm: unsharded from forward to backward
    assert mem.phase == "layer backward"
    assert mem.parts["grads"] == int(2 * 4 * layer / 4)
    assert mem.parts["comm_buffers"] == int(4 * root + 4 * unsharded_layer(llama, lay) * 2 + 4 * layer)
    assert mem.parts["activations"] == 512 * 4 * 256 * 2  # the inputs of the two layers not yet done
    assert abs(mem.peak / (50.85 * 2**20) - 1) < 0.01


def test_lora_holds_no_head_gradient(llama):
    """peft's all-linear leaves the head frozen: the chunked loss forms no head gradient (qwen3 fsdp4_lora was
    predicted +16.7% with one)."""
    train = Training(seq_len=256, global_batch=8, dtype="fp32", lora_rank=8)
    start = peak_memory(llama, train, Layout(1, 4, 1, 1, 1, micro_batch=2), CPU).moments["backward start"]
    assert start["logits"] == 4 * 128 * 4096 + 4 * 512 * 256  # one chunk's buffer and the hidden states' gradient


def test_pipeline_fsdp_accumulates_whole_gradients(llama):
    """PP2 x FSDP2, 1F1B, 2 micro-batches: the last stage starts its second backward with the first one's gradients,
    whole (torch's schedules skip FSDP's reduce-scatter before the last micro-batch; measured on qwen3: three
    head-sized fp32 buffers at its peak, the accumulated one beside the chunked loss's two)."""
    lay = Layout(1, 2, 1, 1, 2, micro_batch=2, microbatches=2, schedule="1f1b")
    train = Training(seq_len=256, global_batch=8, dtype="fp32")
    last = rank_memory(llama, train, lay, CPU, 1).moments["backward start"]
    assert last["grads"] == 2 * last["params"]  # whole = 2 x the FSDP2 shard
    # its loss runs after the stage's forward returned: the root's copy (head, final norm), no layer all-gather left
    assert last["comm_buffers"] == 4 * (4096 * 256 + 256)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_probe_paths_loss_term_equals_the_measured_loss_peak(dtype):
    """memory._probe_loss against the allocator-level peak of the chunked loss's probe path on a head that is a plain
    callable (so the probe's path, not linear_loss.py's): in fp32 the peak is the head's gradient being formed (the
    chunk's logits and their gradient, the running sum and the chunk's own), in bf16 the log-softmax's backward (its
    four buffers beside the sum). What it leaves out: the chunk's hidden-state gradient (c x h) and scalars."""
    from types import SimpleNamespace

    from nd_parallel.distributed.chunked_loss import chunked_cross_entropy
    from nd_parallel.planner.measure import LiveTensorBytes
    from nd_parallel.planner.memory import FP32, _probe_loss, logits_bytes_per_token

    vocab, width, tokens, chunk = 512, 64, 64, 16
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, width, generator=g).to(torch_dtype).requires_grad_()
    hidden = torch.randn(1, tokens, width, generator=g).to(torch_dtype).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens), generator=g)
    initial = [weight, hidden, targets]
    with LiveTensorBytes(initial) as live:
        chunked_cross_entropy(lambda x: x @ weight.t(), hidden, targets, chunk, [weight])
    measured = live.peak - sum(t.untyped_storage().nbytes() for t in initial)
    spec, train = SimpleNamespace(vocab=vocab), Training(seq_len=tokens, global_batch=1, dtype=dtype)
    b = train.compute_bytes
    at_loss, _ = logits_bytes_per_token(spec, train)
    predicted = _probe_loss(spec, train, chunk, at_loss, FP32 * vocab * width, False) + tokens * b * width
    assert 0 <= measured - predicted <= chunk * width * FP32 + 64, (measured, predicted)
