"""Fake values after a rewrite changes strides: the check shared by the passes that
hand a node a tensor with the same values in another layout (a transposed view
instead of its copy, an SDPA result, a channels-last region, a split piece)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from .._compat.names import OpOverload, tree_leaves
from .._compat.shapes import known_true, same_sizes
from .base import STRIDE_READERS


def restrided(gm: torch.fx.GraphModule, changed: dict[torch.fx.Node, Any],
              fake_mode: Any) -> dict[torch.fx.Node, Any] | None:
    """What a rewrite giving the nodes of `changed` new strides (same values, same
    sizes) does downstream: their new fake values and those of every node whose
    layout follows, or None when a node cannot take them: a view the new strides
    cannot express, an op that reads strides or writes, a graph output (eager's
    strides are part of the result)."""
    vals = dict(changed)
    for node in gm.graph.nodes:
        if node in vals or not any(i in vals for i in node.all_input_nodes):
            continue
        target = node.target
        # A random op is fine (strides change no draw), a side effect is not.
        if node.op != "call_function" or node.is_impure(impure_random=False) or target in STRIDE_READERS \
                or isinstance(target, OpOverload) and target._schema.is_mutable:
            return None
        new = fake_run(node, vals, fake_mode)
        old = node.meta.get("val")
        if new is None or not same_sizes_and_dtypes(new, old):
            return None
        if not same_strides(new, old):
            vals[node] = new
    return vals


def set_values(vals: dict[torch.fx.Node, Any]) -> None:
    """Store new fake values (from `restrided`) in the nodes' meta."""
    for node, val in vals.items():
        node.meta["val"] = val
        node.meta.pop("tensor_meta", None)  # describes the old strides


def fake_run(node: torch.fx.Node, vals: dict, fake_mode: Any, target: Any = None) -> Any:
    """The node's fake result (or `target`'s on its arguments) with `vals` for some
    inputs; None when torch refuses it."""
    def value(n: torch.fx.Node) -> Any:
        if n in vals:
            return vals[n]
        if "val" not in n.meta:
            raise LookupError(n.name)
        return n.meta["val"]

    try:
        args, kwargs = torch.fx.map_arg((node.args, node.kwargs), value)
        with fake_mode:
            return (target or node.target)(*args, **kwargs)
    except Exception:  # noqa: BLE001 - e.g. a view the new strides cannot express
        return None


def same_sizes_and_dtypes(new: Any, old: Any) -> bool:
    """Same structure, dtypes and sizes; non-tensor values equal."""
    a, b = tree_leaves(new), tree_leaves(old)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or not same_sizes(x.shape, y.shape):
                return False
        elif not known_true(x == y):
            return False
    return True


def same_strides(new: Any, old: Any) -> bool:
    """Same strides for every tensor (those of size-1 dims ignored), given same sizes."""
    for x, y in zip(tree_leaves(new), tree_leaves(old)):
        if isinstance(x, torch.Tensor):
            kept = [(s, t) for size, s, t in zip(x.shape, x.stride(), y.stride()) if not known_true(size == 1)]
            if not same_sizes([s for s, _ in kept], [t for _, t in kept]):
                return False
    return True
