"""The optimizer step uses torch's foreach kernels where the user left ``foreach`` unset (distributed/optimizer.py).

That is only a speed choice if both implementations compute the same numbers: checked bit for bit here for the
element-wise optimizers people train with, then through the plugin, which must leave an explicit choice alone.
"""

import pytest
import torch
from accelerate import Accelerator

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.distributed.optimizer import prefer_foreach
from nd_parallel.testing.models import save_tiny_model

SHAPES = [(64, 32), (32,), (128, 64), (7,), (3, 5, 2)]
OPTIMIZERS = {
    "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, eps=1e-6, foreach=fe),
    "adam_amsgrad": lambda ps, fe: torch.optim.Adam(ps, lr=1e-3, amsgrad=True, foreach=fe),
    "sgd_nesterov": lambda ps, fe: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4,
                                                   foreach=fe),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_foreach_and_per_parameter_steps_are_bit_equal(name):
    torch.manual_seed(0)
    loop = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    each = [torch.nn.Parameter(p.detach().clone()) for p in loop]
    a, b = OPTIMIZERS[name](loop, False), OPTIMIZERS[name](each, None)
    assert prefer_foreach(b) == 1 and b.param_groups[0]["foreach"] is True
    sched = torch.optim.lr_scheduler.LambdaLR(b, lambda s: 1.0 - s / 40)
    sched_a = torch.optim.lr_scheduler.LambdaLR(a, lambda s: 1.0 - s / 40)
    for _ in range(15):
        for p, q in zip(loop, each):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        a.step(), b.step(), sched_a.step(), sched.step()
    assert all(torch.equal(p, q) for p, q in zip(loop, each))


def test_an_explicit_choice_and_fused_and_other_libraries_are_left_alone():
    ps = [torch.nn.Parameter(torch.randn(4))]
    assert prefer_foreach(torch.optim.AdamW(ps, foreach=False)) == 0
    assert prefer_foreach(torch.optim.AdamW(ps, fused=True)) == 0

    class Outside(torch.optim.SGD):  # a subclass defined elsewhere: its step may not honour foreach
        pass

    assert prefer_foreach(Outside(ps, lr=0.1)) == 0


def test_a_group_mixing_dtensor_and_plain_parameters_keeps_the_loop(one_rank_group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = DeviceMesh("cpu", [0])
    shared = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))
    plain = torch.nn.Parameter(torch.randn(4))
    mixed = torch.optim.AdamW([shared, plain])
    assert prefer_foreach(mixed) == 0
    only = torch.optim.AdamW([shared])
    assert prefer_foreach(only) == 1
    shared.grad = distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
    only.step()  # DTensor foreach kernels run


def test_a_fused_group_mixing_dtensor_and_plain_parameters_takes_the_loop(one_rank_group):
    """The Trainer's default adamw_torch_fused under TP without FSDP (LoRA's factors, norms plain): torch's fused
    kernel refuses the mix at the first step; unfused, the update equals the fused one on plain copies."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = DeviceMesh("cpu", [0])
    torch.manual_seed(0)
    values, grads = [torch.randn(4, 4), torch.randn(4)], [torch.randn(4, 4), torch.randn(4)]
    shared = torch.nn.Parameter(distribute_tensor(values[0].clone(), mesh, [Replicate()]))
    plain = torch.nn.Parameter(values[1].clone())
    mixed = torch.optim.AdamW([shared, plain], lr=1e-2, fused=True)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):  # torch 2.13 without the fix
        shared.grad = distribute_tensor(grads[0], mesh, [Replicate()])
        plain.grad = grads[1].clone()
        mixed.step()
    mixed = torch.optim.AdamW([shared, plain], lr=1e-2, fused=True)
    prefer_foreach(mixed)
    assert (mixed.param_groups[0]["fused"], mixed.param_groups[0]["foreach"]) == (False, False)
    reference = [torch.nn.Parameter(v.clone()) for v in values]
    fused = torch.optim.AdamW(reference, lr=1e-2, fused=True)
    for _ in range(3):
        shared.grad = distribute_tensor(grads[0], mesh, [Replicate()])
        plain.grad = grads[1].clone()
        mixed.step()
        for p, g in zip(reference, grads):
            p.grad = g.clone()
        fused.step()
    assert torch.allclose(shared.full_tensor(), reference[0], rtol=0, atol=1e-7)
    assert torch.allclose(plain, reference[1], rtol=0, atol=1e-7)


def test_the_plugin_turns_it_on_once_prepared(tmp_path):
    model_dir = save_tiny_model("llama", tmp_path / "llama")
    from transformers import AutoModelForCausalLM

    accelerator = Accelerator()
    NDParallelPlugin(ParallelismConfig()).attach(accelerator)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    rest = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0, "foreach": False}])
    model, opt = accelerator.prepare(model, opt)
    assert [g["foreach"] for g in opt.optimizer.param_groups] == [True, False]
