"""RMSNorm in one form: `x * rsqrt(mean(x ** 2, -1, keepdim) + eps)`."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.fx

from ..._compat import fake
from ..base import PassResult, value_of
from ..fusion.attention import number
from ..strides import fake_run

aten = torch.ops.aten
_SQUARES = (aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor)


def canonicalize_norms(gm: torch.fx.GraphModule) -> PassResult:
    """Rewrite the other spellings of RMSNorm's two halves into the form `fuse_norms`
    matches.

        before:  norm = aten.linalg_vector_norm(x, 2, [-1], True);  sq = aten.pow(norm, 2)
                 ms = aten.div(sq, 64)                     (or aten.mul(sq, 1 / 64))
        after:   ms = aten.mean(aten.pow(x, 2), [-1], True)

        before:  y = aten.div(x, aten.sqrt(aten.add(ms, 1e-06)))
        after:   y = aten.mul(x, aten.rsqrt(aten.add(ms, 1e-06)))

    The first: ‖x‖² over the last dim n, divided by n, is the mean of the squares
    (rounding aside). The second only where `ms` is such a mean (the sum being an
    RMSNorm's), so no other `x / sqrt(y)` changes its rounding.
    """
    mode = fake.fake_mode_of(gm) or contextlib.nullcontext()
    means = rsqrts = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if _norm_mean(gm, node, mode):
            means += 1
        elif _divided_by_root(node, mode):
            rsqrts += 1
    if means or rsqrts:
        gm.graph.eliminate_dead_code()
    counts = {name: n for name, n in (("mean_of_squares", means), ("rsqrt", rsqrts)) if n}
    return PassResult(changed=bool(counts), counts=counts)


def _norm_mean(gm: torch.fx.GraphModule, node: torch.fx.Node, mode: Any) -> bool:
    """`‖x‖² / n` over x's last dim n (a 2-norm, keepdim, squared) -> `mean(x²)`."""
    if node.target not in (aten.div.Tensor, aten.mul.Tensor) or len(node.args) != 2 or node.kwargs:
        return False
    square, factor = node.args[0], number(gm, node.args[1])
    if not isinstance(square, torch.fx.Node) or square.target not in _SQUARES or number(gm, square.args[1]) != 2.0 \
            or not isinstance(square.args[0], torch.fx.Node) or len(square.users) != 1:
        return False
    norm = square.args[0]
    if norm.target is not aten.linalg_vector_norm.default or len(norm.users) != 1 or norm.kwargs.get("dtype"):
        return False
    x, order, dims, keepdim = (list(norm.args) + [2, None, False])[:4]
    val = value_of(x)
    if val is None or val.dim() == 0 or not val.dtype.is_floating_point or number(gm, order) != 2.0 \
            or keepdim is not True or not isinstance(dims, (list, tuple)) or len(dims) != 1 \
            or dims[0] % val.dim() != val.dim() - 1 or not isinstance(val.shape[-1], int) or factor is None:
        return False
    width = val.shape[-1]
    if not math.isclose(factor if node.target is aten.mul.Tensor else 1.0 / factor, 1.0 / width, rel_tol=1e-6):
        return False
    with gm.graph.inserting_before(node):
        squares = gm.graph.call_function(aten.pow.Tensor_Scalar, (x, 2))
        squares.meta["val"] = fake_run(squares, {}, mode)
        mean = gm.graph.call_function(aten.mean.dim, (squares, [-1], True))
        mean.meta["val"] = fake_run(mean, {}, mode)
    if mean.meta["val"] is None or value_of(mean).dtype != value_of(node).dtype:
        gm.graph.erase_node(mean)
        gm.graph.erase_node(squares)
        return False
    node.replace_all_uses_with(mean)
    return True


def _divided_by_root(node: torch.fx.Node, mode: Any) -> bool:
    """`x / sqrt(mean(..) + eps)` -> `x * rsqrt(mean(..) + eps)`."""
    if node.target is not aten.div.Tensor or node.kwargs or not all(isinstance(a, torch.fx.Node) for a in node.args):
        return False
    x, root = node.args
    if root.target is not aten.sqrt.default or len(root.users) != 1:
        return False
    total = root.args[0]
    if total.target not in (aten.add.Tensor, aten.add.Scalar) or not isinstance(total.args[0], torch.fx.Node) \
            or total.args[0].target is not aten.mean.dim:
        return False
    with node.graph.inserting_before(node):
        rsqrt = node.graph.call_function(aten.rsqrt.default, (total,))
        rsqrt.meta["val"] = fake_run(rsqrt, {}, mode)
        product = node.graph.call_function(aten.mul.Tensor, (x, rsqrt))
        product.meta["val"] = fake_run(product, {}, mode)
    node.replace_all_uses_with(product)
    return True
