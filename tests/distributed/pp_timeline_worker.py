"""Rank program for test_pp_timeline: a real 1F1B run with the timeline recorder attached.

Usage (under torchrun, 4 ranks): pp_timeline_worker.py OUT_DIR
Writes OUT_DIR/timeline.json (Chrome trace), timeline.png (with matplotlib), events.json and balance.json.
"""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.distributed.pipeline.balance.collective import measure_stage_seconds, profile_balance
from nd_parallel.distributed.pipeline.balance.measure import sample_batch
from nd_parallel.distributed.pipeline.timeline.events import to_dicts
from nd_parallel.distributed.pipeline.timeline.record import TimelineRecorder, attach
from nd_parallel.distributed.pipeline.timeline.render import write
from nd_parallel.testing.models import make_samples, tiny_config

P, M, SEQ, STEPS = 4, 8, 64, 3


def collate(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def main(out_dir: str) -> None:
    accelerator = Accelerator()
    config = ParallelismConfig(pp_size=P, pp_microbatches=M, pp_schedule="1f1b")
    plugin = NDParallelPlugin(config).attach(accelerator)
    torch.manual_seed(0)  # same weights on every rank
    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=4), attn_implementation="sdpa")
    # pp_balance="profile" as build_pipeline would call it: every rank must get the same split.
    counts = profile_balance(model, plugin.mesh, plugin.config, sample_shape=(1, SEQ))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(make_samples(M * STEPS, SEQ), batch_size=M, collate_fn=collate)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    recorder = attach(model, TimelineRecorder(model.mesh["pp"].get_group()))
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        out = model(**batch)
        accelerator.backward(out.loss)
        opt.step()
        opt.zero_grad()
    events = recorder.gather()  # the last step: the first one also pays for shape inference
    stage_times = measure_stage_seconds(model, sample_batch(model, (1, SEQ)), model.mesh["pp"].get_group(), 3)
    if dist.get_rank() == 0:
        summary = write(events, out_dir, schedule="1f1b", p=P, m=M)
        with open(f"{out_dir}/events.json", "w") as f:
            json.dump({"events": to_dicts(events), "summary": summary, "alignment_error": recorder.alignment_error}, f)
        with open(f"{out_dir}/balance.json", "w") as f:
            json.dump({"counts": counts, "stage_seconds": stage_times}, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
