"""Shared by the `nd-parallel train` tests: a tiny model with a tiny local tokenizer, the three record formats on
disk, YAML writing, and the parity runner (several YAMLs per launch; one process for the references)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from nd_parallel.testing.models import make_text, save_tiny_model


def write_model_and_data(root: Path, n: int = 48) -> dict:
    """model/ (tiny Llama + tiny BPE with a ChatML template), text.jsonl, alpaca.json, chat.jsonl."""
    from nd_parallel.testing.tokenizer import train_tiny_tokenizer

    lines = make_text(4 * n, seed=7)
    model = save_tiny_model("llama", root / "model", seed=1)
    train_tiny_tokenizer(lines).save_pretrained(model)
    (root / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[:n]))
    alpaca = [{"instruction": lines[i], "input": lines[i + 1] if i % 2 else "", "output": lines[i + 2]}
              for i in range(0, 3 * n, 3)]
    (root / "alpaca.json").write_text(json.dumps(alpaca))
    chats = [{"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": lines[i]},
                                {"from": "gpt", "value": lines[i + 1]}, {"from": "human", "value": lines[i + 2]},
                                {"from": "gpt", "value": lines[i + 3]}]} for i in range(0, 4 * n - 3, 4)]
    (root / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    return {"model": str(model), "text": str(root / "text.jsonl"), "alpaca": str(root / "alpaca.json"),
            "chat": str(root / "chat.jsonl")}


def chat_entry(path: str) -> dict:
    """A ShareGPT-shaped file read with type: chat_template (Axolotl's mapping keys)."""
    return {"path": path, "type": "chat_template", "field_messages": "conversations",
            "message_property_mappings": {"role": "from", "content": "value"}}


def write_yaml(path: Path, cfg: dict) -> Path:
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    return path


def layout_yamls(root: Path, shared: dict, layouts: dict, dps=(1, 2)) -> tuple[list[Path], list[Path]]:
    """(one YAML per layout, name -> (its sizes, its dp ranks); one-process references ``ref<dp>`` on the same
    global batch: micro_batch_size x dp), each writing its run to root / its name."""
    parallel = [write_yaml(root / f"{name}.yaml", {**shared, **sizes, "output_dir": str(root / name)})
                for name, (sizes, _) in layouts.items()]
    refs = [write_yaml(root / f"ref{dp}.yaml", {**shared, "micro_batch_size": shared["micro_batch_size"] * dp,
                                                "output_dir": str(root / f"ref{dp}")}) for dp in dps]
    return parallel, refs


def run_parity(root: Path, shared: dict, layouts: dict, dps=(1, 2), variants: dict | None = None) -> Path:
    """The layouts' YAMLs and their one-process references (``layout_yamls``), plus one one-process run of ``shared``
    changed by each of ``variants`` ({name: {key: value, or None to drop the key}}: the same run without the feature
    under test), all run: references and variants in one process, the layouts in one launch of 2 ranks."""
    parallel, refs = layout_yamls(root, shared, layouts, dps)
    for name, change in (variants or {}).items():
        cfg = {k: v for k, v in {**shared, **change}.items() if v is not None}
        refs.append(write_yaml(root / f"{name}.yaml", {**cfg, "output_dir": str(root / name)}))
    run_jobs(jobs_for(refs, root, 1), root, 1)
    run_jobs(jobs_for(parallel, root, 2), root, 2)
    return root


def run_rows(root: Path, rows: dict, layouts: dict, ref: dict, off: dict | None = None,
             only: dict | None = None) -> Path:
    """Several rows in one launch: for each row (name -> its whole YAML mapping) one YAML per layout (name -> sizes,
    run as ``<row>_<layout>``; ``only`` maps a row to the layout names it runs under, default all), its one-process
    reference ``<row>_ref`` (the row changed by ``ref``, e.g. the global batch as micro_batch_size) and, where
    ``off`` names the keys that turn the row's feature off, ``<row>_plain`` (the reference without them).
    References and plain runs in one process, the layouts in one launch of 2 ranks."""
    refs, parallel = [], []
    for row, shared in rows.items():
        parallel += [write_yaml(root / f"{row}_{name}.yaml", {**shared, **sizes, "output_dir": str(root / f"{row}_"
                                                                                                   f"{name}")})
                     for name, sizes in layouts.items() if name in (only or {}).get(row, layouts)]
        refs.append(write_yaml(root / f"{row}_ref.yaml", {**shared, **ref, "output_dir": str(root / f"{row}_ref")}))
        if off and row in off:
            plain = {k: v for k, v in {**shared, **ref, **off[row]}.items() if v is not None}
            refs.append(write_yaml(root / f"{row}_plain.yaml", {**plain, "output_dir": str(root / f"{row}_plain")}))
    run_jobs(jobs_for(refs, root, 1), root, 1)
    run_jobs(jobs_for(parallel, root, 2), root, 2)
    return root


def run_groups(root: Path, rows: dict, groups: dict, off: dict | None = None) -> Path:
    """``run_rows`` once per group of layouts that share a one-process reference: ``groups`` maps a name to
    (layouts, the reference's changes), e.g. dp layouts whose reference takes the global batch, and tp / cp / pp ones
    whose reference is the row itself; a group's runs are under ``root / <name>``."""
    for name, (layouts, ref) in groups.items():
        (root / name).mkdir()
        run_rows(root / name, rows, layouts, ref, off)
    return root


def jobs_for(paths: list[Path], workdir: Path, nproc: int) -> list:
    """The ranks' jobs, built exactly as `nd-parallel train` builds them (job.build_job)."""
    from nd_parallel.cli.ranks import resolve_train_layout
    from nd_parallel.cli.train.config import load_train_config
    from nd_parallel.cli.train.job import build_job

    jobs = []
    for path in paths:
        cfg = load_train_config(path)
        layout, ranks, _ = resolve_train_layout(cfg, path, nproc, cpu=True)  # as `--nproc N`
        assert ranks == nproc, (path, ranks)
        job, _ = build_job(path, cfg, layout, str(workdir / path.stem))
        jobs.append(job)
    return jobs


def run_jobs(jobs: list, workdir: Path, nproc: int, timeout: float = 900) -> None:
    """All jobs in one launch of nproc ranks (nproc=1: one plain process, no process group)."""
    from nd_parallel.cli.train import rank as train
    from nd_parallel.cli.train.job import write_jobs
    from nd_parallel.fault.launch import launch

    spec = workdir / f"jobs_{nproc}.json"
    write_jobs(spec, jobs)
    env = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    if nproc > 1:
        launch(train.__name__, nproc, [str(spec)], timeout=timeout, env=env, capture=True)
    else:
        subprocess.run([sys.executable, "-m", train.__name__, str(spec)], check=True, capture_output=True, timeout=timeout,
                       env={**os.environ, **env, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"})


def logged(output_dir: str | Path, name: str = "train_log.jsonl") -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / name).read_text().splitlines()]


def saved_tensors(output_dir: str | Path) -> dict[str, torch.Tensor]:
    """The final model's or adapter's tensors, as written to output_dir."""
    from safetensors.torch import load_file

    out = {}
    for file in sorted(Path(output_dir).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def compare_runs(got: Path, ref: Path, *, rtol: float, atol: float, label: str, first_rtol: float | None = None):
    """Every logged loss of ``got`` against ``ref`` (rtol; the first step at ``first_rtol`` when given) and every
    saved tensor (atol); prints the measured gaps; returns (losses, saved tensors) of ``got``."""
    losses, ref_losses = [r["loss"] for r in logged(got)], [r["loss"] for r in logged(ref)]
    assert len(losses) == len(ref_losses) and losses, (losses, ref_losses)
    if first_rtol is not None:
        torch.testing.assert_close(torch.tensor(losses[:1]), torch.tensor(ref_losses[:1]), rtol=first_rtol, atol=0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0)
    tensors, ref_tensors = saved_tensors(got), saved_tensors(ref)
    assert set(tensors) == set(ref_tensors) and tensors
    worst = max((tensors[k] - v).abs().max().item() for k, v in ref_tensors.items())
    print(f"{label}: losses {losses} max loss rel diff "
          f"{max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)):.2e} saved-tensor diff {worst:.2e}")
    assert worst <= atol, (label, worst)
    return losses, tensors


def marker_tokens() -> list[str]:
    """Every turn marker the named templates write and the YAMLs' special tokens, as single tokens."""
    from nd_parallel.cli.train.data.templates import FORMATS

    text = " ".join(f"{f.header} {f.footer} {' '.join(f.headers.values())} {' '.join(f.footers.values())} "
                    f"{' '.join(f.rename.values())}" for f in FORMATS.values())
    found = set(re.findall(r"<[^<>\s]+>|\[/?[A-Z_]+\]", text)) | {"<think>", "</think>", "<|end_of_text|>",
                                                                  "<|endoftext|>", "<|finetune_right_pad|>"}
    return sorted(found - {"<s>", "</s>", "<pad>", "<unk>"})
