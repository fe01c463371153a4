"""Under FSDP2 every rank must reduce-scatter the same parameters: in a mixture-of-experts layer, experts no token
of this rank reached would otherwise have no gradient on it, and the ranks' reduce-scatters would not match (a
collective mismatch that aborts the job). fsdp._every_parameter_gets_a_gradient makes the layer's output depend on
every parameter by a term of exactly zero."""

import torch
from transformers import AutoModelForCausalLM

from nd_parallel.distributed.fsdp import _every_parameter_gets_a_gradient
from nd_parallel.models.hf import decoder_layers
from nd_parallel.testing.tiny_configs import tiny_sweep_config


def _run(hook: bool, seed: int = 1):
    torch.manual_seed(0)
    # LongCat's 256 identity ("zero") experts beside 4 real ones: most tokens reach no real expert.
    model = AutoModelForCausalLM.from_config(tiny_sweep_config("longcat_flash", zero_expert_num=256))
    if hook:
        for layer in decoder_layers(model):
            layer.register_forward_hook(_every_parameter_gets_a_gradient)
    torch.manual_seed(seed)
    ids = torch.randint(1, 100, (1, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def test_unreached_experts_get_a_zero_gradient_and_nothing_else_changes():
    loss, grads = _run(hook=False)
    unused = [n for n, g in grads.items() if g is None]
    assert unused and all(".experts." in n for n in unused)  # this batch reaches no real expert somewhere
    hooked_loss, hooked = _run(hook=True)
    assert torch.equal(hooked_loss, loss)
    assert all(g is not None for g in hooked.values())
    for name, grad in hooked.items():
        expected = torch.zeros_like(grad) if grads[name] is None else grads[name]
        assert torch.equal(grad, expected), name
