"""How many of Axolotl's own example YAMLs pass `nd-parallel train`'s config stage, why the others stop, and which
keys/values they use that our test YAMLs (tests/axolotl_configs/) do not.

    python benchmarks/axolotl_examples.py --git /path/to/axolotl.git        # a bare clone (reads HEAD:examples/)
    python benchmarks/axolotl_examples.py --dir /path/to/axolotl/examples    # or a checkout's folder

The config stage is `load_train_config` (nd_parallel/cli/train/config.py): every key, value, fsdp/deepspeed setting
and datasets entry is read and checked; no model or data file is opened, so hub names in base_model and datasets
are read as they are. Each file is read as written (nothing localized). Prints the count, the refusal reasons by
how many files they stop, and the coverage lists.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Keys whose value is a choice (so each value used is a case to cover), as opposed to sizes, paths and names.
CHOICE_KEYS = {"attn_implementation", "chat_template", "optimizer", "lr_scheduler", "adapter", "bf16", "fp16", "tf32",
               "gradient_checkpointing", "rl", "model_type", "tokenizer_type", "save_strategy", "eval_strategy",
               "sample_packing", "pad_to_sequence_len", "train_on_inputs", "load_in_4bit", "load_in_8bit",
               "lora_target_linear", "flash_attention", "fsdp_version", "evals_per_epoch", "strict"}
DATASET_CHOICES = {"type", "train_on_eos", "drop_system_message", "ds_type"}


def example_files(args) -> dict[str, str]:
    if args.git:
        names = subprocess.check_output(["git", "-C", args.git, "ls-tree", "-r", "--name-only", "HEAD", "examples"],
                                        text=True).split()
        return {n: subprocess.check_output(["git", "-C", args.git, "show", f"HEAD:{n}"], text=True)
                for n in names if n.endswith((".yml", ".yaml"))}
    root = Path(args.dir)
    return {str(p.relative_to(root.parent)): p.read_text() for p in sorted(root.rglob("*.y*ml"))}


def uses(cfg: dict) -> set[tuple[str, str]]:
    """(key, value-or-"") pairs a YAML uses: values only for choice keys, list items for fsdp/plugins."""
    out = set()
    for key, value in cfg.items():
        out.add((key, ""))
        if key in CHOICE_KEYS and isinstance(value, (str, bool, int, float)):
            out.add((key, repr(value)))
        elif key in ("fsdp", "plugins", "eot_tokens") and isinstance(value, list):
            out.update((key, repr(v)) for v in value)
        elif key == "deepspeed" and isinstance(value, str):
            out.add((key, os.path.basename(value)))
        elif key in ("fsdp_config", "gradient_checkpointing_kwargs") and isinstance(value, dict):
            out.update((f"{key}.{k}", repr(v) if isinstance(v, (bool, str)) else "") for k, v in value.items())
    for entry in cfg.get("datasets") or []:
        if isinstance(entry, dict):
            for key, value in entry.items():
                out.add((f"datasets.{key}", repr(value) if key in DATASET_CHOICES else ""))
                if key == "split" and isinstance(value, str):
                    out.add(("datasets.split", re.sub(r"\d+", "N", value)))
    return out


def stage(text: str, tmp: Path) -> str | None:
    """None when the file passes the config stage, else the refusal message."""
    from nd_parallel.cli.train.config import load_train_config
    from nd_parallel.config import ConfigError

    path = tmp / "example.yml"
    path.write_text(text)
    try:
        load_train_config(path, environ={})
    except ConfigError as err:
        return str(err)
    return None


# Keys another change owns (8-bit LoRA: load_in_8bit): dropped, to count the files that pass once that change is in.
OTHER_CHANGE = ("load_in_8bit",)


def without_other_change(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in OTHER_CHANGE}


def reasons(message: str) -> list[str]:
    """The refused keys of one message (the text before the first '=' or ':' of each line)."""
    lines = [line.strip()[2:] for line in message.splitlines()[1:] if line.strip().startswith("- ")] or [message]
    lines = [re.sub(r"^in \S+: ", "", line) for line in lines]  # ParallelismConfig's checks name the file first
    return sorted({re.split(r"[=:]| is | are |' in ", line.removeprefix("unknown key "), maxsplit=1)[0].strip("' ")
                   for line in lines})


def main() -> None:
    import yaml

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--git", help="a (bare) git clone of axolotl-ai-cloud/axolotl")
    src.add_argument("--dir", help="an examples/ folder")
    ap.add_argument("--ours", default=str(Path(__file__).resolve().parent.parent / "tests" / "axolotl_configs"))
    ap.add_argument("--show", type=int, default=30, help="refusal reasons to list")
    args = ap.parse_args()
    files = example_files(args)
    passed, stopped, theirs, later = [], collections.Counter(), set(), []
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in files.items():
            try:
                cfg = yaml.safe_load(text)
            except yaml.YAMLError:
                continue
            if isinstance(cfg, dict):
                theirs |= uses(cfg)
            message = stage(text, Path(tmp))
            if message is None:
                passed.append(name)
            else:
                stopped.update(reasons(message))
                if isinstance(cfg, dict) and stage(yaml.safe_dump(without_other_change(cfg)), Path(tmp)) is None:
                    later.append(name)
    ours = set()
    for path in sorted(Path(args.ours).glob("*.yml")):
        ours |= uses(yaml.safe_load(path.read_text()))
    print(f"{len(passed)} of {len(files)} Axolotl example YAMLs pass nd-parallel train's config stage")
    print(f"{len(passed) + len(later)} of {len(files)} pass once {', '.join(OTHER_CHANGE)} is accepted")
    print(f"\nrefused keys/values, by the number of files they stop (top {args.show}):")
    for reason, n in stopped.most_common(args.show):
        print(f"  {n:4d}  {reason}")
    missing = sorted(theirs - ours)
    print(f"\ncoverage: our {len(list(Path(args.ours).glob('*.yml')))} test YAMLs use {len(theirs & ours)} of the "
          f"{len(theirs)} keys/values the examples use; not used by ours ({len(missing)}):")
    for key, value in missing:
        print(f"  {key} {value}".rstrip())


if __name__ == "__main__":
    main()
