"""Cleanup passes: rewrites that keep the graph's meaning and remove work."""

from __future__ import annotations

import torch
import torch.fx

from .. import _compat
from .manager import PassResult


def has_effect(node: torch.fx.Node) -> bool:
    """True for nodes that must run even when nothing reads their value: in-place
    and out= writes, ops with side effects, and random ops (removing a draw would
    shift every later random number)."""
    return node.is_impure(impure_random=True)


def dce(gm: torch.fx.GraphModule) -> PassResult:
    """Dead code elimination: drop nodes whose value nobody reads.

        before:  t = aten.t(w);  unused = aten.mul(x, 2);  mm = aten.mm(x, t);  return (mm,)
        after:   t = aten.t(w);  mm = aten.mm(x, t);  return (mm,)

    Mutations (index_put_, copy_ into an input), side effects and random ops stay.
    """
    removed = 0
    for node in reversed(gm.graph.nodes):
        if node.op in ("call_function", "call_method", "call_module", "get_attr") \
                and not node.users and not has_effect(node):
            gm.graph.erase_node(node)
            removed += 1
    return PassResult(changed=removed > 0, counts={"removed": removed} if removed else {})


def remove_noops(gm: torch.fx.GraphModule) -> PassResult:
    """Drop ops that return their input unchanged (torch Inductor's no-op rules).

        before:  slice_1 = aten.slice(x, 0, 0, 9223372036854775807);  y = aten.mul(slice_1, 2)
        after:   y = aten.mul(x, 2)

    Covers full-range slices, views and reshapes to the same shape, casts to the
    same dtype, `x + 0`, `x * 1` and the like; shapes are compared symbolically.
    """
    before = len(gm.graph.nodes)
    _compat.remove_noop_ops(gm.graph)
    removed = before - len(gm.graph.nodes)
    return PassResult(changed=removed > 0, counts={"removed": removed} if removed else {})


def cse(gm: torch.fx.GraphModule) -> PassResult:
    """Common subexpression elimination: compute each pure value once.

        before:  u1 = aten.unsqueeze(slots, 1);  ...;  u2 = aten.unsqueeze(slots, 1);  f(u2)
        after:   u1 = aten.unsqueeze(slots, 1);  ...;  f(u1)

    Random ops and ops with effects are never merged, and an in-place write is a
    barrier: no value computed before it is reused after it.
    """
    seen: dict[tuple, torch.fx.Node] = {}
    merged = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if has_effect(node):
            seen.clear()
            continue
        key = _hashable((node.target, node.args, node.kwargs))
        if key is None:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            gm.graph.erase_node(node)
            merged += 1
        else:
            seen[key] = node
    return PassResult(changed=merged > 0, counts={"merged": merged} if merged else {})


def _hashable(value: object) -> object:
    """`value` with lists and dicts made into tuples; None if anything in it cannot be hashed."""
    if isinstance(value, (list, tuple)):
        items = [_hashable(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else (type(value).__name__, *items)
    if isinstance(value, dict):
        return _hashable(sorted(value.items(), key=lambda kv: kv[0]))
    try:
        hash(value)
    except TypeError:
        return None
    return value
