"""`nd-parallel make-tiny` and `nd-parallel export`: one process each, no ranks started."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .report import human_bytes, table


def cmd_make_tiny(args) -> int:
    from nd_parallel.testing.models import make_text, save_tiny_model
    from nd_parallel.testing.tokenizer import train_tiny_tokenizer

    root = Path(args.directory)
    model = save_tiny_model(args.family, root / "model", seed=args.seed)
    lines = make_text(args.lines, seed=args.seed)
    train_tiny_tokenizer(lines).save_pretrained(model)  # a BPE under the tiny vocabulary, with a chat template
    (root / "data.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines), encoding="utf-8")
    chats = [{"conversations": [{"from": "human", "value": a}, {"from": "gpt", "value": b}]}
             for a, b in zip(lines[::2], lines[1::2])]
    (root / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
    alpaca = [{"instruction": a, "input": "", "output": b} for a, b in zip(lines[::2], lines[1::2])]
    (root / "alpaca.json").write_text(json.dumps(alpaca), encoding="utf-8")
    print(f"wrote a tiny {args.family} checkpoint with a tiny BPE tokenizer (ChatML template) to {model}\n"
          f"and {args.lines} lines of text to {root / 'data.txt'} and {root / 'data.jsonl'}, as conversations to "
          f"{root / 'chat.jsonl'} and as alpaca records to {root / 'alpaca.json'}")
    return 0


def cmd_export(args) -> int:
    """HF safetensors from a save_state checkpoint, offline: one process, one tensor in memory at a time."""
    from nd_parallel.checkpoint import CheckpointError, export_checkpoint

    start = time.perf_counter()
    try:
        summary = export_checkpoint(args.checkpoint, args.output, max_shard_size=args.max_shard_size)
    except CheckpointError as err:
        print(f"nd-parallel export: error: {err}", file=sys.stderr)
        return 2
    rows = [("model", f"{summary['model_class']} after {summary['step']} optimizer steps"),
            ("tensors", f"{summary['tensors']} ({human_bytes(summary['bytes'])})"),
            ("files", summary["files"]), ("time", f"{time.perf_counter() - start:.1f} s"),
            ("load with", f"AutoModelForCausalLM.from_pretrained('{args.output}')")]
    print(table(f"nd-parallel export: {args.checkpoint} -> {args.output}", rows))
    return 0
