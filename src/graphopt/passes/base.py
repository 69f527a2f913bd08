"""What every pass shares: `PassResult`, and the graph queries passes ask (the value
a node computes, views and their roots, writes and effects, layouts).

A rewrite that makes the users of a node read another value must not change what a
write or a graph output aliases. `GraphFacts` knows which values the graph writes in
place and which it returns, and `GraphFacts.substitute` is the one way the cleanup
passes replace a node: it refuses a substitution that could change a result.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from .._compat.names import OpOverload
from .._compat.ops import written_arguments
from .._compat.shapes import known_true, same_sizes
from ..kernels.collective import is_collective_op


@dataclass
class PassResult:
    """What a pass did: whether it changed the graph, and counts for the report."""

    changed: bool
    counts: dict[str, int] = field(default_factory=dict)


aten, prims = torch.ops.aten, torch.ops.prims

# The ops a dtype cast is spelled with: convert_element_type (lower_precision, Inductor's
# decompositions) and _to_copy (a model's `.to(dtype)` / `.float()`).
CASTS = (aten._to_copy.default, prims.convert_element_type.default)

# Ops whose result reads its input's storage or strides, not only its values.
STRIDE_READERS = {aten.as_strided.default, aten.as_strided_scatter.default,
                    aten.sym_stride.int, aten.sym_storage_offset.default}


def changes_only_dtype(node: torch.fx.Node) -> bool:
    """A cast (one of CASTS) that changes only the dtype (not device, layout or memory format)."""
    if node.target is prims.convert_element_type.default:
        return True
    return len(node.args) == 1 and all(v is None or k in ("dtype", "non_blocking") or
                                       (k == "memory_format" and v is torch.preserve_format)
                                       for k, v in node.kwargs.items())


def is_collective(node: torch.fx.Node) -> bool:
    """True for a node that communicates with other ranks or waits for them
    (`_c10d_functional.all_reduce`, `wait_tensor`, graphopt's fused all-reduce).
    Every rank must run the same collectives in the same order, and the memory a
    collective reads or fills may be in flight until its `wait_tensor`: passes never
    remove, merge, fold or move one, nor write in place into its memory."""
    return node.op == "call_function" and is_collective_op(node.target)


def has_effect(node: torch.fx.Node) -> bool:
    """True for nodes that must run even when nothing reads their value: in-place
    and out= writes, ops with side effects, collectives (the other ranks wait for
    them), and random ops (removing a draw would shift every later random number)."""
    return node.is_impure(impure_random=True) or is_collective(node)


def attribute(module: torch.nn.Module, target: str) -> object:
    """The attribute a get_attr node's `target` ("sub.name") names on `module`."""
    return functools.reduce(getattr, target.split("."), module)


def value_of(node: object) -> torch.Tensor | None:
    """The (fake) tensor a node computes, when it computes one tensor."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def same_layout(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Same sizes, strides, dtype and device, for every value of the symbolic sizes."""
    va, vb = value_of(a), value_of(b)
    return (va is not None and vb is not None and va.dtype == vb.dtype and va.device == vb.device
            and va.layout == vb.layout == torch.strided
            and same_sizes(va.shape, vb.shape) and same_sizes(va.stride(), vb.stride()))


def is_contiguous(val: torch.Tensor) -> bool:
    """Row-major without gaps (size-1 dims may have any stride); symbolic sizes allowed."""
    expected = 1
    for size, stride in reversed(list(zip(val.shape, val.stride()))):
        if known_true(size == 1):
            continue
        if not known_true(stride == expected):
            return False
        expected = expected * size
    return True


def _row_major(val: torch.Tensor) -> bool:
    """Dims laid out in order, outer to inner, without overlap (gaps allowed): a slice
    of a contiguous tensor. Ops that follow their input's layout treat such a tensor
    like a contiguous one."""
    dims = [(size, stride) for size, stride in zip(val.shape, val.stride()) if not known_true(size == 1)]
    return all(known_true(outer >= inner * size) for (_, outer), (size, inner) in zip(dims, dims[1:]))


def _returns_alias(node: torch.fx.Node) -> bool:
    """True when the node's result shares memory with its first argument: views, an
    in-place op's result, `_unsafe_view`, and the pieces of a split."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return isinstance(node.args[0], torch.fx.Node) and _returns_alias(node.args[0])
    if target is aten._unsafe_view.default:  # a view whose schema does not say so
        return True
    return (isinstance(target, OpOverload) and bool(target._schema.returns)
            and target._schema.returns[0].alias_info is not None)


def is_view(node: torch.fx.Node) -> bool:
    """A view op (no write): its result aliases its first argument and costs nothing."""
    return _returns_alias(node) and not (isinstance(node.target, OpOverload)
                                         and node.target._schema.is_mutable)


def alias_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory `node` is: itself, or the root of what it is a view of."""
    while isinstance(node, torch.fx.Node) and _returns_alias(node):
        node = node.args[0]
    return node


def written_roots(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Roots of every value some node writes in place (a `copy_` into an input, an
    `index_put_` into a view of a cache, `add_` on a fresh value)."""
    roots: set[torch.fx.Node] = set()
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function":
            continue
        if isinstance(target, OpOverload):
            if not target._schema.is_mutable:
                continue
            for value in written_arguments(target, node.args, node.kwargs):
                values = value if isinstance(value, (list, tuple)) else [value]
                roots.update(alias_root(v) for v in values if isinstance(v, torch.fx.Node))
        elif has_effect(node):  # an unknown effect may write any input
            roots.update(alias_root(v) for v in node.all_input_nodes)
    return roots


def erase_dead(node: torch.fx.Node) -> None:
    """Erase `node` if nothing reads it, then each of its inputs that only it read."""
    todo, erased = [node], set()
    while todo:
        n = todo.pop()
        if n not in erased and n.op == "call_function" and not n.users and not has_effect(n):
            inputs = n.all_input_nodes
            n.graph.erase_node(n)
            erased.add(n)
            todo.extend(inputs)


class GraphFacts:
    """What a rewrite must not disturb: which values the graph writes in place and
    which it returns (by their alias roots). Built once per pass; `substitute` keeps
    it up to date."""

    def __init__(self, graph: torch.fx.Graph):
        self.written = written_roots(graph)
        self.output = graph.output_node()
        self.returned = {alias_root(n) for n in self.output.all_input_nodes}

    def substitute(self, node: torch.fx.Node, value: torch.fx.Node) -> bool:
        """Make every user of `node` read `value`, and erase what is left dead.

        Refused (False, graph unchanged) when it could change a result:
        - `node` and `value` do not share memory and either is written in place: a
          user would now see a write it did not see, or write where it did not;
        - `node`'s memory is returned and `value` is an input, an attribute or
          returned as well: outputs must not alias inputs or each other, since the
          caller may write into them;
        - the layouts differ, unless `value` is contiguous, `node` is laid out in
          row-major order (like a slice), `node` is not returned and nothing reads
          its storage (`as_strided`): views of it then still apply, and ops that
          follow their input's layout produce the same layout as before.
        """
        node_root, value_root = alias_root(node), alias_root(value)
        outputs = self.output.all_input_nodes
        if node_root is not value_root:
            if node_root in self.written or value_root in self.written:
                return False
            if node_root in self.returned and (value_root in self.returned
                                               or value_root.op in ("placeholder", "get_attr")):
                return False
        elif node in outputs and (value.op in ("placeholder", "get_attr") or value in outputs):
            return False
        if not same_layout(node, value) and not self._layout_free(node, value):
            return False
        if node_root in self.returned:
            self.returned.add(value_root)
        node.replace_all_uses_with(value)
        erase_dead(node)
        return True

    def replace_with(self, node: torch.fx.Node, target: object, args: tuple,
                     kwargs: dict | None = None) -> bool:
        """Substitute a new `target(*args, **kwargs)` node for `node`. The caller
        guarantees it computes the same value in the same layout: it takes `node`'s
        meta (its fake value) as it is."""
        graph = node.graph
        with graph.inserting_before(node):
            new = graph.call_function(target, args, kwargs or {})
        new.meta = dict(node.meta)
        if self.substitute(node, new):
            return True
        graph.erase_node(new)
        return False

    def _layout_free(self, node: torch.fx.Node, value: torch.fx.Node) -> bool:
        va, vn = value_of(value), value_of(node)
        if va is None or vn is None or va.dtype != vn.dtype or not same_sizes(va.shape, vn.shape):
            return False
        if alias_root(node) in self.returned or not is_contiguous(va) or not _row_major(vn):
            return False
        todo = list(node.users)
        while todo:  # nothing that reads node's memory may depend on its strides
            user = todo.pop()
            if user.op != "call_function" or user.target in STRIDE_READERS:
                return False
            if _returns_alias(user):
                todo.extend(user.users)
        return True


def vocabularies(gm: torch.fx.GraphModule) -> set[int]:
    """The row counts of the tables `gm` embeds token ids from: in an ATen graph
    `aten.embedding(table, ids)`, in Dynamo's `F.embedding(ids, table)`."""
    tables = [n.args[0] for n in gm.graph.find_nodes(op="call_function", target=aten.embedding.default)]
    tables += [n.args[1] for n in gm.graph.find_nodes(op="call_function", target=torch.nn.functional.embedding)]
    values = [t.meta.get("val", t.meta.get("example_value")) for t in tables if isinstance(t, torch.fx.Node)]
    return {int(v.shape[0]) for v in values if isinstance(v, torch.Tensor) and v.dim() == 2}
