"""The chunked causal-LM loss (distributed/chunked_loss.py) against the model's own loss, in one process (fp32).

Loss and every gradient agree to 1e-6 at every step, the parameters after AdamW steps to 1e-5: the chunked loss sums per-chunk sums,
HF's takes one sum, so the two differ only in the order of fp32 additions (bit-equal where a family's
reductions happen to round alike, e.g. Cohere's head in these runs; not promised).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from nd_parallel import ParallelismConfig
from nd_parallel.config import ConfigError, ConfigTypeError
from nd_parallel.distributed.chunked_loss import ChunkedLoss
from nd_parallel.testing.models import tiny_config

# tied head (llama), soft-capped (gemma2), divided (granite), multiplied (cohere), untied (qwen3), MoE
HEADS = {
    "llama": {},
    "gemma2": dict(final_logit_softcapping=5.0),
    "granite": dict(logits_scaling=3.0),
    "cohere": dict(logit_scale=0.5),
    "qwen3": {},
    # MoE: their forwards read the decoder's router logits (the head probe's stub must answer), mixtral with the
    # router's load-balancing loss on
    "qwen3_moe": {},
    "mixtral": dict(output_router_logits=True),
}


def _pair(family: str, chunk: int):
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(family, **HEADS[family]), attn_implementation="eager")
    mine = copy.deepcopy(ref)
    ChunkedLoss(mine, chunk)
    return ref.train(), mine.train()


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt that is not learned
    labels[1, -3:] = -100  # right padding
    return ids, labels


@pytest.mark.parametrize("family", sorted(HEADS))
def test_chunked_equals_unchunked_over_adamw_steps(family):
    ref, mine = _pair(family, chunk=7)  # 48 tokens: 6 full chunks and one of 6
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    opt_mine = torch.optim.AdamW(mine.parameters(), lr=1e-3, eps=1e-6)
    for step in range(3):
        ids, labels = _batch(step)
        given = {"num_items_in_batch": torch.tensor(40)} if step == 1 else {}  # the global count of a dp run
        a, b = ref(input_ids=ids, labels=labels, **given), mine(input_ids=ids, labels=labels, **given)
        assert b.logits is None  # chunked: the full logits are never built
        torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
        a.loss.backward()
        b.loss.backward()
        for (name, p), q in zip(ref.named_parameters(), mine.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-6, msg=lambda m: f"{family} {name} step {step}: {m}")
        for opt in (opt_ref, opt_mine):
            opt.step()
            opt.zero_grad()
    # The parity matrix's parameter tolerance: AdamW's first steps divide by |g| + eps, which turns a 1e-9 gradient
    # difference on a gradient near eps (1e-6) into ~lr * 1e-3, so 1e-6 on the parameters would test Adam, not us.
    for p, q in zip(ref.parameters(), mine.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # tied and untied head
def test_a_batch_without_labels_gives_the_same_gradients_as_the_models_own_loss(family):
    # A data-parallel rank whose micro-batch is padding only (the tail of a dataset) still has a gradient for the
    # head: zeros, as HF's loss gives. Without it FSDP's root reduce-scatter differs in size between ranks
    # (issue 21: a gloo collective mismatch in benchmarks/bench_compile.py, whose second rank had no label).
    ref, mine = _pair(family, chunk=7)
    ids, _ = _batch()
    labels = torch.full_like(ids, -100)
    given = {"num_items_in_batch": torch.tensor(40)}  # the global token count: other ranks have the labels
    a, b = ref(input_ids=ids, labels=labels, **given), mine(input_ids=ids, labels=labels, **given)
    torch.testing.assert_close(b.loss, a.loss, rtol=0, atol=0)  # 0 / 40
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(ref.named_parameters(), mine.parameters()):
        assert (q.grad is None) == (p.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=lambda m: f"{family} {name}: {m}")


def test_the_forward_keeps_its_signature():
    import inspect

    ref, mine = _pair("llama", chunk=4)
    assert inspect.signature(mine.forward) == inspect.signature(ref.forward)  # the Trainer reads columns from it


def test_shift_labels_as_context_parallelism_passes_them():
    ref, mine = _pair("llama", chunk=5)
    ids, labels = _batch()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    a = ref(input_ids=ids, labels=shifted, shift_labels=shifted, num_items_in_batch=torch.tensor(33))
    b = mine(input_ids=ids, labels=shifted, shift_labels=shifted, num_items_in_batch=torch.tensor(33))
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)


def test_full_logits_without_labels_in_eval_and_without_grad():
    ref, mine = _pair("gemma2", chunk=4)
    ids, labels = _batch()
    torch.testing.assert_close(mine(input_ids=ids).logits, ref(input_ids=ids).logits)  # training, no labels
    with torch.no_grad():
        torch.testing.assert_close(mine(input_ids=ids, labels=labels).logits, ref(input_ids=ids, labels=labels).logits)
    mine.eval()
    ref.eval()
    with torch.no_grad():  # evaluation as the contract has it: model.eval() + no_grad
        out = mine(input_ids=ids, labels=labels)
        assert out.logits.shape == (2, 24, 256)
        torch.testing.assert_close(out.loss, ref(input_ids=ids, labels=labels).loss)
    # A forward that records gradients chunks whatever the mode: from_pretrained returns a model in eval mode, and
    # an Accelerate loop need not call train().
    assert mine(input_ids=ids, labels=labels).logits is None
    generated = mine.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
    assert generated.shape == (2, 7)


def test_a_head_that_needs_its_inputs_falls_back_to_the_models_own_loss(caplog):
    """A forward that reads input_ids after the decoder cannot run on hidden states alone: chunking turns itself
    off (one info line) and the loss is the model's own."""
    from transformers import LlamaForCausalLM

    class InputBiasedHead(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
            out = super().forward(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
            out.logits = out.logits + 1e-2 * input_ids[:, -out.logits.shape[1]:, None].float()
            if labels is not None:
                out.loss = self.loss_function(out.logits, labels, self.config.vocab_size)
            return out

    torch.manual_seed(0)
    ref = InputBiasedHead(tiny_config("llama")).train()
    mine = copy.deepcopy(ref)
    ChunkedLoss(mine, 4)
    ids, labels = _batch()
    with caplog.at_level("INFO", logger="nd_parallel.distributed.chunked_loss"):
        b = mine(input_ids=ids, labels=labels)
    assert "not reproduced" in caplog.text
    torch.testing.assert_close(b.loss, ref(input_ids=ids, labels=labels).loss)
    assert mine(input_ids=ids, labels=labels).logits is not None  # off from then on: the model's own forward


@pytest.mark.parametrize("value, error, words", [
    (-1, ConfigError, "loss_chunk_size=-1 must be a positive number of tokens"),
    (1.5, ConfigTypeError, "loss_chunk_size=1.5 is a float"),
    ("big", ConfigTypeError, "loss_chunk_size='big' is a str"),
    (True, ConfigTypeError, "loss_chunk_size=True is a bool"),
])
def test_bad_chunk_size_is_refused_with_the_fix(value, error, words):
    with pytest.raises(error, match=words) as info:
        ParallelismConfig(loss_chunk_size=value)
    assert "loss_chunk_size=256" in str(info.value) or "write loss_chunk_size=" in str(info.value)


def test_chunk_size_values():
    assert ParallelismConfig().loss_chunk_size == "auto" and ParallelismConfig().loss_chunk_tokens == 256
    assert ParallelismConfig(loss_chunk_size=0).loss_chunk_tokens == 0
    assert ParallelismConfig(loss_chunk_size=None).loss_chunk_tokens == 0
    assert ParallelismConfig(loss_chunk_size=64).loss_chunk_tokens == 64
    assert ParallelismConfig.from_dict({"loss_chunk_size": 128}).loss_chunk_tokens == 128
    assert ParallelismConfig.from_yaml("loss_chunk_size: 128\n").loss_chunk_tokens == 128  # the YAML key


def test_trl_sft_trainer_keeps_its_logits_unless_chunking_was_asked_for():
    from nd_parallel.plugins.trainer.adopt import keep_logits_for_trl

    sft = type("SFTTrainer", (), {"__module__": "trl.trainer.sft_trainer"})()
    plain = type("Trainer", (), {"__module__": "transformers.trainer"})()
    config = ParallelismConfig()
    keep_logits_for_trl(plain, config)
    assert config.loss_chunk_tokens == 256
    keep_logits_for_trl(sft, config)
    assert config.loss_chunk_tokens == 0  # the default is turned off: TRL reads outputs.logits in training
    explicit = ParallelismConfig(loss_chunk_size=512)
    keep_logits_for_trl(sft, explicit)
    assert explicit.loss_chunk_tokens == 512


def test_the_head_check_on_a_pipeline_stage_metadata_call_tells_a_soft_capped_head_from_a_linear_one():
    """A pipeline stage's first call is torch's metadata inference, a forward on torch.empty buffers: the chunked
    loss checks its head there. On zeros a soft-capped head gives what a plain linear map gives (0) and would take the
    linear fast path, dropping the soft-capping; the stage swaps the buffer for fixed normal values
    (pipeline/stage._not_garbage), on which the check sees the soft-capping."""
    from nd_parallel.distributed.chunked_loss import ChunkedHead
    from nd_parallel.distributed.pipeline.stage import _not_garbage

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gemma2", **HEADS["gemma2"]), attn_implementation="eager")
    forward = type(model).forward.__get__(model.train())
    shape = (2, 24, model.config.hidden_size)
    fooled = ChunkedHead(model, forward, 4)
    fooled.run(inputs_embeds=torch.zeros(shape))
    assert fooled.checked and fooled.linear is not None  # what deciding on zeros does
    fooled.remove()
    head = ChunkedHead(model, forward, 4)
    head.run(inputs_embeds=_not_garbage(torch.full(shape, float("nan"))))
    assert head.checked and head.enabled and head.linear is None  # soft-capped: the probe's path
    head.remove()



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probe_path_holds_one_chunk_head_gradient_beside_the_running_sum(dtype):
    """Issue 21: the probe's path (any head that is not one linear map, and TP's vocabulary-parallel head) sums the
    chunks' head gradients into one fp32 buffer; while a chunk's head gradient is formed the previous chunk's must
    be gone (a loop variable kept it alive: one head gradient more than the planner counts). Counted by the
    allocator-level tracker the planner is validated with, at every storage it sees made."""
    from nd_parallel.distributed.chunked_loss import chunked_cross_entropy
    from nd_parallel.planner.measure import LiveTensorBytes

    vocab, width, chunk = 50, 16, 4
    shape = f"[{vocab}, {width}]"  # the head's shape, unlike any chunk's or the hidden states'

    class HeadGradients(LiveTensorBytes):
        most: tuple[int, int] = (0, 0)  # (count, bytes) of head-shaped storages made in the loss, alive at once

        def _new_peak(self):
            super()._new_peak()
            alive = [n for key, n in self.live.items() if shape in self.made_by.get(key, "initial")]
            self.most = max(self.most, (len(alive), sum(alive)))

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, width, generator=g, dtype=dtype).requires_grad_()
    hidden = torch.randn(2, 12, width, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, vocab, (2, 12), generator=g)

    def head(x):  # soft-capped: not one linear map, so the probe's path
        return 5.0 * torch.tanh((x @ weight.t()) / 5.0)

    with HeadGradients([weight, hidden, targets], breakdown=True) as live:
        loss = chunked_cross_entropy(head, hidden, targets, chunk, [weight])  # 6 chunks
    # the fp32 running sum and the chunk's own gradient (in fp32 the first chunk's is the sum: no copy)
    assert live.most == (2, vocab * width * (4 + dtype.itemsize)), live.at_peak
    loss.backward()  # the values are the model's own loss's (the tests above); here only that they land
    assert weight.grad is not None and weight.grad.dtype == dtype
