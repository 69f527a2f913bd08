"""Collectives: which ops communicate between ranks, and the fused all-reduce +
residual add + RMSNorm that ends every tensor-parallel attention and MLP block.

Passes and the runtime both ask `is_collective_op`: a collective must run on every
rank, in the same order, on memory nobody writes until it has arrived. torch's
functional collectives (`torch.ops._c10d_functional`, what Dynamo and DTensor trace
into graphs) are asynchronous: `all_reduce` returns a tensor whose values arrive at
`wait_tensor`.

`all_reduce_add_rms_norm` is one op where the backend could do the three in one
pass over the data (vLLM's and TensorRT-LLM's fused all-reduce + RMSNorm kernels).
Here every device runs the correct composition: torch's all-reduce, waited for,
then `add_rms_norm`. A one-shot CUDA kernel (NCCL symmetric memory or a custom
all-reduce) is not written; the CUDA path is the same composition and unverified.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed  # noqa: F401 - registers the _c10d_functional ops

from .._compat.names import OpOverload, OpOverloadPacket
from . import define
from .norm import _add_rms_norm, _add_rms_norm_fake

# Namespaces whose every op communicates (or waits for communication).
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d", "_c10d_functional_autograd"})


def is_collective_op(op: object) -> bool:
    """True for an op that talks to other ranks or waits for them (including
    graphopt's own fused all-reduce). Dynamo's graphs name an op by its packet
    (`_c10d_functional.all_reduce`), AOTAutograd's by its overload."""
    if isinstance(op, OpOverloadPacket):
        op = getattr(op, "default", None)
    return isinstance(op, OpOverload) and (
        op.namespace in COLLECTIVE_NAMESPACES or op in FUSED_COLLECTIVES)


def _all_reduce_add_rms_norm_fake(x, residual, weight, eps, cast, group_name):
    return _add_rms_norm_fake(x, residual, weight, eps, cast)


@define("all_reduce_add_rms_norm", _all_reduce_add_rms_norm_fake)
def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor],
                            eps: float, cast: str, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(all_reduce_sum(x) + residual), all_reduce_sum(x) + residual) over
    the process group `group_name`: the normalised value and the new residual."""
    functional = torch.ops._c10d_functional
    reduced = functional.wait_tensor(functional.all_reduce(x, "sum", group_name))
    return _add_rms_norm(reduced, residual, weight, eps, cast)


FUSED_COLLECTIVES = frozenset({torch.ops.graphopt.all_reduce_add_rms_norm.default})
