"""Private torch names graphopt uses as they are: operator types, the Python binding
namespaces, pytree (and `tensor_leaves` over it), the dispatch mode base class,
functional collectives.

They live in private modules (`torch._ops`, `torch._C`, `torch.utils._pytree`, ...);
every other graphopt module reads them from here, so a torch that moves one breaks
this file only.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

__all__ = ["OpOverload", "OpOverloadPacket", "FunctionSchema", "Argument", "FUNCTIONS", "NN", "TENSOR",
           "OUT_NAMESPACES", "INPLACE_NAMESPACES", "RECOMPILE_LIMIT", "INDUCTOR_OPTIONS", "TorchDispatchMode",
           "tree_flatten", "tree_leaves", "tree_map", "tree_unflatten", "tensor_leaves", "functional_collectives"]

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
FunctionSchema = torch._C.FunctionSchema
Argument = torch._C.Argument

# The bindings eager code calls: `torch.<op>`, `torch.nn.functional`'s C half, Tensor methods.
FUNCTIONS, NN, TENSOR = torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase
# The namespaces that also take an `out=` tensor (the tape's out= calls).
OUT_NAMESPACES = (FUNCTIONS, NN, torch._C._linalg, torch._C._special, torch._C._fft)
INPLACE_NAMESPACES = (TENSOR, FUNCTIONS)

# Named in messages that tell the user which torch setting to change.
RECOMPILE_LIMIT = "torch._dynamo.config.recompile_limit"
INDUCTOR_OPTIONS = "torch._inductor.list_options()"


def tensor_leaves(value: object) -> list[torch.Tensor]:
    """The tensors among a pytree's leaves, in pytree order."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def functional_collectives():
    """`torch.distributed._functional_collectives`, imported when first asked for."""
    import torch.distributed._functional_collectives as funcol

    return funcol
