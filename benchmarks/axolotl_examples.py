"""How many of Axolotl's own example YAMLs pass `nd-parallel train`'s config stage, why the others stop, and which
keys/values they use that our test YAMLs (tests/axolotl_configs/) do not.

    python benchmarks/axolotl_examples.py --git /path/to/axolotl.git        # a bare clone (reads HEAD:examples/)
    python benchmarks/axolotl_examples.py --dir /path/to/axolotl/examples    # or a checkout's folder

The config stage is `load_train_config` (nd_parallel/cli/train/config.py): every key, value, fsdp/deepspeed setting
and datasets entry is read and checked; no model or data file is opened, so hub names in base_model and datasets
are read as they are. Each file is read as written (nothing localized). Prints the count, the refusal reasons by
how many files they stop, and the keys/values our test YAMLs miss, split into (a) those the config stage passes
(each added alone to a minimal YAML) and (b) those it refuses, with the message.

    python benchmarks/axolotl_examples.py --git ... --axolotl-python .venv-axolotl/bin/python

also runs Axolotl's own validation (`axolotl.utils.config.validate_config`, in its venv: .ci/axolotl-venv) on every
file and says which of the files refused here Axolotl refuses too, and which files Axolotl refuses that pass here.
An ImportError there (a CUDA-only package Axolotl imports while validating, e.g. ring-flash-attn) is not counted as
a refusal.
"""

from __future__ import annotations

import argparse
import collections
import json
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
    return set(patches(cfg))


def patches(cfg: dict) -> dict[tuple[str, str], tuple[str, str, object]]:
    """uses(cfg), each with how to add it to another YAML: (where, key, value), where is "" (a top-level key),
    "list" (one item of a list key), a dict key (fsdp_config, gradient_checkpointing_kwargs) or "datasets"."""
    out = {}
    for key, value in cfg.items():
        out[(key, "")] = ("", key, value)
        if key in CHOICE_KEYS and isinstance(value, (str, bool, int, float)):
            out[(key, repr(value))] = ("", key, value)
        elif key in ("fsdp", "plugins", "eot_tokens") and isinstance(value, list):
            out.update({(key, repr(v)): ("list", key, v) for v in value})
        elif key == "deepspeed" and isinstance(value, str):
            out[(key, os.path.basename(value))] = ("", key, value)
        elif key in ("fsdp_config", "gradient_checkpointing_kwargs") and isinstance(value, dict):
            out.update({(f"{key}.{k}", repr(v) if isinstance(v, (bool, str)) else ""): (key, k, v)
                        for k, v in value.items()})
    for entry in cfg.get("datasets") or []:
        if isinstance(entry, dict):
            for key, value in entry.items():
                out[(f"datasets.{key}", repr(value) if key in DATASET_CHOICES else "")] = ("datasets", key, value)
                if key == "split" and isinstance(value, str):
                    out[("datasets.split", re.sub(r"\d+", "N", value))] = ("datasets", key, value)
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


def with_user_modules(text: str, message: str, tmp: Path) -> bool:
    """Whether a refused file's only refusals are user modules it names that Axolotl's repository does not ship
    either (GRPO's reward functions and prompt transform, module.function), and it passes with stand-ins of them
    (one function of the names given, taking (prompts, completions, **kwargs)) in a folder beside it."""
    lines = [line.strip()[2:] for line in message.splitlines()[1:] if line.strip().startswith("- ")]
    names = [re.search(r"='(\w+)\.(\w+)' cannot be imported from .*No module named '\1'", line) for line in lines]
    if not lines or not all(names):
        return False
    folder = tmp / "with_user_modules"
    folder.mkdir(exist_ok=True)
    modules = collections.defaultdict(set)
    for found in names:
        modules[found.group(1)].add(found.group(2))
    for module, functions in modules.items():
        (folder / f"{module}.py").write_text("".join(f"def {f}(prompts, completions, **kwargs):\n    return []\n"
                                                     for f in sorted(functions)))
    return stage(text, folder) is None


MINIMAL = {"base_model": "./m", "datasets": [{"path": "./d.jsonl", "type": "chat_template"}]}


def split_missing(missing, patch_of, users, passed, tmp: Path) -> tuple[list, dict]:
    """The keys/values our YAMLs miss, split into (a) those the config stage accepts and (b) those it refuses, with
    why. Each is added alone to a minimal YAML (MINIMAL), once per value the examples give it (a key passes when one
    of them does); one refused there still counts as accepted when an example file that uses it passes as a whole (a
    value that needs its companions: load_in_8bit with adapter: lora)."""
    import copy

    import yaml

    accepted, refused = [], {}
    for pair in missing:
        messages = []
        for where, key, value in patch_of[pair]:
            cfg = copy.deepcopy(MINIMAL)
            if where == "":
                cfg[key] = value
            elif where == "list":
                cfg[key] = [value]
            elif where == "datasets":
                cfg["datasets"][0][key] = value
            else:
                cfg.setdefault(where, {})[key] = value
            messages.append(stage(yaml.safe_dump(cfg, sort_keys=False), tmp))
        if None in messages or any(name in passed for name in users[pair]):
            accepted.append(pair)
        else:
            lines = [line.strip()[2:] for line in messages[0].splitlines()[1:] if line.strip().startswith("- ")]
            refused[pair] = " | ".join(lines or [messages[0]])
    return accepted, refused


