"""Rotary position embedding: `x * cos + rotate(x) * sin` as one op.

`rotate(x)` turns each pair of channels (a, b) into (-b, a). The pairs are x's two
halves (`rotate_half`: `cat(-x2, x1)`, transformers' Llama form, GPT-NeoX's
"non-interleaved" layout) or, `interleaved`, neighbouring channels (GPT-J's
`rotate_every_two`: `stack(-x[..., 1::2], x[..., ::2], -1).flatten(-2)`, and Meta's
complex form). torch has no fused kernel for it on any device, so the op is written
with torch ops that run on CPU and CUDA alike: one product and two in-place
multiply-adds into halves of it, where eager computes slices, a negation, a
concatenation, two products and a sum (each rounded: here the second product is
added without rounding it first, at most one ulp apart).
"""

from __future__ import annotations

import torch

from . import define


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    # Type promotion as eager's: the sum's dtype, with x * cos's layout (the
    # fake implementation runs this same code, so recorded strides are exact).
    out = x * cos
    dtype = torch.promote_types(out.dtype, sin.dtype)
    if dtype != out.dtype:
        out = out.to(dtype)
    if interleaved:
        first, second = slice(0, None, 2), slice(1, None, 2)
    else:
        half = x.shape[-1] // 2
        first, second = slice(0, half), slice(half, None)
    out[..., first].addcmul_(x[..., second], sin[..., first], value=-1)
    out[..., second].addcmul_(x[..., first], sin[..., second])
    return out


@define("rotary_embedding", apply_rotary)
def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """`x * cos + rotate(x) * sin`: rotate(x) is `cat(-x2, x1)`, x2/x1 the second/first
    half of x's last dim, or with `interleaved` `(-x[2i+1], x[2i])` at channels
    (2i, 2i+1). `cos` and `sin` broadcast to x's shape and have x's (even) last dim."""
    return apply_rotary(x, cos, sin, interleaved)
