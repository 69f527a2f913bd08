"""Activation fusions: activations written out as arithmetic, and the SwiGLU gate,
replaced by the one op that computes them.

Level 1 only. At level 2 Inductor decomposes `gelu` and `_prelu_kernel` before its
post-grad passes run and refuses them afterwards ("both a fallback and a decomp for
same op"), so no fused ATen op can survive there; a `graphopt::` op would be opaque
to Inductor, which already turns each of these chains into one generated kernel.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.fx
import torch.nn.functional as F

from ..._compat import shapes
from ...kernels import activation as _kernels  # noqa: F401 - defines graphopt::silu_and_mul
from ..base import PassResult, value_of
from .replacement import Pattern, PatternSet, fwd_only

ACTIVATIONS = PatternSet("fuse_activations")

# GELU's irrational constants, as the patterns name them. Code writes them with more
# or fewer digits (FastGELU's 0.7978845608, `1 / sqrt(2)` or M_SQRT1_2): the matcher
# takes any number in their place and `_gelu_fits` accepts it when it is this close.
GELU_CONSTANTS = {"sqrt_2": math.sqrt(2.0), "sqrt_half": math.sqrt(0.5),
                  "sqrt_2_over_pi": math.sqrt(2.0 / math.pi), "cubic": 0.044715}
_CONSTANT_RTOL = 1e-6


def fuse_activations(gm: torch.fx.GraphModule) -> PassResult:
    """Replace written-out activations by one op each.

        before:  silu = aten.silu(gate);  y = aten.mul(silu, up)
        after:   y = graphopt.silu_and_mul(gate, up)
        before:  mul = aten.mul(x, 0.5);  div = aten.div(x, 1.4142135623730951);  erf = aten.erf(div)
                 add = aten.add(erf, 1.0);  y = aten.mul(mul, add)
        after:   y = aten.gelu(x)
        before:  gt = aten.gt(x, 0);  mul = aten.mul(a, x);  y = aten.where(gt, x, mul)
        after:   y = aten._prelu_kernel(x, a)

    - `silu(gate) * up` (either order, or silu written `gate * sigmoid(gate)` or
      `gate / (1 + exp(-gate))`), as Llama's and Qwen2's MLPs and
      `F.silu(x[..., :d]) * x[..., d:]` write it, when gate and up have one shape and
      dtype (no broadcast, no type promotion inside the op);
    - GELU, erf form (`x * 0.5 * (1 + erf(x / sqrt(2)))`, or `* sqrt(0.5)`) and tanh
      form (transformers' NewGELU/GELUTanh/AccurateGELU with `pow(x, 3)`, FastGELU,
      and `x * x * x`) -> `gelu` / `gelu(approximate="tanh")`, with the constants
      written to within 1e-6 of their value. `gelu` computes in float32 for half
      inputs: a few half ulps from eager's op-by-op rounding, within tolerance;
    - PReLU, `where(x > 0, x, a * x)` (or `x * a`) and `relu(x) - a * relu(-x)`, with
      a tensor slope `a` of x's dtype that broadcasts to x's shape (a scalar, or per
      channel such as `a.view(1, C, 1, 1)`): exactly the same values.
    """
    return ACTIVATIONS(gm)


def _gelu_fits(match) -> bool:
    x = value_of(match.kwargs.get("x"))
    constants = [(match.kwargs[name], value) for name, value in GELU_CONSTANTS.items() if name in match.kwargs]
    return x is not None and x.dtype.is_floating_point and all(
        isinstance(c, (int, float)) and not isinstance(c, bool) and abs(c - value) <= _CONSTANT_RTOL * value
        for c, value in constants)


def _gate_fits(match) -> bool:
    gate, up = value_of(match.kwargs.get("gate")), value_of(match.kwargs.get("up"))
    return (gate is not None and up is not None and gate.dtype.is_floating_point
            and gate.dtype == up.dtype and gate.device == up.device and shapes.same_shape(gate, up))


def _slope_fits(match) -> bool:
    """A slope of x's dtype and device whose broadcast with x is x's shape."""
    x, a = value_of(match.kwargs.get("x")), value_of(match.kwargs.get("a"))
    if x is None or a is None or not x.dtype.is_floating_point or a.dtype != x.dtype \
            or a.device != x.device or a.dim() > x.dim():
        return False
    return all(shapes.known_true(s == 1) or shapes.known_true(s == t)
               for s, t in zip(reversed(a.shape), reversed(x.shape)))


# --- silu(gate) * up -> graphopt::silu_and_mul ---

def _silu_mul(gate, up):
    return F.silu(gate) * up


def _mul_silu(gate, up):
    return up * F.silu(gate)


def _sigmoid_mul(gate, up):
    return gate * torch.sigmoid(gate) * up


def _exp_div(gate, up):
    return gate / (1.0 + torch.exp(-gate)) * up


def _silu_and_mul(gate, up):
    return torch.ops.graphopt.silu_and_mul(gate, up)


# --- GELU ---

def _gelu_erf_div(x, sqrt_2):
    return x * 0.5 * (1.0 + torch.erf(x / sqrt_2))


def _gelu_erf_mul(x, sqrt_half):
    return x * 0.5 * (1.0 + torch.erf(x * sqrt_half))


def _gelu_tanh_pow(x, sqrt_2_over_pi, cubic):
    return 0.5 * x * (1.0 + torch.tanh(sqrt_2_over_pi * (x + cubic * torch.pow(x, 3.0))))


def _gelu_tanh_fast(x, sqrt_2_over_pi, cubic):
    return 0.5 * x * (1.0 + torch.tanh(x * sqrt_2_over_pi * (1.0 + cubic * x * x)))


def _gelu_tanh_cube(x, sqrt_2_over_pi, cubic):
    return x * 0.5 * (1.0 + torch.tanh(sqrt_2_over_pi * (x + x * x * x * cubic)))


def _gelu(x, *_constants):
    return torch.ops.aten.gelu(x)


def _gelu_tanh(x, *_constants):
    return torch.ops.aten.gelu(x, approximate="tanh")


# --- PReLU ---

def _prelu_where(x, a):
    return torch.where(x > 0, x, a * x)


def _prelu_where_rmul(x, a):
    return torch.where(x > 0, x, x * a)


def _prelu_relu(x, a):
    return F.relu(x) - a * F.relu(-x)


def _prelu(x, a):
    return torch.ops.aten._prelu_kernel(x, a)


def _level_1_trace(fn, args, **kwargs) -> torch.fx.GraphModule:
    """Only the level-1 form of a pattern. The set's default also traces each pattern
    the way Inductor decomposes it, and that trace of a replacement would turn
    `gelu` or `_prelu_kernel` back into the chain it replaces."""
    return fwd_only(fn, args, **kwargs)


def _examples(*sizes):
    return [torch.empty(size) for size in sizes]


for _search in (_silu_mul, _mul_silu, _sigmoid_mul, _exp_div):
    ACTIVATIONS.add(Pattern("silu_and_mul", _search, _silu_and_mul, _examples((2, 8), (2, 8)),
                            trace_fn=_level_1_trace, extra_check=_gate_fits, levels=(1,)))
for _name, _replace, _forms in (("gelu_erf", _gelu, (_gelu_erf_div, _gelu_erf_mul)),
                                ("gelu_tanh", _gelu_tanh, (_gelu_tanh_pow, _gelu_tanh_fast, _gelu_tanh_cube))):
    for _search in _forms:
        _constants = {name: GELU_CONSTANTS[name] for name in list(inspect.signature(_search).parameters)[1:]}
        ACTIVATIONS.add(Pattern(_name, _search, _replace, [torch.empty(2, 8), *_constants.values()],
                                trace_fn=_level_1_trace, extra_check=_gelu_fits, scalar_workaround=_constants,
                                levels=(1,)))
for _search in (_prelu_where, _prelu_where_rmul, _prelu_relu):
    ACTIVATIONS.add(Pattern("prelu", _search, _prelu, _examples((2, 3, 4), (1, 3, 1)),
                            trace_fn=_level_1_trace, extra_check=_slope_fits, levels=(1,)))
