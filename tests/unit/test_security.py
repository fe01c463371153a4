"""The security promises of the README, checked on the source: no unpickling of weights, no remote code."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "nd_parallel"


def _calls(name: str):
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == name:
                yield path, node


def test_every_torch_load_is_weights_only():
    unsafe = [f"{p.name}:{n.lineno}" for p, n in _calls("torch.load")
              if not any(k.arg == "weights_only" and ast.unparse(k.value) == "True" for k in n.keywords)]
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"


def test_remote_code_is_never_switched_on_by_us():
    hits = [f"{p.name}:{n.lineno}" for name in ("AutoModelForCausalLM.from_pretrained", "AutoConfig.from_pretrained",
                                                "AutoTokenizer.from_pretrained")
            for p, n in _calls(name) if any(k.arg == "trust_remote_code" and ast.unparse(k.value) == "True"
                                            for k in n.keywords)]
    assert not hits, hits


def test_no_pickle_load_outside_the_restricted_unpickler():
    loads = [f"{p.name}:{n.lineno}" for name in ("pickle.load", "pickle.loads") for p, n in _calls(name)]
    assert not loads, f"plain pickle loads: {loads}"
