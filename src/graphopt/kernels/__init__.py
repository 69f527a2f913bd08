"""Custom ops in the `graphopt` torch.library namespace, for fusions torch has no
ATen op for (or none that survives AOTAutograd's decomposition).

Each op has one implementation for every device, written with torch ops (a fused
CUDA kernel where torch has one), and a fake implementation for tracing. Level 1
calls the implementation directly (`IMPLEMENTATIONS`), skipping the dispatcher's
Python-op overhead; everything else calls `torch.ops.graphopt.<name>`.
"""

from __future__ import annotations

from typing import Callable

import torch

from .._compat.names import OpOverload

# graphopt::<name>.default -> the Python function implementing it.
IMPLEMENTATIONS: dict[OpOverload, Callable] = {}


def define(name: str, fake: Callable) -> Callable[[Callable], Callable]:
    """Register the decorated function (with type annotations, as torch.library
    requires) as `torch.ops.graphopt.<name>`, with `fake` as its meta function."""

    def register(fn: Callable) -> Callable:
        op = torch.library.custom_op(f"graphopt::{name}", mutates_args=())(fn)
        op.register_fake(fake)
        IMPLEMENTATIONS[getattr(torch.ops.graphopt, name).default] = fn
        return op

    return register
