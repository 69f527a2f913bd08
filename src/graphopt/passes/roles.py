"""What a product of an input with a weight does in its model, read from the graph's
structure (an ATen graph keeps no module names once linears are fused): the attention's
value projection, or an MLP's output projection.

    q = x @ wq.T;  k = x @ wk.T;  v = x @ wv.T
    o = sdpa(rotary(q), cache_write(k), cache_write(v))      v: the value projection
    y = (gelu(h @ wg.T) * (h @ wu.T)) @ wd.T                 wd: the MLP's output projection

The value projection is the product whose result reaches attention (scaled_dot_product_
attention, graphopt's decode attention) only as its value; the MLP's output projection is
the one whose input is computed from other products' results by elementwise ops and views
alone (an activation, a gate), so no norm, attention or graph input lies between them, and
whose result reaches no product that way (it goes back to the residual stream, through a
norm, or out): in a stack of linears and activations only the last is one.

They are the layers a 4-bit weight hurts most (llama.cpp's `_M` formats keep `attn_v` and
`ffn_down` at more bits): the value's error passes through attention unweighted by the
softmax that damps the query's and key's, and the MLP's output projection reads the widest,
heaviest-tailed activations of the layer.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .._compat.names import OpOverload
from ..kernels import activation as _activation  # noqa: F401 - defines graphopt::silu_and_mul
from ..kernels import decode_attention as _decode_attention  # noqa: F401 - defines graphopt::decode_attention
from .base import CASTS, is_view
from .fusion.attention import SDPA_OPS

aten = torch.ops.aten

VALUE, MLP_OUTPUT = "value projection", "MLP output projection"

# Attention ops, each reading (query, key, value, ...).
_ATTENTION = SDPA_OPS | {aten.scaled_dot_product_attention.default, torch.ops.graphopt.decode_attention.default}
_VALUE_SLOT = 2
# graphopt's own ops that are elementwise in their tensor arguments.
_ELEMENTWISE = {torch.ops.graphopt.silu_and_mul.default}


def role(node: torch.fx.Node, products: set[torch.fx.Node], constants: set[torch.fx.Node]) -> str | None:
    """VALUE, MLP_OUTPUT or None for `node`, one of `products` (the graph's products of an
    input with a weight: `linear(x, w)`, `mm(x, wt)`, `addmm(b, x, wt)`); `constants` are
    the graph's frozen values, which an MLP's bias may be."""
    if _only_value(node, products):
        return VALUE
    x = _input(node)
    if x is not None and _from_products(x, products, constants) and not _into_products(node, products):
        return MLP_OUTPUT
    return None


def _input(product: torch.fx.Node) -> torch.fx.Node | None:
    """x of `linear(x, w)`, `mm(x, wt)` or `addmm(b, x, wt)`."""
    x = product.args[1] if product.target is aten.addmm.default else product.args[0]
    return x if isinstance(x, torch.fx.Node) else None


def _only_value(start: torch.fx.Node, products: set[torch.fx.Node]) -> bool:
    """Whether every attention `start`'s result reaches (before any other product or
    attention) reads it as its value, and at least one does."""
    seen, todo, reached = {start}, [start], False
    while todo:
        node = todo.pop()
        for user in node.users:
            if user.op == "call_function" and user.target in _ATTENTION:
                value = user.args[_VALUE_SLOT] if len(user.args) > _VALUE_SLOT else None
                if value is not node or node in user.args[:_VALUE_SLOT]:
                    return False
                reached = True
            elif user not in seen and user not in products and user.op == "call_function":
                seen.add(user)
                todo.append(user)
    return reached


def _elementwise_or_view(node: torch.fx.Node) -> bool:
    target = node.target
    if target is operator.getitem or target in CASTS or target in _ELEMENTWISE or is_view(node):
        return True
    if target is aten.split_with_sizes.default or target is aten.split.Tensor:
        return True
    return isinstance(target, OpOverload) and torch.Tag.pointwise in target.tags


def _into_products(start: torch.fx.Node, products: set[torch.fx.Node]) -> bool:
    """Whether `start`'s result reaches a product through elementwise ops and views alone."""
    seen, todo = {start}, [start]
    while todo:
        for user in todo.pop().users:
            if user in products:
                return True
            if user not in seen and user.op == "call_function" and _elementwise_or_view(user):
                seen.add(user)
                todo.append(user)
    return False


def _from_products(x: torch.fx.Node, products: set[torch.fx.Node], constants: set[torch.fx.Node]) -> bool:
    """Whether `x` is computed from products' results (at least one) and constants by
    elementwise ops and views alone."""
    seen, todo, found = {x}, [x], False
    while todo:
        node = todo.pop()
        if node in products:
            found = True
            continue
        if node.op == "get_attr" or node in constants:
            continue
        if node.op != "call_function" or not _elementwise_or_view(node):
            return False
        for arg in node.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                todo.append(arg)
    return found
