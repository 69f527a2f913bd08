"""Level 1's executable: the final ATen graph, called through torch's fast bindings.

An FX graph calls `torch.ops.aten.view.default(x, size)`, which goes through the
boxed operator path, several times slower than `x.view(size)`, the binding eager
code uses (docs/usage.md, "Levels"). A decode step is hundreds of small ops, so
that difference alone made the FX graph slower than eager. Here each ATen node is
retargeted to its binding (`torch.<op>` or the Tensor method) when, and only when,
calling the binding on the node's fake values dispatches exactly the node's overload
with the node's arguments (`bindings.exact_binding`); anything else keeps its OpOverload.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx

from .._compat import fake, names
from .._compat.names import tree_map
from ..bindings import exact_binding
from ..kernels import IMPLEMENTATIONS

_BINDING_NAMESPACES = (names.FUNCTIONS, names.NN, names.TENSOR)

# Overloads the dispatch check cannot confirm, and the binding that computes the
# same values: `_unsafe_view` is `view` minus the aliasing record autograd keeps;
# `linear` is CompositeImplicit, so it decomposes before any dispatch mode sees it.
_EQUIVALENT = {
    torch.ops.aten._unsafe_view.default: names.TENSOR.view,
    torch.ops.aten.linear.default: names.NN.linear,
    torch.ops.aten.matmul.default: names.FUNCTIONS.matmul,
}


def lower_to_bindings(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `gm` whose ATen nodes call torch's Python bindings where that is
    provably the same operator; `gm` itself stays an ATen graph."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    fake_mode = fake.fake_mode_of(gm)
    if fake_mode is not None:
        for node in graph.nodes:
            if node.target is torch.ops.aten.slice.Tensor:
                _slice_as_narrow(node)
            elif node.target is torch.ops.prims.convert_element_type.default:
                _cast_as_to_copy(node)
            elif node.op == "call_function" and isinstance(node.target, names.OpOverload):
                binding = _binding_for(node, fake_mode)
                if binding is not None:
                    node.target = binding
    return torch.fx.GraphModule(gm, graph)


def _slice_as_narrow(node: torch.fx.Node) -> None:
    """`slice` has no binding; with constant bounds, step 1 and a static dim size,
    `narrow(x, dim, start, length)` selects exactly the same view."""
    x, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if node.kwargs or not isinstance(val, torch.Tensor) or step != 1:
        return
    size = val.shape[dim]
    if not all(isinstance(v, int) for v in (size, start if start is not None else 0, end if end is not None else 0)):
        return
    start = 0 if start is None else min(max(start + size if start < 0 else start, 0), size)
    end = size if end is None else min(max(end + size if end < 0 else end, 0), size)
    node.target = names.FUNCTIONS.narrow
    node.args = (x, dim, start, max(end - start, 0))


def _cast_as_to_copy(node: torch.fx.Node) -> None:
    """A prim runs eagerly through its Python reference (about 20 us a call, against 5 for
    `_to_copy`), and AOTAutograd's decompositions and lower_precision's casts are prims:
    `_to_copy` with the dtype alone makes the same new tensor, with the same strides."""
    x, dtype = node.args
    node.target, node.args, node.kwargs = torch.ops.aten._to_copy.default, (x,), {"dtype": dtype}


def _binding_for(node: torch.fx.Node, fake_mode: Any) -> Callable | None:
    op = node.target
    if op in _EQUIVALENT:
        return _EQUIVALENT[op]
    if op in IMPLEMENTATIONS:  # graphopt's own ops: their implementation, minus the dispatcher
        return IMPLEMENTATIONS[op]

    def value(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            if "val" not in a.meta:
                raise LookupError(a.name)
            return a.meta["val"]
        return a

    try:
        args, kwargs = tree_map(value, node.args), tree_map(value, dict(node.kwargs))
    except LookupError:
        return None
    with fake_mode:
        args = _clone_written(op, args)
    return exact_binding(op, args, kwargs, kwargs, _BINDING_NAMESPACES, fake_mode)


def _clone_written(op: names.OpOverload, args: tuple) -> tuple:
    """In-place ops mutate their fake input's metadata; probe on a copy."""
    if op._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
        return (torch.empty_like(args[0]), *args[1:])
    return args
