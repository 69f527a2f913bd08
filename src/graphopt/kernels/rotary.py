"""Rotary position embedding: `x * cos + rotate_half(x) * sin` as one op.

`rotate_half(x)` is `cat(-x2, x1)` of x's two halves (transformers' Llama form,
GPT-NeoX's "non-interleaved" layout). torch has no fused kernel for it on any
device, so the op is written with torch ops that run on CPU and CUDA alike: one
product and two in-place multiply-adds into halves of it, where eager computes
slices, a negation, a concatenation, two products and a sum (each rounded: here
the second product is added without rounding it first, at most one ulp apart).
"""

from __future__ import annotations

import torch

from . import define


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    # Type promotion as eager's: the sum's dtype, with x * cos's layout (the
    # fake implementation runs this same code, so recorded strides are exact).
    out = x * cos
    dtype = torch.promote_types(out.dtype, sin.dtype)
    if dtype != out.dtype:
        out = out.to(dtype)
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out


@define("rotary_embedding", apply_rotary)
def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + cat(-x2, x1) * sin`, x2/x1 the second/first half of x's last dim.
    `cos` and `sin` broadcast to x's shape and have x's (even) last dim."""
    return apply_rotary(x, cos, sin)
