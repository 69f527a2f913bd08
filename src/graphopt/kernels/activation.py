"""Activation kernels: `graphopt::silu_and_mul`, the gate of a SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import define


def _silu_and_mul_fake(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate)


@define("silu_and_mul", _silu_and_mul_fake)
def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, for `gate` and `up` of one shape and dtype (the fusion
    only matches those). torch has no fused kernel for it on any device, so CPU and
    CUDA share this body; multiplying into silu's fresh result in place saves the
    second allocation and one pass of writes."""
    return F.silu(gate).mul_(up)
