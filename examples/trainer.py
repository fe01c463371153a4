"""An unchanged transformers.Trainer script; the only addition is NDParallelCallback.

    torchrun --nproc-per-node 4 examples/trainer.py --tp-size 2            # FSDP2 x TP2 (dp_shard = the rest)
    torchrun --nproc-per-node 2 examples/trainer.py --pp-size 2 --lora     # a LoRA adapter under PP2
    accelerate launch --config_file examples/accelerate/fsdp2_tp2.yaml examples/trainer.py   # layout from the file

Without sizes on the command line the callback takes the layout `accelerate launch` passes (PARALLELISM_CONFIG_*).
On a machine without GPUs set ACCELERATE_USE_CPU=true (or use `accelerate launch --cpu`). A seeded tiny Llama is
built on the spot, so nothing is downloaded. The end: the adapter (with --lora) or the full model in OUTPUT_DIR/final.
"""

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from nd_parallel import ParallelismConfig
from nd_parallel.plugins.trainer import NDParallelCallback
from nd_parallel.testing.models import make_samples, save_tiny_model


def collate(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for dim in ("tp", "pp", "cp", "dp-replicate"):
        parser.add_argument(f"--{dim}-size", type=int)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter instead of the whole model")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--output-dir", default=tempfile.mkdtemp(prefix="nd_parallel_trainer_"))
    args = parser.parse_args()
    sizes = {f"{d}_size": getattr(args, f"{d}_size") for d in ("tp", "pp", "cp", "dp_replicate")}
    sizes = {k: v for k, v in sizes.items() if v}
    # Built before the Trainer (as its argument), so it can adjust accelerate launch's env before the Accelerator.
    callback = NDParallelCallback(ParallelismConfig(dp_shard_size=-1, **sizes)) if sizes else NDParallelCallback()

    model_dir = save_tiny_model("llama", f"{args.output_dir}/base", num_hidden_layers=4)  # same seed on every rank
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=args.steps, learning_rate=1e-3, lr_scheduler_type="cosine", logging_steps=1,
        save_strategy="steps", save_steps=args.steps // 2, report_to=[], use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=model, args=training, train_dataset=make_samples(n=256, seq_len=64),
                      data_collator=collate, callbacks=[callback])
    trainer.train()
    trainer.save_model(f"{args.output_dir}/final")


if __name__ == "__main__":
    main()
