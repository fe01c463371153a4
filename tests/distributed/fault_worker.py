"""Rank program for the fault-tolerance tests: a short FSDP2 Accelerate loop with one fault injected.

Usage: fault_worker.py MODE MODEL_DIR OUT_DIR [OPTIONS_JSON]
MODE: hang-stop | hang-loop | hang-partial (rank 1 / rank 0 misbehaves at step 3, the others must report it),
      nonfinite (NaN gradients and a NaN checkpoint, with skip_nonfinite_steps=1), agreement (rank 1 brings another
      model), spin (trains until signalled; dataloader workers; save_on_signal from OPTIONS_JSON).
Each rank appends JSON lines {"rank", "event", "t", ...} to OUT_DIR/events_<rank>.jsonl; t is time.time().
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.testing.models import make_samples

mode, model_dir, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}


def event(name, **data):
    with open(os.path.join(out_dir, f"events_{dist.get_rank()}.jsonl"), "a") as f:
        f.write(json.dumps({"rank": dist.get_rank(), "event": name, "t": time.time(), **data}) + "\n")


def collate(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


accelerator = Accelerator()
layout = {"dp_shard_size": 2, "hang_timeout": options.get("hang_timeout", 10), **options.get("layout", {})}
plugin = NDParallelPlugin(ParallelismConfig(**layout)).attach(accelerator)
rank = dist.get_rank()
watchdog = plugin.fault.watchdog
if watchdog is not None:  # record when this rank's report came
    watchdog.on_report = lambda line: event("detected", report=line)
if mode == "agreement" and rank == 1:
    model_dir = options["other_model"]
model = plugin.from_pretrained(model_dir)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader(make_samples(4000, 16), batch_size=2, collate_fn=collate, num_workers=options.get("workers", 0))
event("prepare")
try:
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
except Exception as err:
    event("error", type=type(err).__name__, message=str(err))
    print(f"rank {rank}: {type(err).__name__}: {err}", flush=True)
    sys.exit(3)
event("prepared")


def train_step(batch):
    out = model(**batch)
    accelerator.backward(out.loss)
    return out


def nonfinite(batch, step):
    """Step 2: NaN gradient on rank 1 (skipped: skip_nonfinite_steps=1); step 3: again, now the run must stop.
    With nan_save: a NaN in rank 0's weights at step 2, then save_state must be refused and nothing published."""
    if step == 2 and options.get("nan_save"):
        with torch.no_grad():
            weight = dict(model.named_parameters())["model.layers.1.mlp.up_proj.weight"]
            weight.to_local()[0, 0] = float("nan")
        try:
            accelerator.save_state(os.path.join(out_dir, "ckpt_nan"))
            event("saved-nan")
        except Exception as err:
            event("save-refused", type=type(err).__name__, message=str(err),
                  published=os.path.exists(os.path.join(out_dir, "ckpt_nan")))
        return "stop"
    train_step(batch)
    if step in (2, 3) and rank == 1:
        grad = dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"].grad
        grad.to_local()[0, 0] = float("nan")
    before = [p.detach().to_local().clone() for p in model.parameters()]
    try:
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
    except Exception as err:
        event("error", type=type(err).__name__, message=str(err), step=step)
        return "stop-error"
    optimizer.step()
    optimizer.zero_grad()
    unchanged = all(torch.equal(a, p.detach().to_local()) for a, p in zip(before, model.parameters()))
    event("step", step=step, applied=not unchanged, skipped=optimizer.step_was_skipped)


def async_roundtrip(batch, step):
    """Step 2: async save, two more steps change every weight, then load_state must give back the saved ones."""
    global saved
    if step == 2:
        saved = [p.detach().to_local().clone() for p in model.parameters()]
        accelerator.save_state(os.path.join(out_dir, "ckpt_async"))
        event("async-returned", published=os.path.exists(os.path.join(out_dir, "ckpt_async", "nd_parallel.json")))
    if step == 5:
        accelerator.load_state(os.path.join(out_dir, "ckpt_async"))
        equal = all(torch.equal(a, p.detach().to_local()) for a, p in zip(saved, model.parameters()))
        event("async-loaded", equal=equal)
        return "stop"
    train_step(batch)
    optimizer.step()
    optimizer.zero_grad()


step = 0
for batch in loader:
    step += 1
    if mode == "async" and async_roundtrip(batch, step) is not None:
        break
    if mode == "async":
        continue
    if mode == "nonfinite":
        if nonfinite(batch, step) is not None:
            break
        continue
    if step == 3 and mode.startswith("hang"):
        event("fault")
        if mode == "hang-stop" and rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        if mode == "hang-loop" and rank == 1:
            while True:
                pass
        if mode == "hang-partial" and rank == 0:
            dist.all_reduce(torch.ones(1))  # the world group: rank 1 never calls it
    train_step(batch)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    event("step", step=step, pid=os.getpid())
    if mode == "spin" and plugin.preemption_requested():
        path = accelerator.save_state(os.path.join(out_dir, "preempted"))
        event("preempted", step=step, path=str(path))
        sys.exit(0)
    if mode == "spin" and options.get("step_sleep"):
        time.sleep(options["step_sleep"])
event("done", step=step)
