"""Memory planning: the liveness of a graph's intermediates, and one arena they share.

Run as FX code, every intermediate of a graph is its own allocation. Most live for
a few ops, so buffers whose lifetimes do not overlap can share memory: planned as
one arena, a decode step needs a fraction of the sum of its buffers. The host graph
(`runtime/host_graph.py`) places the allocations it records with `arena.plan_offsets`;
the `plan_memory` pass plans the final ATen graph the same way and reports the
bytes (`report().memory`), without changing the graph.

Lifetimes count ops in graph order, both ends included. A view, and an in-place
op, use their input's buffer, so they extend its life rather than start a new one.
Graph outputs live to the end. Inputs, parameters and constants (`get_attr`) are
not planned: they exist before the graph runs and after it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from .._compat import shapes
from .._compat.names import Argument, FunctionSchema, OpOverload, tree_leaves
from ..arena import Plan, aligned, live_bytes, plan_offsets
from ..report import MemoryRecord
from .base import PassResult

_META_KEY = "graphopt_memory"

# A buffer: the node whose result allocated it, and which of its tensor results.
Storage = tuple[torch.fx.Node, int]


# -- liveness of an FX graph ----------------------------------------------------------------

# `_unsafe_view` is a view; `wait_tensor` returns the collective's result tensor itself.
_RETURNS_INPUT = (torch.ops.aten._unsafe_view.default, torch.ops._c10d_functional.wait_tensor.default)


def storages(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[Storage]]:
    """For each node, the buffer behind each result (one entry per element of a
    tuple result): its own for a new value, its input's for a view or an in-place
    op (read from the op's schema), the element's for `getitem`."""
    found: dict[torch.fx.Node, list[Storage]] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            found[node] = [(node, 0)]
        elif node.op == "call_function":
            found[node] = _results(node, found)
    return found


def _results(node: torch.fx.Node, found: dict[torch.fx.Node, list[Storage]]) -> list[Storage]:
    value = node.meta.get("val")
    count = len(value) if isinstance(value, (list, tuple)) else 1
    own = [(node, i) for i in range(count)]
    if node.target is operator.getitem:
        parent, index = node.args
        parents = found.get(parent, [])
        return [parents[index]] if isinstance(index, int) and -len(parents) <= index < len(parents) else own
    if node.target in _RETURNS_INPUT:  # the same memory, though the schema does not say so
        return [found[node.args[0]][0]] if node.args[0] in found else own
    if not isinstance(node.target, OpOverload):
        return own  # a higher-order op or a Python function: assume new memory
    schema = node.target._schema
    returns = list(schema.returns) * count if len(schema.returns) == 1 else list(schema.returns)
    results = []
    for i, ret in enumerate(returns[:count]):
        source = _aliased_argument(node, schema, ret)
        results.append(found[source][0] if source in found else own[i])
    return results


def _aliased_argument(node: torch.fx.Node, schema: FunctionSchema, ret: Argument):
    """The input node a result aliases (`Tensor(a) self` -> `Tensor(a)`), or None."""
    if ret.alias_info is None:
        return None
    # A list of views (`split -> Tensor(a)[]`) shows no alias set: its input is `Tensor(a -> *)`.
    wanted = set(ret.alias_info.before_set)
    for index, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and (set(arg.alias_info.before_set) & wanted
                                           or not wanted and "*" in arg.alias_info.after_set):
            value = node.args[index] if index < len(node.args) and not arg.kwarg_only else node.kwargs.get(arg.name)
            return value if isinstance(value, torch.fx.Node) else None
    return None


@dataclass(frozen=True)
class Buffer:
    storage: Storage
    first: int   # the op that allocates it
    last: int    # the last op that reads it, through any view; the output node for outputs
    nbytes: int  # at the traced sizes (symbolic sizes at their hints)


@dataclass(frozen=True)
class GraphPlan:
    buffers: list[Buffer]
    plan: Plan
    live_bytes: int
    sizes: dict[str, int] = field(default_factory=dict)  # the symbolic sizes it was planned at

    @property
    def naive_bytes(self) -> int:
        return sum(aligned(b.nbytes) for b in self.buffers)

    def record(self, graph: int) -> MemoryRecord:
        return MemoryRecord(graph=graph, buffers=len(self.buffers), naive_bytes=self.naive_bytes,
                            planned_bytes=self.plan.nbytes, live_bytes=self.live_bytes,
                            largest_buffer_bytes=max((aligned(b.nbytes) for b in self.buffers), default=0),
                            sizes=dict(self.sizes))


def liveness(graph: torch.fx.Graph) -> list[Buffer]:
    """Every buffer the graph's ops allocate, with its lifetime, in graph order.
    What a collective reads lives until its `wait_tensor`: it may be sent until then."""
    where = storages(graph)
    first: dict[Storage, int] = {}
    last: dict[Storage, int] = {}
    values: dict[Storage, torch.Tensor] = {}
    for index, node in enumerate(graph.nodes):
        read = list(node.all_input_nodes)
        if node.target is torch.ops._c10d_functional.wait_tensor.default and node.args[0] in where:
            read += where[node.args[0]][0][0].all_input_nodes  # the inputs of the collective it waits for
        for arg in read:
            for storage in where.get(arg, ()):
                if storage in last:
                    last[storage] = index
        if node.op != "call_function":
            continue
        leaves = node.meta.get("val")
        leaves = list(leaves) if isinstance(leaves, (list, tuple)) else [leaves]
        for i, storage in enumerate(where[node]):
            if storage == (node, i) and isinstance(leaves[i], torch.Tensor):
                first[storage] = last[storage] = index
                values[storage] = leaves[i]
    return [Buffer(s, first[s], last[s], _nbytes(values[s])) for s in first]


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of the memory a new tensor like `t` takes (its strides' extent)."""
    sizes = [shapes.size_hint(s) for s in t.shape]
    if t.layout != torch.strided:
        return t.element_size() * _prod(sizes)
    if 0 in sizes:
        return 0
    strides = [shapes.size_hint(s) for s in t.stride()]
    extent = 1 + shapes.size_hint(t.storage_offset()) + sum((n - 1) * s for n, s in zip(sizes, strides))
    return t.element_size() * extent


def _prod(sizes: list[int]) -> int:
    out = 1
    for n in sizes:
        out *= n
    return out


def plan_graph(graph: torch.fx.Graph) -> GraphPlan:
    """Liveness and an arena plan for the graph's intermediates."""
    buffers = liveness(graph)
    spans = [(b.first, b.last, b.nbytes) for b in buffers]
    values = [b.storage[0].meta.get("val") for b in buffers]
    symbols = [s for v in tree_leaves(values) if isinstance(v, torch.Tensor) for s in v.shape]
    return GraphPlan(buffers, plan_offsets(spans), live_bytes(spans), shapes.symbol_hints(symbols))


def plan_memory(gm: torch.fx.GraphModule) -> PassResult:
    """Plan the arena of the graph's intermediates and record it for `report()`;
    the graph itself is left as it is.

        before:  mul = aten.mul(x, 2)          # buffer A: [1, 2]
                 relu = aten.relu(mul)         # buffer B: [2, 3]
                 add = aten.add(relu, 1)       # buffer C: [3, output]
        after:   the same graph; gm.meta records A at offset 0, B at offset |A|,
                 C at offset 0 (A is dead by then): 2 buffers' bytes instead of 3
    """
    planned = plan_graph(gm.graph)
    gm.meta[_META_KEY] = planned
    return PassResult(changed=False, counts={"buffers": len(planned.buffers)})


def memory_record(gm: torch.fx.GraphModule, graph: int) -> MemoryRecord | None:
    """The report's memory record of `gm`, when `plan_memory` ran on it."""
    planned = gm.meta.get(_META_KEY)
    return planned.record(graph) if planned is not None else None
