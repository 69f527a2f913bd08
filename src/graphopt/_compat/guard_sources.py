"""Guard sources read without evaluating them: for stored traces' identity checks
and for the value that failed a guard (`on_recompile`).

Dynamo names each guarded value by a Python expression over the frame's locals L and
its globals G (`G['torch'].cat`, `L['self']._modules['proj']`). A stored trace checks
some guards itself, in a later process, so it must find those values again, and a
recompile's explanation shows what a failed guard reads now. A walker over the
expression's syntax does both with a fixed set of steps, so neither a cache entry
nor a guard's text can run code.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import operator
from typing import Any, Callable

LOCALS, GLOBALS, ALIASES = range(3)   # the roots of a guard source, as `roots` orders them


@functools.lru_cache(maxsize=None)
def reader(name: str) -> tuple[int, Any, tuple[Callable, ...]] | None:
    """A guard's source (`G['torch'].nn`, `L['self']._modules['proj']`) as (root,
    key, steps): its value is `roots(L, G)[root][key]`, each step applied in
    turn. Read by a walker over its syntax tree, never evaluated: subscripts by a
    constant, attributes, a dict's i-th key or item and the lookups Dynamo writes
    as calls; None for any other."""
    try:
        return _walk(ast.parse(name, mode="eval").body)
    except (SyntaxError, ValueError, KeyError, ImportError):
        return None


def _walk(node: ast.expr) -> tuple[int, Any, tuple[Callable, ...]]:
    match node:
        case ast.Subscript(value=ast.Name(id="L" | "G" as root), slice=ast.Constant(value=key)):
            if root == "G" and isinstance(key, str) and key.startswith(("__import_", "__builtins_dict__")):
                _ALIASES.setdefault(key, importlib.import_module(key[len("__import_"):].replace("_dot_", "."))
                                    if key.startswith("__import_") else builtins.__dict__)
                return ALIASES, key, ()
            return (LOCALS if root == "L" else GLOBALS), key, ()
        case ast.Subscript() if (nth := _nth_key(node)) is not None:
            inner, step = nth[0], functools.partial(_key_at, nth[1])
        case ast.Call(func=ast.Attribute(value=ast.Name(id="dict"), attr="__getitem__"), args=[inner, keyed],
                      keywords=[]) if (nth := _nth_key(keyed)) is not None and ast.dump(nth[0]) == ast.dump(inner):
            step = functools.partial(_value_at, nth[1])
        case ast.Subscript(value=inner, slice=ast.Constant(value=key)):
            step = operator.itemgetter(key)
        case ast.Attribute(value=inner, attr=attr):
            step = operator.attrgetter(attr)
        case ast.Call(func=ast.Name(id="type" | "dict" as convert), args=[inner], keywords=[]):
            step = type if convert == "type" else dict
        case ast.Call(func=func, args=[inner, ast.Constant(value=key)], keywords=[]):
            lookup = _LOOKUPS[ast.unparse(func)]

            def step(value: Any) -> Any:
                return lookup(value, key)
        case _:
            raise ValueError(f"not a source graphopt reads: {ast.unparse(node)}")
    root, first, steps = _walk(inner)
    return root, first, (*steps, step)


def _nth_key(node: ast.expr) -> tuple[ast.expr, int] | None:
    """(d, i) for Dynamo's `list(dict.keys(d))[i]`, the dict's i-th key, else None."""
    match node:
        case ast.Subscript(value=ast.Call(func=ast.Name(id="list"), args=[ast.Call(
                func=ast.Attribute(value=ast.Name(id="dict"), attr="keys"), args=[of])]),
                slice=ast.Constant(value=int() as index)):
            return of, index
    return None


def _key_at(index: int, mapping: dict) -> Any:
    return list(dict.keys(mapping))[index]


def _value_at(index: int, mapping: dict) -> Any:
    return dict.__getitem__(mapping, _key_at(index, mapping))


# Dynamo's names for modules (`__import_torch_dot_nn`) and the builtins dict, which
# a later process's module globals lack: resolved by name, once.
_ALIASES: dict[str, Any] = {}
# The lookups Dynamo writes as calls (a key that is not an identifier, a dict subclass's item).
_LOOKUPS = {"getattr": getattr, "dict.__getitem__": dict.__getitem__, "list.__getitem__": list.__getitem__}


def roots(frame: dict, module_globals: dict) -> tuple[dict, dict, dict]:
    """What a `reader` root indexes: the locals, the globals, Dynamo's aliases."""
    return frame, module_globals, _ALIASES


def read(walked: tuple[int, Any, tuple[Callable, ...]], frame: dict, module_globals: dict) -> Any:
    """The value of a source `reader()` walked, in this frame."""
    root, key, steps = walked
    return functools.reduce(lambda value, step: step(value), steps, roots(frame, module_globals)[root][key])
