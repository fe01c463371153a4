"""The package's shape, checked: layers import only downwards, no import cycles, small modules and functions.

The layers, bottom to top (docs/architecture.md):

    version < config < models < distributed < checkpoint < fault < planner < accelerate < plugins < testing < cli

A module may import its own layer and the layers below it. ``nd_parallel/__init__.py`` is the public API and may
import any layer. Every import counts, including those inside functions: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("version", "config", "models", "distributed", "checkpoint", "fault", "planner", "accelerate", "plugins",
          "testing", "cli")
# Deliberate upward imports, each with its reason. Keep this list short.
ALLOWED_UPWARD = {
    ("nd_parallel.config.parallelism", "nd_parallel.planner"):
        "ParallelismConfig.auto is the public front door to the planner (a lazy import inside it)",
    ("nd_parallel.config.parallelism", "nd_parallel.planner.auto"):
        "ParallelismConfig.auto is the public front door to the planner (a lazy import inside it)",
}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
LONG_FUNCTION_MARK = "# long function:"  # on the line above the def (or its decorators), followed by why


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for nd_parallel/ and plugins/ (installed as nd_parallel.plugins)."""
    found = {}
    for base, prefix in ((ROOT / "nd_parallel", ("nd_parallel",)), (ROOT / "plugins", ("nd_parallel", "plugins"))):
        for path in base.rglob("*.py"):
            parts = (*prefix, *path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> set[str]:
    """Every nd_parallel module ``name`` imports, anywhere in the file."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if _is_package(name) else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base]) if base else ".".join(parts)
            for alias in node.names:  # `from pkg import module` depends on the module itself
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {t for t in targets if t in MODULES and t != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return None if len(parts) == 1 else parts[1]  # None: the public API, nd_parallel/__init__.py


def test_every_module_is_in_a_layer():
    unknown = sorted(n for n in MODULES if _layer(n) is not None and _layer(n) not in LAYERS)
    assert not unknown, f"modules outside the layers {LAYERS}: {unknown}; put them in a layer's folder"


def test_layers_import_only_downwards():
    upward = []
    for name, targets in GRAPH.items():
        if _layer(name) is None:
            continue
        for target in targets:
            if _layer(target) is None:
                upward.append(f"{name} -> {target} (the public API: import the module that defines the name)")
            elif LAYERS.index(_layer(target)) > LAYERS.index(_layer(name)) and (name, target) not in ALLOWED_UPWARD:
                upward.append(f"{name} ({_layer(name)}) -> {target} ({_layer(target)})")
    assert not upward, "upward imports break the layering:\n  " + "\n  ".join(sorted(upward))


def test_core_never_imports_integrations():
    """The rule of docs/architecture.md: the core never imports accelerate/, cli/ or plugins/."""
    core = ("distributed", "models", "checkpoint", "fault", "planner", "config")
    bad = sorted(f"{n} -> {t}" for n, ts in GRAPH.items() for t in ts
                 if _layer(n) in core and _layer(t) in ("accelerate", "cli", "plugins"))
    assert not bad, "the core imports an integration:\n  " + "\n  ".join(bad)


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    cycles = _cycles()
    assert not cycles, "import cycles (lazy imports included):\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)


def test_the_checks_see_a_bad_import():
    """The walker itself: a planted upward import and a planted cycle are found."""
    saved = {k: set(v) for k, v in GRAPH.items()}
    try:
        GRAPH["nd_parallel.distributed.mesh"].add("nd_parallel.accelerate.plugin")
        with pytest.raises(AssertionError, match="mesh"):
            test_layers_import_only_downwards()
        GRAPH["nd_parallel.distributed.mesh"] = saved["nd_parallel.distributed.mesh"] | {"nd_parallel.distributed.fsdp"}
        GRAPH["nd_parallel.distributed.fsdp"] = saved["nd_parallel.distributed.fsdp"] | {"nd_parallel.distributed.mesh"}
        with pytest.raises(AssertionError, match="cycles"):
            test_no_import_cycles()
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


def _python_files() -> list[Path]:
    folders = ("nd_parallel", "plugins", "benchmarks", "tests", "examples")
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def test_modules_are_small():
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in _python_files()
           if (n := p.read_text().count("\n")) > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them):\n  " + "\n  ".join(big)


def test_functions_are_small_or_say_why():
    long = []
    for path in _python_files():
        lines = path.read_text().split("\n")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = node.end_lineno - node.lineno + 1
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            said = first >= 2 and lines[first - 2].strip().startswith(LONG_FUNCTION_MARK)
            if length > MAX_FUNCTION_LINES and not said:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines without a '{LONG_FUNCTION_MARK} <why>' comment "
                      "above them:\n  " + "\n  ".join(long))
