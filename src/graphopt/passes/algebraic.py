"""Algebraic simplification: arithmetic that cannot change a value."""

from __future__ import annotations

import functools
import math

import torch
import torch.fx

from .._compat import fake
from .base import GraphFacts, PassResult, attribute, is_contiguous, same_layout, value_of
from .constant_fold import FOLDED_RECIPES

aten = torch.ops.aten

# op -> the number that, as its right (or left) operand, leaves the other operand unchanged
_RIGHT_IDENTITIES = {
    aten.mul.Tensor: 1, aten.mul.Scalar: 1, aten.div.Tensor: 1, aten.div.Scalar: 1,
    aten.pow.Tensor_Scalar: 1, aten.pow.Tensor_Tensor: 1,
    aten.add.Tensor: 0, aten.add.Scalar: 0, aten.sub.Tensor: 0, aten.sub.Scalar: 0,
}
_LEFT_IDENTITIES = {aten.mul.Tensor: 1, aten.add.Tensor: 0}
_MULS = (aten.mul.Tensor, aten.mul.Scalar)
_SUMS = (aten.sum.default, aten.sum.dim_IntList)
_FILLS = {aten.zeros.default: 0, aten.zeros_like.default: 0, aten.new_zeros.default: 0,
          aten.ones.default: 1, aten.ones_like.default: 1, aten.new_ones.default: 1}
_FILLS_WITH_VALUE = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2,
                     aten.scalar_tensor.default: 0}
# Constant attributes up to this many elements are read to see whether they hold one value.
_INSPECT_NUMEL = 4096


def simplify_algebra(gm: torch.fx.GraphModule) -> PassResult:
    """Remove arithmetic whose result is one of its operands, or zeros.

        before:  a = aten.mul(x, 1);  b = aten.add(a, 0);  c = aten.pow(b, 1);  y = aten.relu(c)
        after:   y = aten.relu(x)

    Applied only when the result has the operand's shape, dtype and layout, so no
    broadcast and no type promotion is lost (`int_x * 1.0` is a float and stays):
    - `x*1`, `1*x`, `x/1`, `x**1`, `where(c, x, x)` -> `x`: exact for every float,
      NaN, inf and -0.0 included;
    - `x+0`, `0+x`, `x-0` (any finite alpha) -> `x`: exact except the sign of a zero
      (-0.0 + 0 is +0.0; the two compare equal, and Inductor applies the same rule);
    - `x*0`, `0*x` -> `zeros_like(x)` for integer and bool x only: for floats,
      NaN*0 and inf*0 are NaN and -1*0 is -0.0;
    - `sum(zeros)` with a static result shape -> `zeros(shape)` (any dtype: a sum
      of +0.0 is +0.0), which fold_constants then folds.
    The 1 or 0 may be a Python number or a tensor known to hold only that value:
    `full`/`ones`/`zeros` and their `_like`/`new_` forms, or a small constant attribute
    (not one folded from frozen weights, which refresh() may change).
    Operands written in place, and outputs, are left as `GraphFacts.substitute` says.
    """
    facts = GraphFacts(gm.graph)
    fill = functools.partial(_fill_value, gm)
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:  # FX's iterator skips nodes erased on the way
        if node.op != "call_function":
            continue
        operand = _identity_operand(node, fill)
        if operand is not None and facts.substitute(node, operand):
            counts["identities"] = counts.get("identities", 0) + 1
        elif _zeros_rewrite(facts, node, fill):
            counts["zeros"] = counts.get("zeros", 0) + 1
    return PassResult(changed=bool(counts), counts=counts)


def _identity_operand(node: torch.fx.Node, fill) -> torch.fx.Node | None:
    """The operand that `node` returns unchanged, by its op and arguments."""
    target, args = node.target, node.args
    if target is aten.where.self and len(args) == 3 and args[1] is args[2]:
        return args[1]
    alpha = node.kwargs.get("alpha", 1)
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or len(args) != 2:
        return None
    if target in _RIGHT_IDENTITIES and _is(fill(args[1]), _RIGHT_IDENTITIES[target]):
        return args[0] if isinstance(args[0], torch.fx.Node) else None
    if target in _LEFT_IDENTITIES and alpha == 1 and _is(fill(args[0]), _LEFT_IDENTITIES[target]):
        return args[1] if isinstance(args[1], torch.fx.Node) else None
    return None


def _zeros_rewrite(facts: GraphFacts, node: torch.fx.Node, fill) -> bool:
    """`int_x * 0` -> `zeros_like(int_x)`; `sum(zeros)` -> `zeros(static shape)`."""
    val = value_of(node)
    if val is None:
        return False
    if node.target in _MULS and len(node.args) == 2 and not val.dtype.is_floating_point \
            and not val.dtype.is_complex:
        for x, other in (node.args, node.args[::-1]):
            # zeros_like(x) has x's layout: only a product laid out like x becomes it.
            if isinstance(x, torch.fx.Node) and _is(fill(other), 0) and same_layout(x, node):
                return facts.replace_with(node, aten.zeros_like.default, (x,))
    if node.target in _SUMS and _is(fill(node.args[0]), 0) \
            and all(isinstance(size, int) for size in val.shape) and is_contiguous(val):
        return facts.replace_with(node, aten.zeros.default, (list(val.shape),),
                                 {"dtype": val.dtype, "device": val.device})
    return False


def _is(value: object, element: int) -> bool:
    return value is not None and value == element


def _fill_value(gm: torch.fx.GraphModule, arg: object) -> object:
    """The one value every element of `arg` has, when that is known: a Python number,
    a fill op (`full`, `zeros_like`, ...), or a small constant attribute not folded from
    frozen weights. Else None."""
    if isinstance(arg, (bool, int, float)):
        return arg
    if not isinstance(arg, torch.fx.Node):
        return None
    if arg.target in _FILLS:
        return _FILLS[arg.target]
    if arg.target in _FILLS_WITH_VALUE:
        value = arg.args[_FILLS_WITH_VALUE[arg.target]]
        return value if isinstance(value, (bool, int, float)) else None
    if arg.op == "get_attr" and arg.target not in gm.meta.get(FOLDED_RECIPES, {}):
        # A value folded from frozen weights is left unread: refresh() recomputes it in place
        # after the weights change, and code made for its old value would stay.
        tensor = attribute(gm, arg.target)
        if isinstance(tensor, torch.Tensor) and 0 < tensor.numel() <= _INSPECT_NUMEL:
            with fake.outside_fake_mode():
                first = tensor.reshape(-1)[0]
                if bool((tensor == first).all()):
                    return first.item()
    return None
