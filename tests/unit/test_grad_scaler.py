"""fp16's loss scaler (distributed/grad_scaler.py, accelerate/scaling.py) in one process: torch's GradScaler
semantics on DTensor gradients, and the plugin installing it on the Accelerator. The all-reduce of the inf flag
over ranks is tested launched (tests/distributed/test_fp16.py, one rank alone overflowing)."""

from types import SimpleNamespace

import torch
from accelerate.utils import GradScalerKwargs

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.accelerate import scaling
from nd_parallel.distributed.grad_scaler import MeshGradScaler

from .test_plugin_errors import fake_accelerator


def _optimizer(*grads):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return torch.optim.SGD(params, lr=1.0), params


def test_scaler_matches_torch_gradscaler_step_for_step():
    """Scale, unscale, skip on inf, back off and grow exactly as torch.amp.GradScaler (no process group)."""
    kwargs = dict(init_scale=8.0, growth_interval=2)
    ours, torchs = MeshGradScaler(torch.device("cpu"), **kwargs), torch.amp.GradScaler("cpu", **kwargs)
    for grads in ([1.0, 2.0], [float("inf"), 1.0], [0.5, 0.5], [1.0, float("nan")], [3.0, 1.0], [1.0, 1.0]):
        runs = []
        for scaler in (ours, torchs):
            loss = scaler.scale(torch.tensor(1.0))
            opt, params = _optimizer(torch.tensor(grads) * loss.detach())
            scaler.unscale_(opt)
            unscaled = params[0].grad.clone()
            scaler.step(opt)
            scaler.update()
            runs.append(torch.tensor([loss.item(), *unscaled.tolist(), *params[0].detach().tolist(),
                                      scaler.get_scale()]))
        assert torch.equal(runs[0].nan_to_num(7.0), runs[1].nan_to_num(7.0)), (grads, runs)


def test_found_inf_reads_local_shards_of_dtensor_gradients():
    """A DTensor gradient is checked and unscaled through its local tensor (the piece this rank holds)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nd_parallel.distributed.mesh import single_process_group

    single_process_group("cpu")
    try:
        _dtensor_rows(init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()


def _dtensor_rows(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    scaler = MeshGradScaler(torch.device("cpu"), init_scale=4.0)
    param = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
    param.grad = distribute_tensor(torch.tensor([4.0, 8.0, 12.0, 16.0]), mesh, [Shard(0)])
    opt = torch.optim.SGD([param], lr=1.0)
    assert not scaling.unscale(scaler, [SimpleNamespace(optimizer=opt)])
    assert param.grad.to_local().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert not scaling.unscale(scaler, [opt])  # a second unscale in the same step is a no-op, not an error
    assert param.grad.to_local().tolist() == [1.0, 2.0, 3.0, 4.0]
    scaler.step(opt), scaler.update()
    param.grad = distribute_tensor(torch.tensor([1.0, float("inf"), 1.0, 1.0]), mesh, [Shard(0)])
    assert scaling.unscale(scaler, [opt])
    before = param.detach().to_local().clone()
    scaler.step(opt), scaler.update()
    assert torch.equal(param.detach().to_local(), before) and scaler.get_scale() == 2.0


def test_guard_skip_leaves_the_scaler_ready():
    """A step nd_parallel's non-finite guard skips never reaches the scaler: its state goes back to READY."""
    scaler = MeshGradScaler(torch.device("cpu"), init_scale=4.0)
    opt, _ = _optimizer(torch.tensor([4.0]))
    scaling.unscale(scaler, [opt])
    scaling.drop_step(scaler)
    assert not scaler.unscaled(opt) and scaler.get_scale() == 4.0
    scaling.unscale(scaler, [opt])  # the next step unscales again instead of raising


def test_attach_installs_the_scaler_with_accelerate_kwargs():
    handler = GradScalerKwargs(init_scale=2.0 ** 10, growth_interval=7)
    acc = fake_accelerator(1, mixed_precision="fp16", scaler=None, scaler_handler=handler)
    plugin = NDParallelPlugin(ParallelismConfig()).attach(acc)
    assert acc.scaler is plugin.scaler and isinstance(acc.scaler, MeshGradScaler)
    assert acc.scaler.get_scale() == 2.0 ** 10 and acc.scaler.get_growth_interval() == 7
    assert plugin.mp_policy.param_dtype == torch.float16 and plugin.mp_policy.reduce_dtype == torch.float32
    bf16 = fake_accelerator(1, mixed_precision="bf16", scaler=None)
    assert NDParallelPlugin(ParallelismConfig()).attach(bf16).scaler is None and bf16.scaler is None


def test_bitsandbytes_stand_ins_are_unscaled_through_their_dtensors():
    """A bitsandbytes optimizer steps plain stand-ins whose .grad is set only inside step(): the scaler must read
    (and unscale) the DTensor parameters' gradients instead, or it would miss an overflow and clip scaled values."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nd_parallel.distributed.mesh import single_process_group

    single_process_group("cpu")
    try:
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (1,))
        param = torch.nn.Parameter(distribute_tensor(torch.zeros(2), mesh, [Shard(0)]))
        local = torch.nn.Parameter(param.to_local().detach())
        opt = torch.optim.SGD([local], lr=1.0)
        opt.nd_parallel_local_shards = [(param, local)]
        scaler = MeshGradScaler(torch.device("cpu"), init_scale=4.0)
        param.grad = distribute_tensor(torch.tensor([4.0, float("inf")]), mesh, [Shard(0)])
        assert scaling.unscale(scaler, [opt]) and local.grad is None
        param.grad = distribute_tensor(torch.tensor([4.0, 8.0]), mesh, [Shard(0)])
        scaling.drop_step(scaler)
        assert not scaling.unscale(scaler, [opt]) and param.grad.to_local().tolist() == [1.0, 2.0]
    finally:
        dist.destroy_process_group()
