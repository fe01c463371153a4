"""Accelerate's ND-parallel Trainer script (its ``examples/torch_native_parallelism/nd_parallel_trainer.py``), our
copy: the same structure and calls, with one change of substance, the import of ``ParallelismConfig``. The layout
comes from the ``accelerate launch`` config file (``ParallelismConfig()`` reads PARALLELISM_CONFIG_*), as there.

    ACCELERATE_USE_CPU=true accelerate launch --config_file examples/accelerate_nd_parallel/configs/fsdp2_tp2.yaml \\
        examples/accelerate_nd_parallel/nd_parallel_trainer.py --device-type cpu

Where it differs from Accelerate's, and why: a tiny Llama built on the spot and locally made byte-level data (no
download, so no tokenizer); ``--device-type cpu`` because ``torch.accelerator`` names no device on a CPU machine;
``--precision`` (default bf16, as Accelerate's) so the tests can compare fp32 runs at rtol 1e-5;
``--per-device-batch-size``, ``--max-steps``, ``--learning-rate`` and ``--adam-epsilon`` so one process can take a
layout's global batch for a few steps, learn visibly in them and be compared weight by weight;
``--log-json`` records the Trainer's logs for the tests.
"""

import argparse
import json
import os
import tempfile

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from utils import get_dataset, tiny_model

from nd_parallel import ParallelismConfig  # was: from accelerate.utils import ParallelismConfig


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--checkpoint-frequency", type=int, default=100)
    parser.add_argument("--model-name", type=str, default=None, help="local checkpoint (default: a tiny Llama)")
    parser.add_argument("--save-dir", type=str, default="./accelerate-nd-parallel-tiny-llama")
    parser.add_argument("--device-type", type=str, default="auto")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--per-device-batch-size", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--adam-epsilon", type=float, default=1e-8)
    parser.add_argument("--log-json", type=str, default=None)
    return parser.parse_args()


def main():
    # If ParallelismConfig is not initialized with __init__, it reads from env vars
    # which were set by using config
    pc = ParallelismConfig()
    args = parse_args()
    if args.model_name is None:  # one directory per rank: no two processes write the same file
        args.model_name = tiny_model(os.path.join(tempfile.gettempdir(),
                                                  f"nd_parallel_example_llama_{os.environ.get('RANK', '0')}"))

    if args.device_type == "auto":
        args.device_type = torch.accelerator.current_accelerator().type

    model_kwargs = {}
    if pc.tp_enabled:
        model_kwargs["tp_plan"] = "auto"
        model_kwargs["device_mesh"] = pc.build_device_mesh(args.device_type)

    model = AutoModelForCausalLM.from_pretrained(args.model_name, use_cache=False, **model_kwargs)

    packed_dataset = get_dataset(args.sequence_length)

    training_args = TrainingArguments(
        output_dir=args.save_dir,
        parallelism_config=pc,
        num_train_epochs=1,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_batch_size,
        logging_steps=1,
        save_steps=args.checkpoint_frequency,
        learning_rate=args.learning_rate,
        adam_epsilon=args.adam_epsilon,
        remove_unused_columns=False,
        bf16=args.precision == "bf16",
        use_cpu=args.device_type == "cpu",
        report_to=[],
    )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=packed_dataset,
    )

    trainer.train()
    trainer.save_model()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if args.log_json and trainer.accelerator.is_main_process:
        with open(args.log_json, "w") as fh:
            json.dump({"losses": [h["loss"] for h in logs], "norms": [h["grad_norm"] for h in logs],
                       "config": trainer.accelerator.parallelism_config.describe(),
                       "adopted": getattr(trainer, "nd_parallel", None) is not None}, fh)


if __name__ == "__main__":
    main()
