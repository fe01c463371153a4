"""Rank program that must fail fast: attach + prepare a model under a layout the model cannot take."""

import json
import sys

from accelerate import Accelerator

from nd_parallel import NDParallelPlugin, ParallelismConfig

layout, model_dir = json.loads(sys.argv[1]), sys.argv[2]
accelerator = Accelerator()
plugin = NDParallelPlugin(ParallelismConfig(**layout)).attach(accelerator)
model = plugin.from_pretrained(model_dir)
accelerator.prepare(model)
print("prepared without error")
