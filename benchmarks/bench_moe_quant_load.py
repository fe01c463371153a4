"""Host memory of loading a MoE with quantized expert tensors (quantize_moe_experts): quantized as each tensor
loads (``quantizing_experts``) vs quantized after the float load (``quantize_experts``) vs float experts.

Usage:
    python benchmarks/bench_moe_quant_load.py                 # tiny qwen3_moe, 4 and 8 layers of 64 experts
    python benchmarks/bench_moe_quant_load.py --layers 4

Each load runs in a fresh interpreter with ``load_in_4bit`` (the attention Linears NF4 as transformers loads them)
on CPU. Reported: the peak growth of anonymous resident memory (``RssAnon``, sampled every 2 ms; the checkpoint's
mmap-ed pages are file-backed and not counted) over the load, and the bytes of the parameters held afterwards.
Quantized as it loads, the peak grows with the model by about the quantized size; float or quantized after, by
the float size.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_LOAD = r"""
import contextlib, sys, torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
from nd_parallel.models.quantized_experts import quantize_experts, quantizing_experts

sys.path.insert(0, sys.argv[3])  # the benchmarks folder: _common's sampler
from _common import PeakSampler, rss_status

path, how = sys.argv[1], sys.argv[2]
q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                       bnb_4bit_compute_dtype=torch.float32)
base, sampler = rss_status()["RssAnon"], PeakSampler()
sampler.start()
with quantizing_experts(4) if how == "as it loads" else contextlib.nullcontext():
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=q, device_map="cpu", dtype=torch.float32)
if how == "after":
    quantize_experts(model, 4)
sampler.stop.set(); sampler.sample()
held = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
print(f"{(sampler.anon - base) / 2**20:.0f} {held:.0f}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    args = ap.parse_args()
    from nd_parallel.testing.models import save_tiny_model

    print(f"{'layers':>6}  {'quantized':<12} {'peak anon growth MiB':>21} {'params held MiB':>16}")
    for layers in args.layers:
        with tempfile.TemporaryDirectory() as tmp:
            save_tiny_model("qwen3_moe", tmp, hidden_size=256, num_hidden_layers=layers, num_experts=64,
                            moe_intermediate_size=512, num_experts_per_tok=4)
            for how in ("float", "as it loads", "after"):
                here = str(Path(__file__).resolve().parent)
                out = subprocess.run([sys.executable, "-c", _LOAD, tmp, how, here], capture_output=True, text=True,
                                     check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.split()
                print(f"{layers:>6}  {how:<12} {out[-2]:>21} {out[-1]:>16}", flush=True)


if __name__ == "__main__":
    main()
