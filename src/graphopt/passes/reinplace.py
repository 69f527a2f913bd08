"""Re-inplacing: turn functional copies back into in-place writes.

AOTAutograd's functional graphs express a write into an input (a KV-cache update
`cache[slots, pos] = k`) as an out-of-place op producing a whole new cache, and a
`copy_` of that new cache back into the input at the end of the graph: two full
copies of the buffer per write. The in-place form writes only the new rows.
"""

from __future__ import annotations

import torch
import torch.fx

from .._compat import same_shape
from .manager import PassResult

aten = torch.ops.aten

# Views through which a write can be re-inplaced: view op -> the scatter op that
# functionalization emits to write a view's new value back into its base.
_SCATTER_OF_VIEW = {
    aten.select.int: aten.select_scatter.default,
    aten.slice.Tensor: aten.slice_scatter.default,
}


def inplace_variant(target: object) -> torch._ops.OpOverload | None:
    """aten.add.Tensor -> aten.add_.Tensor, when torch has that overload and it
    mutates its first argument."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    packet = getattr(aten, target._schema.name.split("::")[1] + "_", None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    if overload is None:
        return None
    args = overload._schema.arguments
    if not args or args[0].alias_info is None or not args[0].alias_info.is_write:
        return None
    return overload


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and bool(target._schema.returns) and target._schema.returns[0].alias_info is not None
            and not target._schema.is_mutable)


def _readers(value: torch.fx.Node) -> list[torch.fx.Node]:
    """Nodes that read `value`'s memory: its users, and the users of its views."""
    found, todo = [], list(value.users)
    while todo:
        user = todo.pop()
        found.append(user)
        if _is_view(user):
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
