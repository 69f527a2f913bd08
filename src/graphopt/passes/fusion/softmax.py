"""What a softmax over the last dim looks like in an ATen graph, for the attention
fusions and canonical forms that start from one."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from ..._compat import patterns
from ..base import value_of

aten = torch.ops.aten


def last_dim(x: Any, dims: Any) -> bool:
    dims, val = dims if isinstance(dims, (list, tuple)) else [dims], value_of(x)
    return val is not None and len(dims) == 1 and dims[0] in (-1, val.dim() - 1)


def softmax_input(node: torch.fx.Node) -> tuple[torch.fx.Node, set, float] | None:
    """(input, the softmax's nodes but the last, temperature) when `node` is
    `softmax(input * temperature)` over the last dim: `_softmax`, Inductor's
    amax/sub/exp/sum/div decomposition, or the form its CUDA post-grad pass leaves (max
    and sum from one `prepare_softmax_online`). The temperature is 1 but where Inductor's
    joint-graph pass moved a positive scale past the max (torch 2.11 does):

        exp(x * s - amax(x * s))  ->  exp((x - amax(x)) * s)
    """
    if node.target is aten._softmax.default:
        return (node.args[0], set(), 1.0) if last_dim(node.args[0], node.args[1]) else None
    if node.target is not aten.div.Tensor or not all(isinstance(a, torch.fx.Node) for a in node.args):
        return None
    exp, total = node.args
    if exp.target is not aten.exp.default:
        return None
    shifted, temperature, scaled = exp.args[0], 1.0, set()
    if shifted.target is aten.mul.Tensor and isinstance(shifted.args[1], (int, float)) and shifted.args[1] > 0:
        shifted, temperature, scaled = shifted.args[0], float(shifted.args[1]), {shifted}
    if shifted.target is not aten.sub.Tensor or not isinstance(shifted.args[1], torch.fx.Node) \
            or (scaled and len(shifted.users) != 1):
        return None
    x, amax = shifted.args
    nodes = {exp, total, shifted, amax, *scaled}
    if total.target is aten.sum.dim_IntList and total.args[0] is exp and amax.target is aten.amax.default \
            and amax.args[0] is x and last_dim(x, amax.args[1]) and last_dim(x, total.args[1]):
        return x, nodes, temperature
    online = amax.args[0] if amax.target is operator.getitem and total.target is operator.getitem else None
    if online is not None and online.target is patterns.online_softmax_op() and online.args[0] is x \
            and last_dim(x, online.args[1]) and (amax.args, total.args) == ((online, 0), (online, 1)):
        return x, nodes | {online}, temperature
    return None
