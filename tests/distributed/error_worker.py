"""Rank program that must fail fast: attach + prepare a model under a layout the model cannot take.

Usage: error_worker.py LAYOUT_JSON MODEL_DIR [BATCH_JSON]; with BATCH_JSON ({"seq_len": n, "mask_dims": 2|4})
the prepared model also runs one forward on such a batch (for errors only a batch can reveal).
"""

import json
import sys

import torch
from accelerate import Accelerator

from nd_parallel import NDParallelPlugin, ParallelismConfig

layout, model_dir = json.loads(sys.argv[1]), sys.argv[2]
accelerator = Accelerator()
plugin = NDParallelPlugin(ParallelismConfig(**layout)).attach(accelerator)
model = plugin.from_pretrained(model_dir)
model = accelerator.prepare(model)
print("prepared without error")
if len(sys.argv) > 3:
    batch = json.loads(sys.argv[3])
    n = batch["seq_len"]
    ids = torch.ones(2, n, dtype=torch.long)
    mask = torch.ones(2, n, dtype=torch.long) if batch.get("mask_dims", 2) == 2 else torch.ones(2, 1, n, n)
    model(input_ids=ids, labels=ids, attention_mask=mask)
    print("forward without error")
