"""Rank program (or one process) for the TRL preference-trainer rows (DPOTrainer, KTOTrainer, ORPOTrainer): an
unchanged TRL script plus NDParallelCallback.

Usage: preference_worker.py OUT_DIR SPEC_JSON   (under torchrun; or plain python for the one-process references)
SPEC_JSON: {"trainer": "dpo" | "kto" | "orpo", "model": dir,
            "runs": [[name, {config kwargs} | null, {TRL config}, {extras}]]}
A null config is the reference: the TRL trainer alone. extras: "lora": true passes peft_config (the reference policy
is then the base with the adapter disabled; ORPO has none); without it DPO / KTO build their own frozen reference.
"prepare_batch": n (KTO references): the trainer prepares its data with per_device_train_batch_size n (KTOTrainer
pairs each prompt with a mismatched completion within blocks of that many rows) and then trains with the config's.
Data: prompt / chosen / rejected (DPO, ORPO) or prompt / completion / label (KTO) strings of different lengths from
the locally generated text; the tokenizer is a tiny BPE trained locally (nd_parallel.testing.tokenizer). Evaluates on 8
other examples every 2 steps. Writes, from the main process, every logged loss, grad norm and reward metric, the same
evaluation metrics, and the final full state.
"""

import json
import random
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from nd_parallel.testing.models import make_text
from nd_parallel.testing.tokenizer import train_tiny_tokenizer

METRICS = {"dpo": ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                   "logps/rejected"),
           "kto": ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"),
           "orpo": ("loss", "grad_norm", "nll_loss", "log_odds_ratio", "rewards/margins", "logps/chosen",
                    "logps/rejected")}


def dataset(kind: str, n: int, seed: int) -> Dataset:
    rng, lines = random.Random(seed), make_text(3 * n, seed=seed)
    if kind == "kto":  # desirable and undesirable completions, mixed
        return Dataset.from_dict({"prompt": [lines[3 * i][: rng.randint(8, 30)] for i in range(n)],
                                  "completion": [lines[3 * i + 1][: rng.randint(6, 30)] for i in range(n)],
                                  "label": [rng.random() < 0.5 for _ in range(n)]})
    rows = {"prompt": [], "chosen": [], "rejected": []}
    end = "\n" if kind == "orpo" else ""  # ORPOTrainer tokenizes prompt + answer whole: no BPE merge across them
    for i in range(n):
        rows["prompt"].append(lines[3 * i][: rng.randint(8, 30)] + end)
        rows["chosen"].append(lines[3 * i + 1][: rng.randint(6, 30)])
        rows["rejected"].append(lines[3 * i + 2][: rng.randint(6, 30)])
    return Dataset.from_dict(rows)


def _trainer(kind, spec, out_dir, name, config, trl_args, extras, tok):
    import trl
    from trl.experimental import orpo

    Config, Trainer = {"dpo": (trl.DPOConfig, trl.DPOTrainer), "kto": (trl.KTOConfig, trl.KTOTrainer),
                       "orpo": (orpo.ORPOConfig, orpo.ORPOTrainer)}[kind]
    callbacks = []
    if config is not None:
        from nd_parallel import ParallelismConfig
        from nd_parallel.plugins.trainer import NDParallelCallback

        callbacks = [NDParallelCallback(ParallelismConfig(**config))]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(spec["model"])
    peft_config = None
    if extras.get("lora"):
        from peft_recipe import SEED, lora_config

        torch.manual_seed(SEED)
        peft_config = lora_config()
    batch = trl_args["per_device_train_batch_size"]
    args = Config(output_dir=f"{out_dir}/{name}", report_to=[], use_cpu=True, dataset_num_proc=None,
                  eval_strategy="steps", eval_steps=2,
                  **{**trl_args, "per_device_train_batch_size": extras.get("prepare_batch", batch)})
    trainer = Trainer(model=model, args=args, train_dataset=dataset(kind, 32, seed=0),
                      eval_dataset=dataset(kind, 8, seed=1), processing_class=tok, peft_config=peft_config,
                      callbacks=callbacks)
    trainer.args.per_device_train_batch_size = batch
    trainer._train_batch_size = trainer.args.train_batch_size  # the Trainer read it in __init__
    return trainer


def main(out_dir: str, spec_path: str) -> None:
    spec = json.load(open(spec_path))
    kind = spec.get("trainer", "dpo")
    tok = train_tiny_tokenizer(make_text(200, seed=3))
    for name, config, trl_args, extras in spec["runs"]:
        trainer = _trainer(kind, spec, out_dir, name, config, trl_args, extras, tok)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        if trainer.accelerator.is_main_process:
            evals = [h for h in trainer.state.log_history if "eval_loss" in h]
            torch.save({**{k: [h.get(k) for h in logs] for k in METRICS[kind]}, "state": state,
                        **{f"eval_{k}": [h.get(f"eval_{k}") for h in evals] for k in METRICS[kind]
                           if k != "grad_norm"}}, f"{out_dir}/{name}.pt")
        trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
