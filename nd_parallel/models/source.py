"""A class's ``forward`` as a syntax tree: what nd_parallel reads from transformers' model sources (layer order,
return arity, attention calls) instead of keeping lists of family names."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap


@functools.lru_cache(maxsize=None)
def forward_tree(cls: type) -> ast.FunctionDef | None:
    """The parsed source of ``cls.forward`` (decorators unwrapped), or None where it cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))
        node = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
