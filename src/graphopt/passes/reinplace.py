"""Re-inplacing: turn functional copies back into in-place writes.

AOTAutograd's functional graphs express a write into an input (a KV-cache update
`cache[slots, pos] = k`) as an out-of-place op producing a whole new cache, and a
`copy_` of that new cache back into the input at the end of the graph: two full
copies of the buffer per write. The in-place form writes only the new rows.

The same graphs compute every intermediate into a new buffer; where the input of an
elementwise op dies at that op, writing the result over it saves the allocation and
shortens what the memory plan has to hold (`reinplace_intermediates`).

torch.fx.passes.reinplace is used for what it gets right: which in-place overload
matches a functional op's schema (through `inplace_variant`). Its `reinplace()`
itself is not used, because on these graphs it is unsound or cannot run: it fails on
graphs with tensor constants (it re-runs the graph on fresh fake inputs, and
`get_attr` values are real), and if it ran it would write into them; it compares
numel, not strides, so a later `view` could see another layout; it rewrites
`add(a, a.t())` into `a.add_(a.t())`, which raises on overlapping memory; it rewrites
random ops (`bernoulli` into `bernoulli_`); and it re-derives aliasing from
fake-tensor storages, which the passes before it do not keep up to date. Here
aliasing comes from op schemas over the graph (`memory_plan.storages`).
"""

from __future__ import annotations

import functools

import torch
import torch.fx

from .._compat import ops
from .._compat.names import OpOverload
from .._compat.shapes import known_true, same_shape, same_sizes
from .base import PassResult, has_effect, is_collective, is_contiguous, is_view
from .memory_plan import Storage, storages

aten = torch.ops.aten

# Views through which a write can be re-inplaced: view op -> the scatter op that
# functionalization emits to write a view's new value back into its base.
_SCATTER_OF_VIEW = {
    aten.select.int: aten.select_scatter.default,
    aten.slice.Tensor: aten.slice_scatter.default,
}


@functools.cache
def inplace_variant(target: object) -> OpOverload | None:
    """aten.add.Tensor -> aten.add_.Tensor, when torch has that overload and it
    mutates its first argument; else torch's own schema-matched choice
    (aten.pow.Tensor_Scalar -> aten.pow_.Scalar)."""
    if not isinstance(target, OpOverload) or target.namespace != "aten":
        return None
    packet = getattr(aten, target._schema.name.split("::")[1] + "_", None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    if overload is None:
        return ops.inplace_overload(target)
    args = overload._schema.arguments
    if not args or args[0].alias_info is None or not args[0].alias_info.is_write:
        return ops.inplace_overload(target)
    return overload


def _readers(value: torch.fx.Node) -> list[torch.fx.Node]:
    """Nodes that read `value`'s memory: its users, and the users of its views."""
    found, todo = [], list(value.users)
    while todo:
        user = todo.pop()
        found.append(user)
        if is_view(user):
            todo.extend(user.users)
    return found


def _writable_chain(base: torch.fx.Node, last: torch.fx.Node, order: dict[torch.fx.Node, int],
                    epilogue: set[torch.fx.Node]) -> list[torch.fx.Node] | None:
    """The ops base -> x1 -> ... -> last, each taking the previous value as its first
    argument, if every one has an in-place variant and nobody reads a value after
    the op that would overwrite it (the `epilogue` nodes being removed aside).
    None when the chain cannot be written in place."""
    chain = [last]
    while chain[-1].args and chain[-1].args[0] is not base:
        prev = chain[-1].args[0]
        if not isinstance(prev, torch.fx.Node) or prev.op != "call_function":
            return None
        chain.append(prev)
    chain.reverse()
    source = base
    for op in chain:
        if op.op != "call_function" or inplace_variant(op.target) is None \
                or not op.args or op.args[0] is not source:
            return None
        old, new = source.meta.get("val"), op.meta.get("val")
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)
                and old.dtype == new.dtype and same_shape(old, new)):
            return None
        if any(order[r] > order[op] for r in _readers(source) if r not in chain and r not in epilogue):
            return None
        source = op
    return chain


def _make_inplace(graph: torch.fx.Graph, chain: list[torch.fx.Node], target: torch.fx.Node) -> None:
    """Rewrite each op of the chain as its in-place variant writing into `target`."""
    for op in chain:
        with graph.inserting_before(op):
            write = graph.call_function(inplace_variant(op.target), (target, *op.args[1:]), op.kwargs)
        write.meta = dict(op.meta)
        op.replace_all_uses_with(write)
        graph.erase_node(op)


