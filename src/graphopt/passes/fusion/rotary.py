"""Rotary embedding fusion: `x * cos + rotate(x) * sin` -> `graphopt::rotary_embedding`.

Level 1 only: at level 2 Inductor generates one kernel for the written-out chain
itself, and an opaque custom op would stop it fusing the chain with its neighbours.
"""

from __future__ import annotations

import torch
import torch.fx

from ..._compat import shapes
from ...kernels import rotary as _kernels
from ..base import PassResult, value_of
from .replacement import Pattern, PatternSet

ROTARY = PatternSet("fuse_rotary")


def fuse_rotary(gm: torch.fx.GraphModule) -> PassResult:
    """Replace each written-out rotary embedding by one op.

        before:  mul = aten.mul(q, cos);  slice_1 = aten.slice(q, 3, 0, 8)
                 slice_2 = aten.slice(q, 3, 8, 9223372036854775807);  neg = aten.neg(slice_2)
                 cat = aten.cat([neg, slice_1], -1);  mul_1 = aten.mul(cat, sin);  y = aten.add(mul, mul_1)
        after:   y = graphopt.rotary_embedding(q, cos, sin)

        before:  even = aten.slice(q, 3, 0, 9223372036854775807, 2);  odd = aten.slice(q, 3, 1, ..., 2)
                 pairs = aten.view(aten.stack([aten.neg(odd), even], -1), [2, 4, 8, 16])
                 y = aten.add(aten.mul(q, cos), aten.mul(pairs, sin))
        after:   y = graphopt.rotary_embedding(q, cos, sin, True)

    These are the two canonical forms (halves: transformers' `apply_rotary_pos_emb`
    and the reference Decoder; neighbouring pairs: GPT-J's `rotate_every_two`), either
    order of the sum; `canonicalize_rotary` rewrites the other spellings into them.
    cos/sin are unsqueezed to broadcast over heads before they reach the chain: the
    unsqueezed values are the op's inputs, so q and k, which share them, each become
    their own op. Only when cos and sin broadcast to x's shape, x's last dim is even
    (the rotation swaps equal halves or pairs), and the op's result has the strides
    the sum had (views after it rely on them).
    """
    return ROTARY(gm)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


def _rotary_swapped(x, cos, sin):
    return _rotate_half(x) * sin + x * cos


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _pairs(x, cos, sin):
    return x * cos + _rotate_pairs(x) * sin


def _pairs_swapped(x, cos, sin):
    return _rotate_pairs(x) * sin + x * cos


def _fused(x, cos, sin):
    return torch.ops.graphopt.rotary_embedding(x, cos, sin)


def _fused_pairs(x, cos, sin):
    return torch.ops.graphopt.rotary_embedding(x, cos, sin, True)


def _fits(match) -> bool:
    x, cos, sin = (value_of(match.kwargs.get(name)) for name in ("x", "cos", "sin"))
    if x is None or cos is None or sin is None or x.dim() == 0:
        return False
    if not all(t.dtype.is_floating_point and t.device == x.device for t in (x, cos, sin)):
        return False
    last = x.shape[-1]
    if not (isinstance(last, int) and last % 2 == 0 and cos.dim() <= x.dim() and sin.dim() <= x.dim()):
        return False
    if not all(shapes.known_true(t.shape[-1] == last) for t in (cos, sin)):
        return False
    if not all(shapes.known_true(s == 1) or shapes.known_true(s == n)
               for t in (cos, sin) for s, n in zip(reversed(t.shape), reversed(x.shape))):
        return False
    return _same_layout(match, x, cos, sin)


def _same_layout(match, x, cos, sin) -> bool:
    """The op's output strides equal the sum's on every dim longer than 1 (a later
    `view` of the sum was traced against them)."""
    summed = match.output_nodes()[0].meta.get("val")
    if not isinstance(summed, torch.Tensor):
        return False
    fused = _kernels.apply_rotary(x, cos, sin)  # on the match's fake values: only their layout is computed
    return fused.dtype == summed.dtype and shapes.same_shape(fused, summed) and all(
        shapes.known_true(size == 1) or shapes.known_true(a == b)
        for size, a, b in zip(summed.shape, fused.stride(), summed.stride()))


def _examples() -> list[torch.Tensor]:
    # [batch, heads, seq, head_dim], cos/sin [batch, 1, seq, head_dim]: other ranks
    # and sizes match too (sizes are rechecked per match).
    return [torch.empty(2, 4, 8, 16), torch.empty(2, 1, 8, 16), torch.empty(2, 1, 8, 16)]


for _search, _replace in ((_rotary, _fused), (_rotary_swapped, _fused), (_pairs, _fused_pairs),
                          (_pairs_swapped, _fused_pairs)):
    ROTARY.add(Pattern("rotary_embedding", _search, _replace, _examples(), extra_check=_fits, levels=(1,)))