# Run in Axolotl's venv: validate each file given; print {path: None | "Error: message"} as JSON.
AXOLOTL_VALIDATE = """
import json, logging, sys, warnings, yaml
warnings.filterwarnings("ignore"); logging.disable(logging.CRITICAL)
from axolotl.utils.config import validate_config
from axolotl.utils.dict import DictDefault
out = {}
for path in sys.argv[1:]:
    try:  # an 8-GPU Hopper node, so that no file is refused for the machine this runs on
        validate_config(DictDefault(yaml.safe_load(open(path))), capabilities={"bf16": True, "fp8": True, "n_gpu": 8,
                        "compute_capability": "sm_90"}, env_capabilities={"torch_version": "2.13.0"})
        out[path] = None
    except ImportError:
        out[path] = None
    except Exception as err:
        out[path] = type(err).__name__ + ": " + " ".join(str(err).split())
print(json.dumps(out))
"""


def axolotl_refusals(python: str, files: dict[str, str], tmp: Path) -> dict[str, str]:
    """{example name: Axolotl's own refusal} for the files Axolotl's validation refuses."""
    paths = {}
    for i, (name, text) in enumerate(files.items()):
        paths[str(tmp / f"{i}.yml")] = name
        (tmp / f"{i}.yml").write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"AXOLOTL_DO_NOT_TRACK": "1"}
    out = subprocess.run([python, "-c", AXOLOTL_VALIDATE, *paths], capture_output=True, text=True, env=env, check=True)
    return {paths[p]: why for p, why in json.loads(out.stdout.strip().splitlines()[-1]).items() if why}


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
    ap.add_argument("--axolotl-python", help="the python of Axolotl's venv: compare with Axolotl's own validation")
    args = ap.parse_args()
    files = example_files(args)
    passed, stopped, refused, user_code = [], collections.Counter(), {}, []
    patch_of, users = collections.defaultdict(list), collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in files.items():
            try:
                cfg = yaml.safe_load(text)
            except yaml.YAMLError:
                continue
            if isinstance(cfg, dict):
                for pair, patch in patches(cfg).items():
                    if patch not in patch_of[pair]:
                        patch_of[pair].append(patch)
                    users[pair].append(name)
            message = stage(text, Path(tmp))
            if message is None:
                passed.append(name)
            else:
                stopped.update(reasons(message))
                refused[name] = reasons(message)
                if with_user_modules(text, message, Path(tmp)):
                    user_code.append(name)
    ours = set()
    for path in sorted(Path(args.ours).rglob("*.yml")):  # refused/: YAMLs refused for CUDA-only features
        ours |= uses(yaml.safe_load(path.read_text()))
    print(f"{len(passed)} of {len(files)} Axolotl example YAMLs pass nd-parallel train's config stage")
    if user_code:
        print(f"{len(user_code)} more pass once the user's own modules they name exist (Axolotl does not ship them "
              f"either): {', '.join(user_code)}")
    print(f"\nrefused keys/values, by the number of files they stop (top {args.show}):")
    for reason, n in stopped.most_common(args.show):
        print(f"  {n:4d}  {reason}")
    if args.axolotl_python:
        with tempfile.TemporaryDirectory() as tmp:
            theirs_refused = axolotl_refusals(args.axolotl_python, files, Path(tmp))
        both = sorted(set(theirs_refused) & set(refused))
        print(f"\nAxolotl's own validation refuses {len(theirs_refused)} of the {len(files)}; of the {len(refused)} "
              f"refused here, {len(both)} are refused by Axolotl too:")
        for name in both:
            print(f"  {name}: here {', '.join(refused[name])}; Axolotl: {theirs_refused[name][:160]}")
        ours_only = sorted(set(refused) - set(theirs_refused))
        print(f"refused here only ({len(ours_only)} of the {len(files) - len(theirs_refused)} Axolotl accepts):")
        for name in ours_only:
            print(f"  {name}: {', '.join(refused[name])}")
        print("refused by Axolotl, passed here:")
        for name in sorted(set(theirs_refused) - set(refused)):
            print(f"  {name}: Axolotl: {theirs_refused[name][:160]}")
    theirs = set(patch_of)
    missing = sorted(theirs - ours)
    with tempfile.TemporaryDirectory() as tmp:
        accepted, refused_pairs = split_missing(missing, patch_of, users, set(passed), Path(tmp))
    print(f"\ncoverage: our {len(list(Path(args.ours).rglob('*.yml')))} test YAMLs use {len(theirs & ours)} of the "
          f"{len(theirs)} keys/values the examples use; not used by ours: {len(missing)}, of which "
          f"(a) {len(accepted)} pass the config stage, (b) {len(refused_pairs)} are refused here")
    print(f"\n(a) passed by the config stage, used by no test YAML of ours ({len(accepted)}):")
    for key, value in accepted:
        print(f"  {key} {value}".rstrip())
    print(f"\n(b) refused by the config stage ({len(refused_pairs)}), with its message (cut):")
    for (key, value), why in refused_pairs.items():
        print(f"  {key} {value}".rstrip() + f"  -- {why[:110]}")


if __name__ == "__main__":
    main()
