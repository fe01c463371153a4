"""Rank program (or one process) for the SFTTrainer rows: an unchanged TRL SFTTrainer script plus NDParallelCallback.

Usage: sft_worker.py OUT_DIR SPEC_JSON   (under torchrun; or plain python for the one-process references)
SPEC_JSON: {"model": dir, "runs": [[name, {config kwargs} | null, {SFTConfig}, {extras}]]}
A null config is the reference: SFTTrainer alone. extras: "data": "text" (plain language modelling),
"completion" (a prompt-completion dataset: completion_only_loss) or "chat" (a conversational dataset, whose
template marks the assistant turns with {% generation %}: assistant_only_loss); "lora": true passes peft_config;
"resume": N trains, then trains again from a fresh model resumed from the first run's checkpoint-N.
The tokenizer is a tiny BPE trained locally (nd_parallel.testing.tokenizer), its chat template written here.
Writes, from the main process, every logged loss, grad norm, mean_token_accuracy, entropy and num_tokens, the
eval losses and the final full state.
"""

import json
import random
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from nd_parallel.testing.models import make_text
from nd_parallel.testing.tokenizer import train_tiny_tokenizer

# ChatML with the assistant turns inside {% generation %}: what assistant_only_loss reads the mask from.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>"
    "{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
METRICS = ("loss", "grad_norm", "mean_token_accuracy", "entropy", "num_tokens")


def tokenizer():
    tok = train_tiny_tokenizer(make_text(200, seed=3))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def dataset(kind: str, n: int, seed: int) -> Dataset:
    """Rows of different lengths (so batches pad and packing packs several documents per row)."""
    rng, lines = random.Random(seed), make_text(4 * n, seed=seed)
    words = [" ".join(lines[i:i + rng.randint(1, 3)])[: rng.randint(12, 60)] for i in range(0, 4 * n, 4)]
    if kind == "text":
        return Dataset.from_dict({"text": words})
    if kind == "completion":
        return Dataset.from_dict({"prompt": [w[: len(w) // 2] for w in words],
                                  "completion": [w[len(w) // 2:] for w in words]})
    chats = [[{"role": "user", "content": w[: len(w) // 3]}, {"role": "assistant", "content": w[len(w) // 3:]}]
             for w in words]
    return Dataset.from_dict({"messages": chats})


def _trainer(SFTConfig, SFTTrainer, spec, out_dir, name, config, sft_args, extras, tok):
    """A new SFTTrainer (and callback: one callback adopts one trainer) on a freshly loaded model."""
    callbacks = []
    if config is not None:
        from nd_parallel import ParallelismConfig
        from nd_parallel.plugins.trainer import NDParallelCallback

        callbacks = [NDParallelCallback(ParallelismConfig(**config))]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(extras.get("model", spec["model"]))
    peft_config = None
    if extras.get("lora"):
        from peft_recipe import SEED, lora_config

        torch.manual_seed(SEED)
        peft_config = lora_config()
    kind = extras["data"]
    args = SFTConfig(output_dir=f"{out_dir}/{name}", report_to=[], use_cpu=True, dataset_num_proc=None,
                     assistant_only_loss=kind == "chat", **sft_args)
    return SFTTrainer(model=model, args=args, train_dataset=dataset(kind, 48, seed=0),
                      eval_dataset=dataset(kind, 8, seed=1) if args.eval_strategy != "no" else None,
                      processing_class=tok, peft_config=peft_config, callbacks=callbacks)


def main(out_dir: str, spec_path: str) -> None:
    from trl import SFTConfig, SFTTrainer

    spec = json.load(open(spec_path))
    tok = tokenizer()
    for name, config, sft_args, extras in spec["runs"]:
        trainer = _trainer(SFTConfig, SFTTrainer, spec, out_dir, name, config, sft_args, extras, tok)
        trainer.train()
        uninterrupted = None
        if extras.get("resume"):  # again from a fresh model, resumed from the first run's checkpoint
            uninterrupted = trainer.accelerator.get_state_dict(trainer.model_wrapped)
            trainer = _trainer(SFTConfig, SFTTrainer, spec, out_dir, name, config, sft_args, extras, tok)
            trainer.train(resume_from_checkpoint=f"{out_dir}/{name}/checkpoint-{extras['resume']}")
        logs = [h for h in trainer.state.log_history if "loss" in h]
        state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        if trainer.accelerator.is_main_process:
            torch.save({**{k: [h[k] for h in logs] for k in METRICS}, "state": state, "uninterrupted": uninterrupted,
                        "eval_losses": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
                        "eval_accuracy": [h["eval_mean_token_accuracy"] for h in trainer.state.log_history
                                          if "eval_mean_token_accuracy" in h]}, f"{out_dir}/{name}.pt")
        trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
