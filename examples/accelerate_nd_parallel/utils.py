"""What the two scripts share: a small packed text data set, the collate, a FLOPs estimate and a throughput tracker.

Our own counterpart of the ``utils.py`` beside Accelerate's ND-parallel examples, with the same functions, except that
the text is made locally (``nd_parallel.testing.models.make_text``) and read as bytes (the tiny models have 256 ids),
so nothing is downloaded.
"""

import time

import torch
from datasets import Dataset

from nd_parallel.testing.models import encode, make_text, save_tiny_model


def tiny_model(path: str) -> str:
    """A seeded tiny Llama saved at ``path`` (the same weights on every rank and in every process)."""
    save_tiny_model("llama", path)
    return path


def get_dataset(seq_len: int, n_sequences: int = 64) -> Dataset:
    """Documents packed back to back into rows of ``seq_len`` tokens, labels already shifted by one."""
    tokens = [t for line in make_text(8 * n_sequences) for t in encode(line + " ")]
    rows = {"input_ids": [], "shift_labels": [], "position_ids": [], "labels": []}
    for i in range(min(n_sequences, len(tokens) // (seq_len + 1))):
        window = tokens[i * (seq_len + 1):(i + 1) * (seq_len + 1)]
        rows["input_ids"].append(window[:-1])
        rows["shift_labels"].append(window[1:])
        rows["position_ids"].append(list(range(seq_len)))
        rows["labels"].append(window[1:])
    return Dataset.from_dict(rows).shuffle(seed=42)


def create_collate_fn():
    """input_ids, shift_labels and labels (both the shifted targets) as tensors."""

    def collate_fn(batch):
        input_ids = torch.tensor([item["input_ids"] for item in batch], dtype=torch.long)
        shift_labels = torch.tensor([item["shift_labels"] for item in batch], dtype=torch.long)
        return {"input_ids": input_ids, "shift_labels": shift_labels, "labels": shift_labels}

    return collate_fn


def get_model_flops_per_token(model, seq_len: int) -> float:
    """Matmul FLOPs per token (forward and backward) of a decoder-only model, embeddings and norms ignored."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    mlp = 18 * cfg.hidden_size * cfg.intermediate_size
    attn = 12 * head_dim * (cfg.num_attention_heads + cfg.num_key_value_heads)
    attn_dot = 12 * cfg.num_attention_heads * head_dim * seq_len
    return (mlp + attn + attn_dot) * cfg.num_hidden_layers


class PerformanceTracker:
    """Tokens per second and TFLOPS after ``warmup_steps`` steps."""

    def __init__(self, warmup_steps: int = 10):
        self.warmup_steps, self.step_count, self.start, self.tokens = warmup_steps, 0, None, 0

    def step(self, batch_tokens: float, model_flops_per_token: float | None = None) -> dict:
        self.step_count += 1
        if self.step_count == self.warmup_steps:
            self.start, self.tokens = time.perf_counter(), 0
            return {"warmup_completed": True}
        if self.start is None:
            return {}
        self.tokens += batch_tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        out = {"tokens_per_second": self.tokens / elapsed,
               "steps_per_second": (self.step_count - self.warmup_steps) / elapsed}
        if model_flops_per_token is not None:
            out["tflops_per_device"] = model_flops_per_token * self.tokens / (elapsed * 1e12)
        return out

    @staticmethod
    def get_print_message(metrics: dict) -> str:
        return (f" | steps/s {metrics['steps_per_second']:.2f} | tokens/s {metrics['tokens_per_second']:.2f}"
                f" | TFLOPS {metrics.get('tflops_per_device', 0.0):.4f}")
