"""The Accelerate loop of docs/architecture.md, unchanged, under the layout that `accelerate launch` passes.

    accelerate launch --config_file examples/accelerate/fsdp2_tp2.yaml examples/train.py
    accelerate launch --config_file examples/accelerate/ddp2.yaml examples/train.py \
        --model-dir runs/tiny/model --data runs/tiny/data.txt --output-dir runs/example-ddp2

The sizes come from the config file's `parallelism_config:` section, which accelerate hands to every rank
as PARALLELISM_CONFIG_* variables (read by ParallelismConfig.from_env). Without --model-dir every rank
builds the same seeded tiny Llama in a temporary directory, so no download is ever needed.
"""

import argparse
import tempfile

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.accelerate.launcher_env import adopt_launcher_env
from nd_parallel.cli.train.data import DatasetSpec, build_samples, collate
from nd_parallel.testing.models import make_samples, save_tiny_model


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="local HF checkpoint (default: a tiny Llama built on the spot)")
    parser.add_argument("--data", help="a .txt (one document per line) or .jsonl ({'text': ...}) file")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2, help="samples per data-parallel rank")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--output-dir", help="write the trained model here (HF format)")
    return parser.parse_args()


def main():
    args = parse_args()
    # Seeded, so every rank builds the same weights and samples without talking to the others; done before
    # Accelerator() because save_pretrained writes on rank 0 only once torch.distributed is initialized.
    model_dir = args.model_dir or save_tiny_model("llama", tempfile.mkdtemp(prefix="nd-parallel-tiny-"))
    # Before Accelerator(): nd_parallel, not accelerate, turns the sizes into a mesh, and on a CPU-only
    # machine Accelerator() must be told that torchrun's ranks are CPU ranks (see nd_parallel/cli/train/rank.py).
    adopt_launcher_env()
    config = ParallelismConfig.from_env()
    accelerator = Accelerator()
    plugin = NDParallelPlugin(config)
    plugin.attach(accelerator)

    if args.data:
        samples, how = build_samples(str(model_dir), [DatasetSpec(args.data)], args.seq_len)
        accelerator.print(f"{len(samples)} samples ({how})")
    else:
        samples = make_samples(args.steps * args.batch_size * plugin.config.dp_size, args.seq_len)

    model = plugin.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dataloader = DataLoader(samples, batch_size=args.batch_size, collate_fn=collate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (2 * args.steps))
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)

    for step, batch in enumerate(dataloader):
        if step == args.steps:
            break
        out = model(**batch)
        accelerator.backward(out.loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step + 1:>3}  loss {out.loss.item():.4f}  grad_norm {float(norm):.4f}")

    if args.output_dir:
        accelerator.save_model(model, args.output_dir)  # full HF-named weights, written by the main process
        if accelerator.is_main_process:
            model.config.save_pretrained(args.output_dir)
    accelerator.print(f"done: {plugin.config.describe()}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
