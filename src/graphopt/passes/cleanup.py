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
