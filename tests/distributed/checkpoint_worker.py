"""Rank program of the checkpoint tests (test_checkpoint.py): a save phase and a load phase.

Usage (under torchrun, or plain python for the one-process layout): checkpoint_worker.py SPEC_JSON PHASE
SPEC_JSON: {"model": dir, "samples": {...}, "steps": N, "per_rank": b, "ckpt": dir, "out": dir,
            "layouts": {name: {"config": {...}, "resume": bool, "export": null | max_shard_size, "shift": k}},
            "save": [names saved in this launch], "load": [names loaded in this launch], "checkpoints": [names]}

save: per layout, N steps, save_state, the full state gathered at that moment, every rank's bytes of model and
      optimizer tensors it holds (what its shard of the checkpoint may weigh), optionally save_model, then
      (if resume) N more steps of the same run: the uninterrupted reference.
load: per layout, prepare once; load its own checkpoint and train N steps (if resume); then load every
      checkpoint in turn and gather the full state. Rank 0 writes what the test compares.
"""

import json
import sys
import warnings

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch.utils.data import DataLoader

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.checkpoint import CheckpointWarning, full_state
from nd_parallel.testing.models import make_samples


def _collate(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def setup(spec: dict, name: str, seed: int):
    layout = spec["layouts"][name]
    torch.manual_seed(seed)  # seeds the shuffling generator Accelerate gives the sampler at prepare
    accelerator = Accelerator()
    plugin = NDParallelPlugin(ParallelismConfig(**layout["config"])).attach(accelerator)
    model = plugin.from_pretrained(spec["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 20)
    samples = make_samples(**spec["samples"])
    k = layout["shift"]  # each layout trains on its own order, so that its checkpoint differs from the others
    loader = DataLoader(samples[k:] + samples[:k], batch_size=spec["per_rank"], shuffle=True, collate_fn=_collate)
    return Run(accelerator, *accelerator.prepare(model, opt, loader, sched))


class Run:
    """A prepared run and its place in the data: ``steps(n)`` goes on from where the last call stopped, the way one
    ``for`` loop over epochs would (a new ``for`` over the loader would start the epoch again)."""

    def __init__(self, accelerator, model, opt, loader, sched):
        self.accelerator, self.model, self.opt, self.loader, self.sched = accelerator, model, opt, loader, sched
        self.batches = None

    def steps(self, n: int) -> list[float]:
        losses = []
        while len(losses) < n:
            if self.batches is None:
                self.batches = iter(self.loader)
            try:
                batch = next(self.batches)
            except StopIteration:  # end of an epoch: the next one starts
                self.batches = None
                continue
            out = self.model(**batch)
            self.accelerator.backward(out.loss)
            self.accelerator.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            losses.append(out.loss.item())
        return losses


def held_bytes(model, opt) -> int:
    """Bytes of the parameters and optimizer state this rank holds: its pieces of each DTensor, its stages' tensors
    under PP. Counted from the live model, not from what the checkpoint code hands DCP."""
    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    optimizer = getattr(opt, "optimizer", opt)
    params = {id(p): p for p in model.parameters()}.values()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(local(t) for t in [*params, *state])


def save_phase(spec: dict) -> None:
    n = spec["steps"]
    for name in spec["save"]:
        layout = spec["layouts"][name]
        run = setup(spec, name, seed=0)
        acc = run.accelerator
        result = {"first": run.steps(n)}
        acc.save_state(f"{spec['ckpt']}/{name}")
        result["state"] = full_state(acc, run.model, run.opt)
        result["held"] = gather_object([held_bytes(run.model, run.opt)])  # in rank order
        result["sched"] = run.sched.state_dict()
        if layout["export"]:
            acc.save_model(run.model, f"{spec['out']}/export_{name}", max_shard_size=layout["export"])
        if layout["resume"]:  # the same run goes on: saving must not have changed anything it depends on
            result["uninterrupted"] = result["first"] + run.steps(n)
        if layout.get("never_saved"):  # and a run that never saved at all, to show exactly that
            result["never_saved"] = setup(spec, name, seed=0).steps(2 * n)
        if acc.is_main_process:
            torch.save(result, f"{spec['out']}/save_{name}.pt")
        acc.wait_for_everyone()


def load_phase(spec: dict) -> None:
    n = spec["steps"]
    for name in spec["load"]:
        run = setup(spec, name, seed=1234)  # another seed: load_state restores the data order
        acc = run.accelerator
        result = {}
        if spec["layouts"][name]["resume"]:
            acc.load_state(f"{spec['ckpt']}/{name}")
            result["resumed"] = run.steps(n)
        for ckpt in spec["checkpoints"]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                acc.load_state(f"{spec['ckpt']}/{ckpt}")
            result[ckpt] = {"state": full_state(acc, run.model, run.opt), "sched": run.sched.state_dict(),
                            "warnings": [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]}
        if acc.is_main_process:
            torch.save(result, f"{spec['out']}/load_{name}.pt")
        acc.wait_for_everyone()


def main(spec_path: str, phase: str) -> None:
    spec = json.load(open(spec_path))
    {"save": save_phase, "load": load_phase}[phase](spec)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
