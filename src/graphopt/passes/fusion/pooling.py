"""Reduction fusion: reductions over one dim after another, and a sum divided by
the count it summed, become one `mean` (for an image, over H and W: a global
average pool).

A direct FX pass rather than patterns: the matcher compares dim lists literally,
and the dims a chain reduces (negative or not, with or without keepdim, renumbered
by each reduction that drops one) and the count it divides by are arithmetic on
those lists and on the input's shape.
"""

from __future__ import annotations

import math

import torch
import torch.fx

from ..._compat.shapes import known_true
from ..base import GraphFacts, PassResult, value_of
from . import FUSED_TAG

aten = torch.ops.aten

_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList)
_DIVISIONS = (aten.div.Tensor, aten.div.Scalar)


def fuse_pooling(gm: torch.fx.GraphModule) -> PassResult:
    """Merge chained means (or sums) into one, and turn `sum / count` into `mean`.

        before:  mean = aten.mean.dim(x, [-1]);  y = aten.mean.dim(mean, [-1])
        after:   y = aten.mean.dim(x, [2, 3])
        before:  sum_1 = aten.sum.dim_IntList(x, [2, 3]);  y = aten.div(sum_1, 64)
        after:   y = aten.mean.dim(x, [2, 3])

    - `mean(mean(x, d1), d2)` -> `mean(x, d1 + d2)`, and the same for `sum`, with d2
      numbered in x's dims, when both keep dims alike, neither casts (no `dtype`) and
      the inner result has no other reader. Every inner group has the same size, so
      the mean of the means is the mean;
    - `sum(x, dims) / n` -> `mean(x, dims)` when `n` is a number equal to the count
      of elements each output adds.
    Only for floating x, and no sum of float16 (a float16 partial sum can overflow
    where the fused reduction does not).
    Results differ from eager only by the order of the additions. The fused
    reductions are tagged `fused_mean` / `fused_sum` for the report's fused-op table.
    """
    facts = GraphFacts(gm.graph)
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:  # FX's iterator skips nodes erased on the way
        if node.op != "call_function":
            continue
        found = _chain(node) if node.target in _REDUCTIONS else \
            _sum_as_mean(node) if node.target in _DIVISIONS else None
        if found is None:
            continue
        name, target, x, dims, keepdim = found
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(target, (x, dims, keepdim))
        fused.meta = {**node.meta, FUSED_TAG: "fused_mean" if target is aten.mean.dim else "fused_sum"}
        if facts.substitute(node, fused):
            counts[name] = counts.get(name, 0) + 1
        else:
            gm.graph.erase_node(fused)
    return PassResult(changed=bool(counts), counts=counts)


def _keepdim(node: torch.fx.Node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


def _dims(node: torch.fx.Node, rank: int) -> list[int] | None:
    """The dims a reduction reduces, in [0, rank); None for all-dims or a cast."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not dims or node.kwargs.get("dtype") is not None or not all(isinstance(d, int) for d in dims):
        return None
    return [d % rank for d in dims]


def _reduced_input(reduction: torch.fx.Node) -> torch.Tensor | None:
    """The value a reduction reads, when fusing it may only reorder additions:
    floating, and for a sum not float16 (whose partial sums can overflow)."""
    val = value_of(reduction.args[0])
    if val is None or not val.dtype.is_floating_point or val.dim() == 0:
        return None
    if reduction.target is aten.sum.dim_IntList and val.dtype == torch.float16:
        return None
    return val


def _chain(outer: torch.fx.Node) -> tuple | None:
    """For a reduction of the same reduction's result: (name, op, its input, the
    dims of that input both reduce, keepdim)."""
    inner = outer.args[0]
    if not (isinstance(inner, torch.fx.Node) and inner.target is outer.target and len(inner.users) == 1):
        return None
    x, middle = _reduced_input(inner), value_of(inner)
    keepdim = _keepdim(inner)
    if x is None or middle is None or middle.dim() == 0 or keepdim != _keepdim(outer):
        return None
    inner_dims, outer_dims = _dims(inner, x.dim()), _dims(outer, middle.dim())
    if inner_dims is None or outer_dims is None:
        return None
    # Without keepdim the inner reduction dropped its dims: number the outer's in x.
    # With keepdim the outer may reduce a dim again, now of size 1: the union is the same.
    kept = list(range(x.dim())) if keepdim else [d for d in range(x.dim()) if d not in inner_dims]
    name = "mean_of_means" if outer.target is aten.mean.dim else "sum_of_sums"
    return name, outer.target, inner.args[0], sorted({*inner_dims, *(kept[d] for d in outer_dims)}), keepdim


def _sum_as_mean(div: torch.fx.Node) -> tuple | None:
    """For a sum divided by the number of elements each output adds: ("sum_as_mean",
    mean, the sum's input, its dims, keepdim)."""
    total, count = div.args[0], div.args[1]
    if div.kwargs or not (isinstance(total, torch.fx.Node) and total.target is aten.sum.dim_IntList
                          and len(total.users) == 1):
        return None
    if not isinstance(count, (int, float)) or isinstance(count, bool):
        return None
    x = _reduced_input(total)
    dims = None if x is None else _dims(total, x.dim())
    if dims is None or not known_true(math.prod(x.shape[d] for d in dims) == count):
        return None
    return "sum_as_mean", aten.mean.dim, total.args[0], dims, _keepdim(total)
