"""Rank program for the loading tests: per layout, prepare a model loaded the memory-efficient way and one
loaded the plain way, and record whether they are bit-identical (and stay so for one training step).

Usage (under torchrun): loading_worker.py OUT_JSON SPEC_JSON
SPEC_JSON: {"runs": [[name, model_dir, {ParallelismConfig kwargs}], ...]}
OUT_JSON (written by rank 0): {name: {"mismatch": [...], "bytes_read": [per rank], "bytes_total": int, ...}}

Reads are counted by wrapping the ``safe_open`` the loader uses, so what is counted is every byte the
efficient path pulled out of the checkpoint on this rank, from ``from_pretrained`` to the end of ``prepare``.
"""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import nd_parallel.models.loading as loading
from nd_parallel import NDParallelPlugin, ParallelismConfig


class CountingOpen:
    """``safe_open`` that adds up the bytes of every tensor (or slice of one) handed out."""

    total = 0
    real = loading.safe_open

    def __init__(self, *args, **kwargs):
        self.handle = CountingOpen.real(*args, **kwargs)

    def __enter__(self):
        self.inner = self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_tensor(self, key):
        return self._count(self.inner.get_tensor(key))

    def get_slice(self, key):
        piece, count = self.inner.get_slice(key), self._count

        class Slice:
            def __getitem__(self, index):
                return count(piece[index])

            def __getattr__(self, name):  # get_shape, get_dtype: header only
                return getattr(piece, name)

        return Slice()

    @staticmethod
    def _count(tensor):
        CountingOpen.total += tensor.numel() * tensor.element_size()
        return tensor


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def compare(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names whose local pieces differ in value, dtype, shape or placement (empty: bit-identical)."""
    pa = dict(a.named_parameters(remove_duplicate=False))
    pb = dict(b.named_parameters(remove_duplicate=False))
    for m, d in ((a, pa), (b, pb)):
        for stage in getattr(m, "stages", [m]):
            d.update({f"buffer:{n}": t for n, t in stage.named_buffers()})
    bad = sorted(set(pa) ^ set(pb))
    for name in sorted(set(pa) & set(pb)):
        x, y = pa[name], pb[name]
        if isinstance(x, DTensor) != isinstance(y, DTensor) or (
                isinstance(x, DTensor) and tuple(x.placements) != tuple(y.placements)):
            bad.append(f"{name}: placements")
        elif x.is_meta or local(x).dtype != local(y).dtype or not torch.equal(local(x), local(y)):
            bad.append(name)
    return bad


def optimizer_points_at(model, opt) -> bool:
    held = [p for g in opt.optimizer.param_groups for p in g["params"]]
    return {id(p) for p in held} == {id(p) for p in model.parameters()} and not any(p.is_meta for p in held)


def prepare(layout: dict, model_dir: str, efficient: bool):
    accelerator = Accelerator()
    plugin = NDParallelPlugin(ParallelismConfig(**layout)).attach(accelerator)
    if efficient:
        model = plugin.from_pretrained(model_dir)
        assert all(p.is_meta for p in model.parameters()), "from_pretrained read weights before prepare"
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before prepare, re-pointed by it
    model, opt = accelerator.prepare(model, opt)
    return accelerator, plugin, model, opt


def train_step(accelerator, model, opt) -> float:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (4, 16), generator=gen)
    out = model(input_ids=ids, labels=ids.clone())
    accelerator.backward(out.loss)
    opt.step()
    opt.zero_grad()
    return out.loss.item()


def run(layout: dict, model_dir: str) -> dict:
    CountingOpen.total = 0
    acc_e, plugin_e, eff, opt_e = prepare(layout, model_dir, efficient=True)
    read = CountingOpen.total
    report = plugin_e.loading_report
    acc_p, _, plain, opt_p = prepare(layout, model_dir, efficient=False)
    result = {"mismatch_after_load": compare(eff, plain),
              "optimizer_repointed": optimizer_points_at(eff, opt_e),
              "local_params": sum(1 for _ in eff.parameters()),
              "loss": [train_step(acc_e, eff, opt_e), train_step(acc_p, plain, opt_p)]}
    result["mismatch_after_step"] = compare(eff, plain)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {**result, "bytes_read": read, "report_read": report.bytes_read})
    merged = {key: [r[key] for r in everyone] for key in everyone[0]}
    merged["bytes_total"] = report.bytes_total
    return merged


def main(out_path: str, spec_path: str) -> None:
    loading.safe_open = CountingOpen
    loading.READ_BLOCK_BYTES = 2000  # several row blocks per matrix: the blocked reads meet every kind of shard
    spec = json.load(open(spec_path))
    results = {name: run(layout, model_dir) for name, model_dir, layout in spec["runs"]}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
