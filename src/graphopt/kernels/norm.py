"""RMSNorm ops: plain, after a residual add, and with the residual add plus the
epilogues npugraph_ex fuses into it (per-token int8 quantization, float32 cast).

RMSNorm is written three ways that round differently in half precision; `cast`
says which one an op computes, so that a fused graph rounds like the eager one:
- "before_scale": normalise in float32, cast back to x's dtype, then `weight *`
  it (transformers' LlamaRMSNorm; the result type-promotes with the weight);
- "after_scale": normalise and scale in float32, then cast back (`torch.rms_norm`);
- "none": everything in x's dtype (written without casts).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import define

_INT8_MAX = 127
_CASTS = ("before_scale", "after_scale", "none")
_HALF_AND_SINGLE = (torch.float16, torch.bfloat16, torch.float32)


def _normed_dtype(x: torch.Tensor, weight: Optional[torch.Tensor], cast: str) -> torch.dtype:
    """The dtype of RMSNorm's result, as the written form `cast` promotes it."""
    if weight is None or cast == "after_scale":
        return x.dtype
    return torch.promote_types(weight.dtype, x.dtype)


def _reference(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, cast: str) -> torch.Tensor:
    if cast not in _CASTS:
        raise ValueError(f"graphopt rms_norm: cast must be one of {_CASTS}, got {cast!r}")
    upcast = x if cast == "none" else x.to(torch.float32)
    normed = upcast * torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)
    if cast == "before_scale":
        normed = normed.to(x.dtype)
    if weight is not None:
        normed = normed * weight
    return normed.to(x.dtype) if cast == "after_scale" else normed


def _fast(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, cast: str) -> torch.Tensor:
    # On CUDA torch.rms_norm is one fused kernel: "after_scale" in float32, which
    # rounds the other forms' half-precision results by about one unit in the last
    # place. Only where it returns the written form's dtype, and not for float64,
    # which it would compute more precisely than float32 by far more than that.
    if x.is_cuda and x.dtype in _HALF_AND_SINGLE and cast in _CASTS and _normed_dtype(x, weight, cast) == x.dtype:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    return _reference(x, weight, eps, cast)


def _normed_like(x, weight, eps, cast):
    return torch.empty_like(x, dtype=_normed_dtype(x, weight, cast))


@define("rms_norm", _normed_like)
def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, cast: str) -> torch.Tensor:
    """RMSNorm of `x` over its last dim, scaled by `weight` (shape [x.shape[-1]])."""
    return _fast(x, weight, eps, cast)


def _add_rms_norm_fake(x, residual, weight, eps, cast):
    return _normed_like(x, weight, eps, cast), torch.empty_like(x)


def _add_rms_norm(x, residual, weight, eps, cast):
    summed = x + residual
    return _fast(summed, weight, eps, cast), summed


@define("add_rms_norm", _add_rms_norm_fake)
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                 cast: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the normalised value and the new residual."""
    return _add_rms_norm(x, residual, weight, eps, cast)


def dynamic_quant(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 quantization: (int8 values, scale [..., 1])."""
    scale = y.abs().amax(-1, keepdim=True) / _INT8_MAX
    return (y / scale).round().clamp(-_INT8_MAX - 1, _INT8_MAX).to(torch.int8), scale


def _add_rms_norm_dynamic_quant_fake(x, residual, weight, eps, cast):
    scale = x.new_empty((*x.shape[:-1], 1), dtype=_normed_dtype(x, weight, cast))
    return torch.empty_like(x, dtype=torch.int8), scale, torch.empty_like(x)


@define("add_rms_norm_dynamic_quant", _add_rms_norm_dynamic_quant_fake)
def add_rms_norm_dynamic_quant(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor],
                               eps: float, cast: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rms_norm, then `dynamic_quant` of the normalised value: (int8 values,
    per-token scale, new residual)."""
    summed = x + residual
    # Always the reference: int8 outputs must equal the decomposed graph's exactly,
    # and a norm rounded differently can move a value across a .5.
    values, scale = dynamic_quant(_reference(summed, weight, eps, cast))
    return values, scale, summed


def _add_rms_norm_cast_fake(x, residual, weight, eps, cast):
    normed = _normed_like(x, weight, eps, cast)
    return torch.empty_like(normed, dtype=torch.float32), normed, torch.empty_like(x)


@define("add_rms_norm_cast", _add_rms_norm_cast_fake)
def add_rms_norm_cast(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                      cast: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rms_norm plus the normalised value cast to float32: (float32 normed,
    normed, new residual)."""
    normed, summed = _add_rms_norm(x, residual, weight, eps, cast)
    # copy=True: outputs of a custom op never alias each other, float32 input or not.
    return normed.to(torch.float32, copy=True), normed, summed
