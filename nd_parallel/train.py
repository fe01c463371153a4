"""Training-loop helpers behind `nd-parallel train` and `nd-parallel demo` (the YAML side is in cli.py).

- `build_samples`: text files -> tokenized documents packed into right-padded `sequence_len` samples.
- `train_steps`: the Accelerate loop with gradient accumulation that keeps the global-token mean.
- `run_rank`: what every launched rank executes (``python nd_parallel/train.py JOB.json`` under torchrun);
  rank 0 gathers every rank's results into ``results.pt`` for the parent to report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import logging
import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nd_parallel.config import ConfigError, ParallelismConfig
from nd_parallel.loss import IGNORE_INDEX, count_label_tokens

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class DatasetSpec:
    """One text source (Axolotl's `datasets:` entry)."""

    path: str
    """Local .txt (one document per non-empty line), .jsonl or .json (records) file."""
    type: str = "completion"
    """Only "completion": every token of the text is trained on."""
    field: str = "text"
    """Key holding the text in .jsonl / .json records."""


def suggest(key: str, choices) -> str:
    """'did you mean ...?' for a mistyped key, else the valid keys."""
    close = difflib.get_close_matches(key, sorted(choices), n=1)
    return f"did you mean {close[0]!r}?" if close else "valid keys are: " + ", ".join(sorted(choices))


def dataset_specs(path, datasets: Any, dataset_path: Any) -> list[DatasetSpec]:
    """The `datasets:` list (or `dataset_path:` string) of a YAML file `path`, checked."""
    if (datasets is None) == (dataset_path is None):
        raise ConfigError(f"{path}: give the training text as either 'datasets: [{{path: data.jsonl, type: "
                          "completion, field: text}]' or 'dataset_path: data.txt' (exactly one of them)")
    if dataset_path is not None:
        datasets = [{"path": dataset_path}]
    if not isinstance(datasets, list) or not datasets:
        raise ConfigError(f"{path}: datasets must be a non-empty list of {{path, type, field}} mappings")
    valid = {f.name for f in dataclasses.fields(DatasetSpec)}
    specs = []
    for i, entry in enumerate(datasets):
        entry = {"path": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise ConfigError(f"{path}: datasets[{i}] must be a mapping with a 'path' string")
        for key in entry:
            if key not in valid:
                raise ConfigError(f"{path}: unknown key {key!r} in datasets[{i}]; {suggest(key, valid)}")
        spec = DatasetSpec(**entry)
        if spec.type != "completion":
            raise ConfigError(f"{path}: datasets[{i}].type={spec.type!r} is not supported; use 'completion'")
        specs.append(spec)
    return specs


# ----------------------------------------------------------------------------------------------- data
def read_documents(spec: DatasetSpec) -> list[str]:
    """Texts of one source: non-empty lines of a .txt, or `spec.field` of each .jsonl / .json record."""
    path = Path(spec.path)
    if not path.is_file():
        raise ConfigError(f"dataset file {spec.path!r} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".txt":
        return [line for line in text.splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    elif path.suffix == ".json":
        records = json.loads(text)
    else:
        raise ConfigError(f"dataset file {spec.path!r}: use a .txt, .jsonl or .json file")
    for i, rec in enumerate(records if isinstance(records, list) else [records]):
        if not isinstance(rec, dict) or not isinstance(rec.get(spec.field), str):
            raise ConfigError(f"{spec.path}: record {i} has no string field {spec.field!r}; set 'field:'")
    return [rec[spec.field] for rec in records]


def load_tokenizer(model_dir: str):
    """The checkpoint's own tokenizer, or None when the directory has none (byte-level fallback)."""
    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _encoder(tokenizer):
    """(text -> ids ending with a document separator, pad id)."""
    if tokenizer is None:
        from nd_parallel.toy import PAD_ID, encode

        return (lambda text: encode(text + "\n")), PAD_ID
    eos = tokenizer.eos_token_id

    def encode_doc(text):
        ids = tokenizer(text)["input_ids"]
        return ids + [eos] if eos is not None and ids[-1:] != [eos] else ids

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    return encode_doc, pad


def _padded(ids: list[int], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    pad = seq_len - len(ids)
    return {"input_ids": torch.tensor(ids + [pad_id] * pad),
            "labels": torch.tensor(ids + [IGNORE_INDEX] * pad),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * pad)}


def pack(docs: list[list[int]], seq_len: int, pad_id: int) -> list[dict[str, torch.Tensor]]:
    """Whole documents packed greedily into samples of <= seq_len tokens (longer ones cut), right-padded."""
    samples, current = [], []
    for ids in docs:
        for start in range(0, len(ids), seq_len):
            chunk = ids[start:start + seq_len]
            if len(current) + len(chunk) > seq_len:
                samples.append(_padded(current, seq_len, pad_id))
                current = []
            current = current + chunk
    if current:
        samples.append(_padded(current, seq_len, pad_id))
    return samples


def _vocab_size(model_dir: str) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("vocab_size") or config.get("text_config", {})["vocab_size"]


def build_samples(base_model: str, datasets: list[DatasetSpec], sequence_len: int) -> tuple[list[dict], str]:
    """(samples, how the text was tokenized); deterministic, so every rank may build the same list."""
    tokenizer = load_tokenizer(base_model)
    encode, pad_id = _encoder(tokenizer)
    docs = [encode(text) for spec in datasets for text in read_documents(spec)]
    vocab = _vocab_size(base_model)
    top = max((max(d) for d in docs if d), default=0)
    if top >= vocab:
        raise ConfigError(f"token id {top} does not fit the vocabulary ({vocab}) of {base_model}; "
                          "add the checkpoint's tokenizer files to that directory")
    how = (f"tokenizer of {base_model}" if tokenizer is not None else
           f"byte-level ids: no tokenizer files in {base_model}")
    return pack(docs, sequence_len, pad_id), how


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


# ----------------------------------------------------------------------------------------------- loop
def _endless(loader):
    while True:  # epochs repeat the same order: the data is not shuffled, so runs are reproducible
        yield from loader


def train_steps(accelerator, model, optimizer, scheduler, loader, *, steps: int, accumulation: int,
                max_norm: float, on_step=None) -> tuple[list[float], list[float]]:
    """Optimizer steps over `accumulation` micro-batches each; returns (loss per step, grad norm per step)."""
    batches = _endless(loader)
    losses, norms = [], []
    for step in range(steps):
        micro = [next(batches) for _ in range(accumulation)]  # prefetched: the step's token count comes first
        # This rank's label tokens over the whole step. The model's loss hook adds the other data-parallel ranks'
        # counts, so each micro-step's loss is its share of the step's global-token mean.
        local = sum(int(count_label_tokens(mb["labels"])) for mb in micro)
        # With one micro-batch the model's own count is the same; a pipeline counts its own and refuses it.
        extra = {"num_items_in_batch": local} if accumulation > 1 else {}
        total = 0.0
        for mb in micro:
            loss = model(**mb, **extra).loss
            if not getattr(loss, "_nd_parallel_backward_done", False):  # a pipeline schedule ran it already
                loss.backward()  # not accelerator.backward: it may divide by the accumulation steps a second time
            total += loss.item()
        norm = float(accelerator.clip_grad_norm_(model.parameters(), max_norm))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(total)
        norms.append(norm)
        if on_step is not None:
            on_step(step, total, norm)
    return losses, norms


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP/TP): only this rank's shard is real
    return t.numel() * t.element_size()


def local_state_bytes(optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters and AdamW moments, measured on the real (sharded) tensors."""
    opt = getattr(optimizer, "optimizer", optimizer)
    params = list({id(p): p for g in opt.param_groups for p in g["params"]}.values())
    moments = [v for p in params for k, v in opt.state.get(p, {}).items() if k != "step" and torch.is_tensor(v)]
    return {"params": sum(map(_local_bytes, params)), "optimizer": sum(map(_local_bytes, moments))}


def checkpoint_numel(model_dir: str) -> int:
    """Parameters of a checkpoint, from its safetensors headers (a tied weight is stored once)."""
    from safetensors import safe_open

    total = 0
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (no __iter__)
    return total


def save_hf(accelerator, model, output_dir: str, tokenizer_dir: str | None = None) -> None:
    """Full checkpoint that AutoModelForCausalLM.from_pretrained(output_dir) loads; collective, main writes.

    accelerator.save_model under the plugin gathers and writes one tensor at a time (checkpoint/export.py), so
    the whole model is never held by one rank.
    """
    accelerator.save_model(model, output_dir)
    if not accelerator.is_main_process:
        return
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
    if tokenizer is not None:  # so that the output directory is a complete checkpoint
        tokenizer.save_pretrained(output_dir)


# ----------------------------------------------------------------------------------------------- ranks
def adopt_launcher_env(environ=None) -> None:
    """Launcher boundary, before ``Accelerator()``: let it see every rank, with nd_parallel owning the layout."""
    env = os.environ if environ is None else environ
    # `accelerate launch` sets this for a config file with a parallelism_config section; Accelerator() would
    # then build its own ParallelismConfig and mesh, which it refuses on CPU and which would duplicate ours.
    env.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    # With this on, from_pretrained loads real weights on local rank 0 only and expects accelerate's FSDP
    # wrapping to broadcast them; nd_parallel loads the checkpoint on every rank instead.
    if env.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "").lower() in ("1", "true"):
        env["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    # accelerate's multi-process launcher never sets it (even with use_cpu: true); without it a CPU-only
    # Accelerator() ignores the other ranks.
    if int(env.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"


def _progress(accelerator, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not accelerator.is_main_process, dynamic_ncols=True)


def _demo(accelerator, plugin, job, samples, bar):
    from nd_parallel.parity import Recipe, train_layout

    def progress(step, loss):
        bar.set_postfix(loss=f"{loss:.4f}")
        bar.update()

    result = train_layout(accelerator, plugin, job["model_dir"], samples, Recipe(**job["recipe"]), progress)
    return result.losses, result.norms, result.state, result.optimizer


def _train(accelerator, plugin, job, samples, bar):
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    t = job["train"]
    set_seed(t["seed"])
    model = plugin.from_pretrained(t["base_model"], dtype=torch.float32)  # fp32: no mixed precision yet
    optimizer = torch.optim.AdamW(model.parameters(), lr=t["learning_rate"], weight_decay=t["weight_decay"])
    scheduler = get_scheduler(t["lr_scheduler"], optimizer, num_warmup_steps=t["warmup_steps"],
                              num_training_steps=t["max_steps"])
    loader = DataLoader(samples, batch_size=t["micro_batch_size"], drop_last=True, collate_fn=collate)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if accelerator.is_main_process:
        os.makedirs(t["output_dir"], exist_ok=True)
    log_file = os.path.join(t["output_dir"], "train_log.jsonl")
    with open(log_file, "w", encoding="utf-8") if accelerator.is_main_process else contextlib.nullcontext() as log:

        def on_step(step, loss, norm):
            bar.set_postfix(loss=f"{loss:.4f}")
            bar.update()
            if log is not None:
                lr = scheduler.get_last_lr()[0]
                bar.write(f"step {step + 1}/{t['max_steps']}  loss {loss:.4f}  grad_norm {norm:.4f}  lr {lr:.3g}")
                log.write(json.dumps({"step": step + 1, "loss": loss, "grad_norm": norm, "lr": lr}) + "\n")
                log.flush()

        losses, norms = train_steps(accelerator, model, optimizer, scheduler, loader, steps=t["max_steps"],
                                    accumulation=t["gradient_accumulation_steps"], max_norm=t["max_grad_norm"],
                                    on_step=on_step)
    save_hf(accelerator, model, t["output_dir"], tokenizer_dir=t["base_model"])
    return losses, norms, {}, optimizer


def mixed_precision(bf16) -> str:
    """Accelerate's mixed_precision for the YAML's ``bf16``: "auto" is bf16 only on GPUs that support it."""
    if bf16 == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    return "bf16" if bf16 else "no"


def run_rank(job: dict) -> dict | None:
    """Train one job on this rank; rank 0 returns (and writes to job["results"]) every rank's results."""
    import torch.distributed as dist
    from accelerate import Accelerator

    from nd_parallel import NDParallelPlugin

    adopt_launcher_env()
    if job.get("quiet"):  # the demo's output is its table: hide library warnings meant for developers
        warnings.filterwarnings("ignore")
        logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    accelerator = Accelerator(mixed_precision=mixed_precision(job.get("train", {}).get("bf16", False)))
    plugin = NDParallelPlugin(ParallelismConfig(**job["layout"])).attach(accelerator)
    samples = job["samples"] if isinstance(job["samples"], list) else torch.load(job["samples"], weights_only=True)
    with _progress(accelerator, job["steps"], job["name"]) as bar:
        losses, norms, state, optimizer = (_demo if job["kind"] == "demo" else _train)(
            accelerator, plugin, job, samples, bar)
    mine = {"losses": losses, "bytes": local_state_bytes(optimizer), "device": str(accelerator.device)}
    ranks = [mine]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    accelerator.end_training()  # destroys the process group; rank 0 may go on to the single-process reference
    if not accelerator.is_main_process:
        return None
    results = {"ranks": ranks, "losses": losses, "norms": norms, "state": state,
               "layout": plugin.config.describe()}
    if job.get("results"):
        torch.save(results, job["results"])
    return results


if __name__ == "__main__":  # a launched rank: python nd_parallel/train.py JOB.json
    run_rank(json.loads(Path(sys.argv[1]).read_text()))
