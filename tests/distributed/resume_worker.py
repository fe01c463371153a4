"""Rank program for test_resume_agreement.py: every rank calls fault.resume.agreed on OUT_DIR/rank<r> (what a node
whose shared file system lags would see) or on OUT_DIR/shared, with TORCHELASTIC_RESTART_COUNT=r for rank r (a
replacement node counts from 0), and writes what it got or the error it raised."""

import json
import os
import sys

import torch.distributed as dist

from nd_parallel.fault.resume import agreed

root, mode = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
out_dir = os.path.join(root, f"rank{rank}" if mode == "lagging" else "shared")
try:
    result = {"choice": agreed(None, out_dir, restart=rank)}
except RuntimeError as err:
    result = {"error": str(err)}
with open(os.path.join(root, f"result{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
