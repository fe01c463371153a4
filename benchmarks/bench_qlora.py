"""Model-state bytes per rank of QLoRA vs LoRA vs full fine-tuning under FSDP2, against the formula; and the peak
memory of one training step with the memory options on and off.

Usage:
    python benchmarks/bench_qlora.py            # 2 gloo ranks (FSDP2, dp_shard_size=2), then the memory options
    python benchmarks/bench_qlora.py --quick    # smaller model and sequence

Part 1 (one 2-rank launch, peers side by side): the same checkpoint trained one step three ways under
``ParallelismConfig(dp_shard_size=2)``: full fine-tuning (AdamW on every parameter), LoRA (r=16 on every
projection, base frozen fp32) and QLoRA (the same LoRA on a bitsandbytes NF4 base with double quantization). Each
rank sums the bytes of its local tensors after ``optimizer.step()``: quantized base weights (packed NF4 + their
statistics), other parameters, gradients, optimizer state. The formula beside it, per rank with N ranks:
full 16 B/param / N (fp32 weight, grad, Adam m and v, all sharded); LoRA 4 B/base param / N + 16 B/adapter param / N;
QLoRA 0.5 B per quantized weight (replicated: nd_parallel leaves packed weights out of FSDP2's sharding) + the
quantization statistics + 4 B/other base param / N + 16 B/adapter param / N.

Part 2 (one process each, fresh interpreter per run): the peak resident memory (ru_maxrss) of a few training
steps of a long sequence with tiled_mlp and activation_offloading off / on. On a CPU-only machine the host is the
device: activation offloading moves nothing and its peak equals the run without it; tiled MLP lowers the peak of
the MLP's intermediate activations on any device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MB = 2**20


def _model_kwargs(quick: bool) -> dict:
    size = 128 if quick else 256
    return dict(hidden_size=size, intermediate_size=4 * size, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, head_dim=size // 8, tie_word_embeddings=False)


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _quant_stats_bytes(p) -> int:
    state = getattr(p, "quant_state", None)
    if state is None:
        return 0
    total = sum(t.numel() * t.element_size() for t in (state.absmax, state.code) if t is not None)
    if getattr(state, "state2", None) is not None:  # double quantization: the absmax of the absmax
        total += sum(t.numel() * t.element_size() for t in (state.state2.absmax, state.state2.code))
    return total


def _build(mode: str, model_dir: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = {}
    if mode == "qlora":
        kwargs = {"quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32), "device_map": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    if mode == "full":
        return model
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))


def worker(model_dir: str, result: str, seq: int) -> None:
    """One rank of part 1: each mode, one FSDP2 step, this rank's bytes."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from nd_parallel import NDParallelPlugin, ParallelismConfig
    from nd_parallel.models.quantized import quantized_params
    from nd_parallel.testing.models import make_samples
    from nd_parallel.testing.parity import _collate

    out = {}
    for mode in ("full", "lora", "qlora"):
        accelerator = Accelerator()
        NDParallelPlugin(ParallelismConfig(dp_shard_size=2)).attach(accelerator)
        model = _build(mode, model_dir)
        counts = {"trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                  "quantized_numel": sum(m.in_features * m.out_features for m in model.modules()  # not PEFT's
                                         if type(m).__module__.startswith("bitsandbytes")),  # Linear4bit wrapper
                  "other_frozen": sum(p.numel() for p in model.parameters()
                                      if not p.requires_grad and p.is_floating_point())}
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        loader = DataLoader(make_samples(8, seq, seed=1), batch_size=1, collate_fn=_collate)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        batch = next(iter(loader))
        accelerator.backward(model(**batch).loss)
        opt.step()
        quantized = {id(p) for p in quantized_params(model)}
        params = list(model.parameters())
        out[mode] = {**counts,
                     "quantized": sum(_local_bytes(p) + _quant_stats_bytes(p) for p in params if id(p) in quantized),
                     "params": sum(_local_bytes(p) for p in params if id(p) not in quantized),
                     "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
                     "optimizer": sum(_local_bytes(v) for s in opt.optimizer.state.values() for v in s.values()
                                      if isinstance(v, torch.Tensor) and v.dim() > 0)}
        opt.zero_grad()
        dist.barrier()
    if dist.get_rank() == 0:
        Path(result).write_text(json.dumps(out))


