"""Residual add + LayerNorm as one op (ONNX Runtime's SkipLayerNormalization).

    add_layer_norm(x, residual, weight?, bias?, eps) -> (layer_norm(x + residual), x + residual)
    skip_layer_norm(x, residual, weight?, bias?, eps) -> layer_norm(x + residual)

LayerNorm over the last dim, with a biased variance, scaled by `weight` and shifted
by `bias` where given (vectors over the last dim). `x` and `residual` have one shape.
`skip_layer_norm` is the form where nothing else reads the sum (a post-norm encoder
such as BERT), so the sum is never written out; `add_layer_norm` returns it as the
next residual (a pre-norm model).

On the CPU the kernel is C++ (`layer_norm.cpp`; float32, other dtypes run torch's
ops), built on first use for the machine's vector ISA and registered with the
dispatcher; anywhere else, and on the CPU where it cannot be built, the op runs
`_reference`: the add, then torch's LayerNorm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from . import native

SOURCE = Path(__file__).with_suffix(".cpp")
_ARGS = "Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps"

_LIB = torch.library.Library("graphopt", "FRAGMENT")
_LIB.define(f"add_layer_norm({_ARGS}) -> (Tensor, Tensor)")
_LIB.define(f"skip_layer_norm({_ARGS}) -> Tensor")


def native_unavailable() -> str | None:
    """Why CPU calls run `_reference` (None: the C++ kernel is registered). Builds
    the kernel on the first call; a failure is logged once."""
    return native.cpu_kernel_unavailable("graphopt_layer_norm", SOURCE,
                                         "add + LayerNorm runs as two torch ops on the CPU")


@torch.library.register_fake("graphopt::add_layer_norm", lib=_LIB)
def _add_layer_norm_fake(x, residual, weight, bias, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), \
        torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("graphopt::skip_layer_norm", lib=_LIB)
def _skip_layer_norm_fake(x, residual, weight, bias, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _reference(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor],
               bias: Optional[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape != residual.shape:
        raise ValueError(f"add_layer_norm: x and residual must have one shape, got {list(x.shape)} "
                         f"and {list(residual.shape)}")
    summed = x + residual
    return F.layer_norm(summed, (summed.shape[-1],), weight, bias, eps).contiguous(), summed.contiguous()


def _native(x: torch.Tensor) -> bool:
    # Reached on the CPU only while the C++ kernel is not registered: a graph loaded
    # from the compile cache runs this before anything built it.
    return x.device.type == "cpu" and native_unavailable() is None


def _add_layer_norm(x, residual, weight, bias, eps):
    if _native(x):
        return torch.ops.graphopt.add_layer_norm.default(x, residual, weight, bias, eps)
    return _reference(x, residual, weight, bias, eps)


def _skip_layer_norm(x, residual, weight, bias, eps):
    if _native(x):
        return torch.ops.graphopt.skip_layer_norm.default(x, residual, weight, bias, eps)
    return _reference(x, residual, weight, bias, eps)[0]


_LIB.impl("add_layer_norm", _add_layer_norm, "CompositeExplicitAutograd")
_LIB.impl("skip_layer_norm", _skip_layer_norm, "CompositeExplicitAutograd")
