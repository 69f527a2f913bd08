"""Binary eltwise fusion: a sum of tensors scaled by Python numbers folds its
coefficients into `add`/`sub`'s `alpha` (the Eltwise Sum with coeffs of other
inference engines), one op fewer per sum."""

from __future__ import annotations

import math

import torch
import torch.fx

from ..base import PassResult, value_of
from . import FUSED_TAG
from .replacement import Pattern, PatternSet

aten = torch.ops.aten
ELTWISE = PatternSet("fuse_eltwise")

# Placeholder values the coefficients are traced with; the matcher then takes any
# number in their place (`scalar_workaround`). Distinct, and no other constant.
_B1, _B2 = 0.5, 0.25


def fuse_eltwise(gm: torch.fx.GraphModule) -> PassResult:
    """Fold scalar coefficients of a binary sum into `alpha`.

        before:  mul = aten.mul(x1, 0.5);  mul_1 = aten.mul(x2, 0.25);  y = aten.add(mul, mul_1)
        after:   mul = aten.mul(x1, 0.5);  y = aten.add(mul, x2, alpha=0.25)

    `x1*b1 + x2*b2` and `x1*b1 - x2*b2` keep two ops; `x1 + x2*b2`, `x1*b1 + x2` and
    `x1 - x2*b2` become one. Only for floating x1 and x2 of one dtype and finite
    Python-number coefficients: `alpha * x2` is then computed in the dtype eager
    rounded `x2 * b2` to (a mixed-dtype sum would skip that rounding), and differs
    from eager by at most the rounding of that product. The fused sums are tagged
    `eltwise_sum` for the report's fused-op table (eager code writes `add` too).
    """
    before = set(gm.graph.nodes)
    result = ELTWISE(gm)
    for node in gm.graph.nodes:
        if node not in before and node.target in (aten.add.Tensor, aten.sub.Tensor) and "alpha" in node.kwargs:
            node.meta[FUSED_TAG] = "eltwise_sum"
    return result


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fits(match) -> bool:
    vals = [value_of(match.kwargs.get(name)) for name in ("x1", "x2")]
    if not all(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in vals):
        return False
    coefficients = [match.kwargs[name] for name in ("b1", "b2") if name in match.kwargs]
    return vals[0].dtype == vals[1].dtype and all(_number(b) for b in coefficients)


def _sum_both(x1, x2, b1, b2):
    return x1 * b1 + x2 * b2


def _sum_both_fused(x1, x2, b1, b2):
    return torch.add(x1 * b1, x2, alpha=b2)


def _difference_both(x1, x2, b1, b2):
    return x1 * b1 - x2 * b2


def _difference_both_fused(x1, x2, b1, b2):
    return torch.sub(x1 * b1, x2, alpha=b2)


def _sum_right(x1, x2, b2):
    return x1 + x2 * b2


def _sum_right_fused(x1, x2, b2):
    return torch.add(x1, x2, alpha=b2)


def _sum_left(x1, x2, b1):
    return x1 * b1 + x2


def _sum_left_fused(x1, x2, b1):
    return torch.add(x2, x1, alpha=b1)


def _difference_right(x1, x2, b2):
    return x1 - x2 * b2


def _difference_right_fused(x1, x2, b2):
    return torch.sub(x1, x2, alpha=b2)


# Both-sided forms first: a one-sided form would also match them, less well.
for _search, _replace, _coefficients in (
        (_sum_both, _sum_both_fused, {"b1": _B1, "b2": _B2}),
        (_difference_both, _difference_both_fused, {"b1": _B1, "b2": _B2}),
        (_sum_right, _sum_right_fused, {"b2": _B2}),
        (_sum_left, _sum_left_fused, {"b1": _B1}),
        (_difference_right, _difference_right_fused, {"b2": _B2})):
    _examples = [torch.empty(2, 8), torch.empty(2, 8), *_coefficients.values()]
    ELTWISE.add(Pattern("scaled_sum" if "sum" in _search.__name__ else "scaled_difference", _search, _replace,
                        _examples, extra_check=_fits, scalar_workaround=_coefficients))