def peak(model_dir: str, seq: int, options: dict) -> None:
    """One process of part 2: a few steps of one long sequence; prints the peak RSS in MiB."""
    import resource

    import torch
    from transformers import AutoModelForCausalLM

    from nd_parallel.config import ParallelismConfig
    from nd_parallel.distributed import memory
    from nd_parallel.distributed.activation_checkpoint import apply_activation_checkpointing
    from nd_parallel.testing.models import make_samples

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    apply_activation_checkpointing(model, options.pop("activation_checkpointing", None))
    memory.apply_memory_options(model, ParallelismConfig(**options))
    batch = {k: v[None] for k, v in make_samples(1, seq, seed=2)[0].items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(2):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "before_mib": base / 1024}))


PEAK_RUNS = {"baseline": {}, "tiled_mlp": {"tiled_mlp": True},
             "activation_offloading": {"activation_offloading": True},
             "checkpointing": {"activation_checkpointing": "full"},
             "checkpointing + offload": {"activation_checkpointing": "full", "activation_offloading": True}}


def _formula(mode: str, r: dict, world: int) -> float:
    if mode == "full":
        return 16 * r["trainable"] / world
    adapter = 16 * r["trainable"] / world
    if mode == "lora":
        return 4 * r["other_frozen"] / world + adapter
    return 0.5 * r["quantized_numel"] + 4 * r["other_frozen"] / world + adapter


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "RESULT", "SEQ"), help=argparse.SUPPRESS)
    p.add_argument("--peak", nargs=3, metavar=("MODEL", "SEQ", "OPTIONS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker[0], args.worker[1], int(args.worker[2]))
    if args.peak:
        return peak(args.peak[0], int(args.peak[1]), json.loads(args.peak[2]))
    from nd_parallel.fault.launch import launch
    from nd_parallel.testing.models import save_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench_qlora_"))
    model_dir = str(save_tiny_model("llama", work / "model", **_model_kwargs(args.quick)))
    result = work / "states.json"
    launch(__file__, 2, ["--worker", model_dir, str(result), "64"], timeout=1200, capture=True)
    states = json.loads(result.read_text())
    print(f"model: llama {_model_kwargs(args.quick)}; FSDP2 over 2 gloo ranks; bytes on rank 0 after one step")
    print(f"{'mode':<6} {'quantized MiB':>13} {'params MiB':>10} {'grads MiB':>9} {'optim MiB':>9} "
          f"{'total MiB':>9} {'formula MiB':>11} {'ratio':>6} {'vs full':>7}")
    full_total = sum(states["full"][k] for k in ("quantized", "params", "grads", "optimizer"))
    for mode, r in states.items():
        total = sum(r[k] for k in ("quantized", "params", "grads", "optimizer"))
        formula = _formula(mode, r, 2)
        print(f"{mode:<6} {r['quantized'] / MB:>13.3f} {r['params'] / MB:>10.3f} {r['grads'] / MB:>9.3f} "
              f"{r['optimizer'] / MB:>9.3f} {total / MB:>9.3f} {formula / MB:>11.3f} {total / formula:>6.3f} "
              f"{total / full_total:>7.3f}")
    seq = 512 if args.quick else 2048
    print(f"\npeak resident memory, one process, 2 steps of one {seq}-token sequence ({os.cpu_count()} CPUs; "
          "the host is the device: offloading moves nothing here)")
    base_peak = None
    for name, options in PEAK_RUNS.items():
        run = subprocess.run([sys.executable, __file__, "--peak", model_dir, str(seq), json.dumps(options)],
                             capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        got = json.loads(run.stdout.strip().splitlines()[-1])
        base_peak = base_peak or got["peak_mib"]
        print(f"{name:<24} peak {got['peak_mib']:8.1f} MiB  (after loading {got['before_mib']:7.1f} MiB)  "
              f"ratio to baseline {got['peak_mib'] / base_peak:.3f}")


if __name__ == "__main__":
    main()
