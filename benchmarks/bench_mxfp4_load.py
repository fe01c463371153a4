"""Host memory and time of loading gpt-oss from its MXFP4 checkpoint form, dequantized as it loads
(``quantization_config=Mxfp4Config(dequantize=True)``, what ``model_quantization_config: Mxfp4Config`` with
``dequantize: true`` does on the ranks of ``nd-parallel train``), vs the same model's plain fp32 checkpoint.

Usage:
    python benchmarks/bench_mxfp4_load.py                 # tiny gpt-oss, 4 and 8 layers of 32 experts
    python benchmarks/bench_mxfp4_load.py --layers 4

Each load runs in a fresh interpreter on CPU in fp32 (as the ranks load). Reported: the checkpoint's size on disk,
the load's wall time, the peak growth of anonymous resident memory (``RssAnon``, sampled every 2 ms; the
checkpoint's mmap-ed pages are file-backed and not counted) and the parameter bytes held afterwards (the same for
both: the experts end in fp32 either way).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_LOAD = r"""
import sys, time, torch
from transformers import AutoModelForCausalLM, Mxfp4Config

sys.path.insert(0, sys.argv[3])  # the benchmarks folder: _common's sampler
from _common import PeakSampler, rss_status

path, how = sys.argv[1], sys.argv[2]
kwargs = {"quantization_config": Mxfp4Config(dequantize=True)} if how == "mxfp4" else {}
base, sampler = rss_status()["RssAnon"], PeakSampler()
sampler.start()
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
seconds = time.perf_counter() - start
sampler.stop.set(); sampler.sample()
held = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
print(f"{(sampler.anon - base) / 2**20:.0f} {held:.0f} {seconds:.2f}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    args = ap.parse_args()
    from nd_parallel.testing.models import save_tiny_model
    from nd_parallel.testing.mxfp4 import save_mxfp4_checkpoint

    print(f"{'layers':>6}  {'checkpoint':<11} {'on disk MiB':>11} {'load s':>7} {'peak anon growth MiB':>21} "
          f"{'params held MiB':>16}")
    for layers in args.layers:
        with tempfile.TemporaryDirectory() as tmp:
            plain = save_tiny_model("gpt_oss", Path(tmp) / "plain", hidden_size=512, intermediate_size=512,
                                    num_hidden_layers=layers, num_local_experts=32, num_experts_per_tok=4)
            save_mxfp4_checkpoint(plain, Path(tmp) / "mxfp4")
            for how in ("plain", "mxfp4"):
                path = Path(tmp) / how
                disk = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20
                here = str(Path(__file__).resolve().parent)
                out = subprocess.run([sys.executable, "-c", _LOAD, str(path), how, here], capture_output=True,
                                     text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.split()
                print(f"{layers:>6}  {how:<11} {disk:>11.0f} {out[-1]:>7} {out[-3]:>21} {out[-2]:>16}", flush=True)


if __name__ == "__main__":
    main()
