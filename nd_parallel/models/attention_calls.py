"""What a layer's forward hands transformers' attention function, read from its source: the keywords it passes
(context parallelism refuses inputs its kernels do not apply) and a mask it computes itself (refused under CP and
TP: the ring builds masks from global positions, and TP's heads are a shard)."""

from __future__ import annotations

import ast
import functools

from .source import forward_tree


def _attention_calls(tree: ast.FunctionDef) -> list[ast.Call]:
    """The calls of transformers' attention function in a parsed forward (the callable it takes from
    ``ALL_ATTENTION_FUNCTIONS``, by convention ``attention_interface``)."""
    names = {"attention_interface"}
    for node in ast.walk(tree):  # whatever name the callable is bound to
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and "ALL_ATTENTION_FUNCTIONS" in ast.dump(node.value or node):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in names]


def attention_keywords(module_type: type) -> frozenset[str]:
    """The keyword arguments ``module_type.forward`` itself passes to transformers' attention function, read from
    its source."""
    tree = forward_tree(module_type)
    if tree is None:
        return frozenset()
    return frozenset(k.arg for call in _attention_calls(tree) for k in call.keywords if k.arg is not None)


@functools.lru_cache(maxsize=None)
def computed_attention_masks(module_type: type) -> tuple[str, ...]:
    """The masks ``module_type.forward`` computes itself and passes to the attention function (Doge's dynamic mask
    from the values), as source text; a mask taken from the forward's own arguments, or None, is not listed."""
    tree = forward_tree(module_type)
    if tree is None:
        return ()
    given = {a.arg for a in (*tree.args.args, *tree.args.kwonlyargs)}
    found = []
    for call in _attention_calls(tree):
        masks = [k.value for k in call.keywords if k.arg == "attention_mask"] + call.args[4:5]
        found += [ast.unparse(m) for m in masks
                  if not (isinstance(m, ast.Constant) and m.value is None)
                  and not (isinstance(m, ast.Name) and m.id in given)]
    return tuple(found)
