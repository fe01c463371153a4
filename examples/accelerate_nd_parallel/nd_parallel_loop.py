"""Accelerate's ND-parallel training loop (its ``examples/torch_native_parallelism/nd_parallel.py``), our copy: the
same structure and the same Accelerate calls, with one change of substance, the import of ``ParallelismConfig``.

    accelerate launch --config_file examples/accelerate_nd_parallel/configs/fsdp2.yaml \\
        examples/accelerate_nd_parallel/nd_parallel_loop.py --dp-shard-size 2
    PARALLELISM_CONFIG_PP_SIZE=2 PARALLELISM_CONFIG_PP_MICROBATCHES=1 ACCELERATE_USE_CPU=true \\
        torchrun --nproc-per-node 2 examples/accelerate_nd_parallel/nd_parallel_loop.py      # gains PP

Where it differs from Accelerate's, and why: the model is a tiny Llama built on the spot and the data are made
locally (nothing is downloaded); ``--precision`` (default bf16, as Accelerate's) lets the tests compare fp32 runs at
rtol 1e-5; ``--batch-size`` lets one process take the global batch of a layout; ``dist.all_reduce`` averages with
SUM / size because gloo (CPU) has no ``ReduceOp.AVG``; the end saves with ``accelerator.save_model`` (a pipeline stage
has no ``save_pretrained``); ``--log-json`` records the losses for the tests; ``--tp-without-size`` loads with
``tp_plan``/``device_mesh`` but no ``tp_size`` (transformers 5.24 ignores ``device_mesh`` and refuses a tp_size below
the world size; nd_parallel gathers such a model back and applies its own plan).
"""

import argparse
import json
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin, set_seed
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM
from utils import PerformanceTracker, create_collate_fn, get_dataset, get_model_flops_per_token, tiny_model

from nd_parallel import ParallelismConfig  # was: from accelerate.parallelism_config import ParallelismConfig


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp-replicate-size", type=int, default=1)
    parser.add_argument("--dp-shard-size", type=int, default=1)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--cp-size", type=int, default=1)
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--num-steps", type=int, default=1000)
    parser.add_argument("--save-dir", type=str, default="./outputs")
    parser.add_argument("--checkpoint-frequency", type=int, default=100)
    parser.add_argument("--model-name", type=str, default=None, help="local checkpoint (default: a tiny Llama)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--log-json", type=str, default=None)
    parser.add_argument("--tp-without-size", action="store_true")
    return parser.parse_args()


def forward(model, batch, optimizer, accelerator: Accelerator):
    batch["position_ids"] = torch.arange(0, batch["input_ids"].size(1), device=batch["input_ids"].device).unsqueeze(0)
    # labels and shift_labels: transformers' loss runs when labels are given and prefers shift_labels
    buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)
    ):
        # the loss averaged over the ranks that take part in data / context parallel training
        loss_reduce_grp = (
            accelerator.torch_device_mesh["dp_cp"].get_group()
            if accelerator.parallelism_config.dp_cp_dim_names
            else None
        )
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=loss_reduce_grp)  # gloo has no ReduceOp.AVG
        loss /= dist.get_world_size(loss_reduce_grp)

    return loss


def load_model(args, accelerator: Accelerator):
    # If TP was enabled, we need to tell transformers to prepare the model for us
    model_kwargs = (
        {"tp_size": args.tp_size, "tp_plan": "auto", "device_mesh": accelerator.torch_device_mesh}
        if args.tp_size > 1
        else {}
    )
    if args.tp_without_size:
        model_kwargs.pop("tp_size", None)
    return AutoModelForCausalLM.from_pretrained(
        args.model_name,
        torch_dtype=torch.bfloat16 if args.precision == "bf16" else torch.float32,
        use_cache=False,
        **model_kwargs,
    )


def train(args):
    parallelism_config = ParallelismConfig(
        dp_replicate_size=args.dp_replicate_size,
        dp_shard_size=args.dp_shard_size,
        tp_size=args.tp_size,
        cp_size=args.cp_size,
    )

    # FSDP needs extra configuration, so we properly shard the model
    fsdp2_plugin = None
    if parallelism_config.dp_shard_enabled or parallelism_config.cp_enabled:
        fsdp2_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            state_dict_type="SHARDED_STATE_DICT",
        )

    mixed_precision = "bf16" if args.precision == "bf16" else "no"
    accelerator = Accelerator(mixed_precision=mixed_precision, parallelism_config=parallelism_config,
                              fsdp_plugin=fsdp2_plugin)
    accelerator.init_trackers("nd_parallel_training")

    model = load_model(args, accelerator)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    dataset = get_dataset(args.sequence_length)
    dataloader = DataLoader(dataset, batch_size=args.batch_size, collate_fn=create_collate_fn())

    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)

    total_num_steps = min(args.num_steps, len(dataloader))
    performance_tracker = PerformanceTracker(warmup_steps=5)
    model_flops_per_token = get_model_flops_per_token(model, args.sequence_length)

    accelerator.print("Starting training...")
    losses = []
    for step, batch in enumerate(dataloader):
        if step >= total_num_steps:
            break

        loss = forward(model, batch, optimizer, accelerator)
        losses.append(loss.item())

        # We report TPS per device, so we divide by the number of devices in the non-data parallel dimension
        metrics = performance_tracker.step(
            batch["input_ids"].shape[1] / parallelism_config.non_data_parallel_size, model_flops_per_token
        )

        print_msg = f"Step {step}/{total_num_steps}, Loss: {loss.item():.4f}"
        if "warmup_completed" in metrics:
            accelerator.print("Warm up completed! Starting performance tracking...")
        elif metrics:
            print_msg += performance_tracker.get_print_message(metrics)

        if step % 10 == 0 or step == total_num_steps - 1:
            accelerator.print(print_msg)

        if step % args.checkpoint_frequency == 0 and step > 0 and parallelism_config.dp_shard_enabled:
            accelerator.print(f"Saving checkpoint at step {step}...")
            accelerator.save_state(args.save_dir + f"/checkpoint-{step}")

        accelerator.log({"loss": loss.item()})

    accelerator.print("Training completed!")

    accelerator.save_model(model, args.save_dir + "/final")
    accelerator.print(f"Model saved to {args.save_dir}/final")
    if args.log_json and accelerator.is_main_process:
        with open(args.log_json, "w") as fh:
            json.dump({"losses": losses, "config": accelerator.parallelism_config.describe(),
                       "mesh": list(accelerator.torch_device_mesh.mesh_dim_names)
                       if accelerator.torch_device_mesh is not None else None}, fh)
    accelerator.end_training()


if __name__ == "__main__":
    set_seed(42)
    args = parse_args()
    if args.model_name is None:  # the same seeded tiny Llama in every process; built before any process group
        rank = os.environ.get("RANK", "0")  # one directory per rank: no two processes write the same file
        args.model_name = tiny_model(os.path.join(tempfile.gettempdir(), f"nd_parallel_example_llama_{rank}"))
    if args.dp_shard_size == 1 and args.tp_size > 1:
        warnings.warn("pure tensor parallelism: intermediate checkpoints are saved only with dp_shard_size > 1, as in "
                      "Accelerate's example")
    train(args)