def reinplace_input_mutations(gm: torch.fx.GraphModule) -> PassResult:
    """Write input mutations in place instead of copying the whole input back.

        before:  index_put = aten.index_put(cache, [slots, pos], k)
                 ... reads of index_put ...
                 copy_ = aten.copy_(cache, index_put)
        after:   index_put_ = aten.index_put_(cache, [slots, pos], k)
                 ... reads of index_put_ (== cache) ...

    A write through a view, as functionalization spells it, is handled too:

        before:  select = aten.select(cache, 0, i);  index_put = aten.index_put(select, idx, v)
                 select_scatter = aten.select_scatter(cache, index_put, 0, i);  aten.copy_(cache, select_scatter)
        after:   select = aten.select(cache, 0, i);  aten.index_put_(select, idx, v)

    Left alone when any node reads the input's old value after the write, or the op
    has no in-place variant; the `copy_` then stays and is counted as `kept`.
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    rewritten = kept = 0
    for copy in [n for n in graph.nodes if n.target is aten.copy_.default]:
        dest, value = copy.args[0], copy.args[1]
        if dest.op != "placeholder" or not isinstance(value, torch.fx.Node):
            continue
        chain, scatter = _writable_chain(dest, value, order, {copy}), None
        if chain is None and value.target in _SCATTER_OF_VIEW.values():
            scatter = value
            chain = _view_write_chain(dest, scatter, order)
        if chain is None:
            kept += 1
            continue
        if scatter is None:
            _make_inplace(graph, chain, dest)
        else:
            _make_inplace(graph, chain, chain[0].args[0])
            scatter.replace_all_uses_with(dest)
            graph.erase_node(scatter)
        copy.replace_all_uses_with(dest)
        graph.erase_node(copy)
        rewritten += 1
        order = {n: i for i, n in enumerate(graph.nodes)}
    counts = {"rewritten": rewritten} if rewritten else {}
    if kept:
        counts["kept"] = kept
    return PassResult(changed=rewritten > 0, counts=counts)


def _view_write_chain(base: torch.fx.Node, scatter: torch.fx.Node,
                      order: dict[torch.fx.Node, int]) -> list[torch.fx.Node] | None:
    """For `scatter(base, new_view_value, *view_args)` whose new value was computed
    from `view(base, *view_args)`: the chain to write into that view in place."""
    if scatter.args[0] is not base or not isinstance(scatter.args[1], torch.fx.Node):
        return None
    chain_end = scatter.args[1]
    node = chain_end
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.args:
        first = node.args[0]
        if isinstance(first, torch.fx.Node) and first.args and first.args[0] is base \
                and _SCATTER_OF_VIEW.get(first.target) is scatter.target \
                and tuple(first.args[1:]) == tuple(scatter.args[2:]):
            epilogue = {scatter, *scatter.users}
            chain = _writable_chain(first, chain_end, order, epilogue)
            if chain is None:
                return None
            # The base itself must not be read after the write, except through the
            # view being written, the scatter and the final copy_.
            allowed = {first, *chain, *epilogue}
            if any(order[r] > order[chain[0]] for r in _readers(base) if r not in allowed):
                return None
            return chain
        node = first
    return None


# Functional forms of ops that change a tensor's metadata, not its values: never in place.
_METADATA_OPS = frozenset({"set", "resize", "resize_as"})


def reinplace_intermediates(gm: torch.fx.GraphModule) -> PassResult:
    """Write an op's result into its first input when that input is an intermediate
    no later op reads, through any view.

        before:  mul = aten.mul(x, 2);  relu = aten.relu(mul);  add = aten.add(relu, y)
        after:   mul = aten.mul(x, 2);  relu_ = aten.relu_(mul);  add_ = aten.add_(relu_, y)

    The written input must be memory the graph allocated: never a graph input, a
    parameter or buffer, nor a `get_attr` constant (folded constants are shared by
    every call), nor anything made by a higher-order op. The result must keep the
    input's dtype, sizes and strides (no type promotion, no growth by broadcasting,
    and the same layout for every later view), the input must cover its whole buffer
    (the buffer itself, or a contiguous view of all of it), no other argument of the
    op may share its memory, and the op must not be random or have side effects.
    Memory a collective reads or fills is never written (it may be in flight until
    the collective's `wait_tensor`, and the other ranks read it):

        before:  ar = all_reduce(h);  w = wait_tensor(ar);  add = aten.add(w, residual)
        after:   the same: `add_(w, ...)` would write into the all-reduce's buffer

    Since an output is read by the output node, after every op, memory an output
    uses is never written.

    Why not torch.fx.passes.reinplace: see the module docstring.
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    where = storages(graph)
    merged: dict[Storage, Storage] = {}  # a rewritten op's own buffer -> the buffer it writes instead

    def find(storage: Storage) -> Storage:
        while storage in merged:
            storage = merged[storage]
        return storage

    communicated = {s for node in nodes if is_collective(node)
                     for arg in (node, *node.all_input_nodes) for s in where.get(arg, ())}
    last_read = _last_reads(nodes, where, order)
    rewritten = 0
    for node in nodes:
        variant = _inplace_candidate(node)
        if variant is None:
            continue
        if not where.get(node.args[0]):
            continue
        written = find(where[node.args[0]][0])
        if written in communicated or not _can_write(node, written, find, where, last_read, order):
            continue
        with graph.inserting_before(node):
            write = graph.call_function(variant, node.args, dict(node.kwargs))
        write.meta = dict(node.meta)
        node.replace_all_uses_with(write)
        graph.erase_node(node)
        order[write], where[write] = order[node], [written]
        merged[(node, 0)] = written
        last_read[written] = max(last_read[written], last_read.get((node, 0), order[write]))
        rewritten += 1
    return PassResult(changed=rewritten > 0, counts={"inplace": rewritten} if rewritten else {})


def _last_reads(nodes: list[torch.fx.Node], where: dict, order: dict[torch.fx.Node, int]) -> dict[Storage, int]:
    """Each buffer's last reader, as its position in `nodes`."""
    last_read: dict[Storage, int] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            for storage in where.get(arg, ()):
                last_read[storage] = order[node]
    return last_read


def _inplace_candidate(node: torch.fx.Node) -> OpOverload | None:
    """The in-place overload `node` could become, judging by the op alone."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload) or has_effect(node):
        return None
    schema = target._schema
    if schema.is_mutable or len(schema.returns) != 1 or schema.returns[0].alias_info is not None \
            or target is aten._unsafe_view.default or target.overloadpacket.__name__ in _METADATA_OPS:
        return None
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    variant = inplace_variant(target)
    if variant is None or not set(node.kwargs) <= {a.name for a in variant._schema.arguments}:
        return None
    return variant


def _can_write(node: torch.fx.Node, written: Storage, find, where: dict, last_read: dict[Storage, int],
               order: dict[torch.fx.Node, int]) -> bool:
    source, index = written
    if source.op != "call_function" or not isinstance(source.target, OpOverload):
        return False  # an input, a parameter, a constant, or memory a higher-order op made
    if last_read.get(written, -1) > order[node]:
        return False  # read later, directly or through a view
    first = node.args[0]
    uses: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), uses.append)
    if uses.count(first) > 1:
        return False  # `mm(a, a)`-like ops read what they would write
    for arg in node.all_input_nodes:
        if arg is not first and any(find(s) == written for s in where.get(arg, ())):
            return False
    old, new = first.meta.get("val"), node.meta.get("val")
    base = source.meta.get("val")
    base = base[index] if isinstance(base, (list, tuple)) else base
    if not all(isinstance(v, torch.Tensor) and v.layout == torch.strided for v in (old, new, base)):
        return False
    return (old.dtype == new.dtype and old.device == new.device
            and same_shape(old, new) and same_sizes(old.stride(), new.stride()) and _covers(old, base))


def _covers(view: torch.Tensor, base: torch.Tensor) -> bool:
    """`view` is its whole buffer: laid out as the new tensor `base`, or contiguous
    over exactly its elements (a new tensor is dense)."""
    if known_true(view.storage_offset() == base.storage_offset()) and same_shape(view, base) \
            and same_sizes(view.stride(), base.stride()):
        return True
    return known_true(view.storage_offset() == 0) and known_true(view.numel() == base.numel()) \
        and is_contiguous(view)
