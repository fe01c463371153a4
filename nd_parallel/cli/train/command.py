"""`nd-parallel train CONFIG.yaml`: the parent's side. Everything that can fail (layout, YAML, model directory,
tokenized data) is done here before any rank starts; then the ranks run rank.py and rank 0's results become the
table. Run under an outer launcher, every rank does this work itself and rank 0 prints the table."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from ..ranks import main_rank, nodes_from_args, resolve_train_layout, run_job
from ..report import checkpoint_numel, loss_lines, memory_lines, table, unsharded_bytes
from .config import load_train_config
from .job import build_job


def cmd_train(args) -> int:
    cfg = load_train_config(args.config)
    nodes = nodes_from_args(args)
    config, nproc, device = resolve_train_layout(cfg, args.config, args.nproc, args.cpu, nodes.nnodes if nodes else 1)
    if cfg.unused and main_rank():
        print(f"nd-parallel train: accepted, not used: {', '.join(cfg.unused)}")
    with tempfile.TemporaryDirectory(prefix="nd-parallel-train-") as tmp:
        tmp = Path(tmp)
        # Under an outer launcher every rank prepares the same data (deterministic); the cache then serves it.
        job, prepared = build_job(args.config, cfg, config, str(tmp), quiet=not args.verbose)
        for note in cfg.notes if main_rank() else []:  # after build_job, which may add one
            print(f"nd-parallel train: {note}")
        if main_rank():
            rows = (f"rows of <= {cfg.sequence_len} tokens" if not cfg.processor_type
                    else "conversations, processed on each rank")
            print(f"nd-parallel train: {prepared.train_rows} training / {prepared.eval_rows} evaluation {rows} "
                  f"({prepared.tokenizer_how}{', cached' if prepared.cached else ''}) on "
                  f"{config.describe()}")
        start = time.perf_counter()
        results = run_job(job, nproc, device, tmp, args.timeout, args.max_restarts, nodes)
    if results is None:
        return 0
    saved = sorted(p.name for p in Path(cfg.output_dir).iterdir())
    unsharded = unsharded_bytes(checkpoint_numel(cfg.base_model)) if cfg.adapter is None else 0
    rows = [("layout", f"{results['layout']}, {nproc} {results['ranks'][0]['device'].split(':')[0].upper()} ranks"),
            ("data", prepared.sources),
            (f"loss per step ({len(results['losses'])})", loss_lines(results["losses"])),
            *([("eval loss", " ".join(f"{x:.4f}" for x in results["eval_losses"]))] if results["eval_losses"] else []),
            (f"{'adapter' if cfg.adapter else 'params'} + AdamW per rank", memory_lines(results["ranks"], unsharded)),
            ("saved", f"{cfg.output_dir}: {', '.join(saved)}"),
            *([("not used", ", ".join(cfg.unused))] if cfg.unused else []),
            ("time", f"{time.perf_counter() - start:.1f} s")]
    print(table(f"nd-parallel train: {args.config}", rows))
    return 0
