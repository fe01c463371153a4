"""Rank program (or one process) for the Trainer rows: an unchanged Trainer script plus NDParallelCallback.

Usage: trainer_worker.py OUT_DIR SPEC_JSON   (under torchrun; or plain python for the one-process reference)
SPEC_JSON: {"model": dir, "samples": {...}, "runs": [[name, {config kwargs} | null, {TrainingArguments}, {extras}]]}
A null config is the reference: no callback. extras: "lora": true wraps the model with the LoRA recipe;
"resume": checkpoint dir passed to train(resume_from_checkpoint=...); "save_model": dir for trainer.save_model();
"eval": {make_samples kwargs} evaluates on them every 2 steps inside train() and twice after it, with logits
(compute_metrics: next-token accuracy, mean logit, prediction count) and with prediction_loss_only=True.
Writes, from the main process, the logged losses and grad norms, eval results, how many decoder layers run under
nd_parallel's activation checkpointing, the final full state of each run and, for a LoRA reference, its trained
adapter under the names PEFT saves it with.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from nd_parallel.testing.models import make_samples


def collate(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def next_token_metrics(pred):
    logits, labels = torch.as_tensor(pred.predictions), torch.as_tensor(pred.label_ids)
    hit = logits[:, :-1].argmax(-1) == labels[:, 1:]
    keep = labels[:, 1:] != -100
    return {"acc": (hit & keep).sum().item() / keep.sum().item(), "mean_logit": logits.double().mean().item(),
            "n": logits.shape[0]}


def checkpointed_layers(model) -> int:
    from nd_parallel.distributed.activation_checkpoint import CheckpointedForward

    return sum(isinstance(m.__dict__.get("forward"), CheckpointedForward) for m in model.modules())


def main(out_dir: str, spec_path: str) -> None:
    spec = json.load(open(spec_path))
    samples = make_samples(**spec["samples"])
    for name, config, train_args, extras in spec["runs"]:
        callbacks = []
        if config is not None:
            from nd_parallel import ParallelismConfig
            from nd_parallel.plugins.trainer import NDParallelCallback

            callbacks = [NDParallelCallback(ParallelismConfig(**config))]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(spec["model"])
        if extras.get("lora"):
            from peft import get_peft_model
            from peft_recipe import SEED, lora_config

            torch.manual_seed(SEED)
            model = get_peft_model(model, lora_config())
        args = TrainingArguments(output_dir=f"{out_dir}/{name}", report_to=[], use_cpu=True, **train_args)
        evals = make_samples(**extras["eval"]) if extras.get("eval") else None
        trainer = Trainer(model=model, args=args, train_dataset=samples, eval_dataset=evals, data_collator=collate,
                          callbacks=callbacks, compute_metrics=next_token_metrics if evals is not None else None)
        trainer.train(resume_from_checkpoint=extras.get("resume"))
        after = {}
        if evals is not None:
            after = trainer.evaluate(metric_key_prefix="full")
            trainer.args.prediction_loss_only = True
            after.update(trainer.evaluate(metric_key_prefix="lossonly"))
        if "save_model" in extras:
            trainer.save_model(extras["save_model"])
        accelerator = trainer.accelerator
        state = accelerator.get_state_dict(trainer.model_wrapped)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        adapter = None
        if extras.get("lora") and config is None:  # the reference's trained adapter, as PEFT names it for saving
            from peft import get_peft_model_state_dict

            adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model).items()}
        if accelerator.is_main_process:
            torch.save({"losses": [h["loss"] for h in logs], "norms": [h["grad_norm"] for h in logs],
                        "adapter": adapter,
                        "steps": [h["step"] for h in logs], "state": state,
                        "scale": accelerator.scaler.get_scale() if accelerator.scaler is not None else None,
                        "eval_losses": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
                        "after": {k: v for k, v in after.items() if k.partition("_")[2] in ("loss", "acc", "mean_logit",
                                                                                           "n")},
                        "checkpointed": checkpointed_layers(trainer.model_wrapped)}, f"{out_dir}/{name}.pt")
        accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
