"""A packed GEMM weight made from the weights in one graph, with the copies on the way
left out (frozen_code.py makes the constants of a stored level-2 graph with it).

The C++ GEMM template packs a folded value, so its weight is made by two graphs: the
fold's recipe, then the template's packing, each ending in a copy. Composed and
simplified, a weight is copied once less or twice less; on the ~1B decoder that is
gigabytes of copying a start does not do:

    before:  cat = cat([wq, wk, wv]); t = permute(cat); f = clone(t)         (the fold)
             v = as_strided(f, f's own geometry); p = constant_pad_nd(v, [0, 0])
             b = view(p, blocks); bt = transpose(b); out = clone(bt)          (the packing)
    after:   cat = cat([wq, wk, wv]); t = permute(cat)
             b = reshape(t, blocks); bt = transpose(b); out = clone(bt)

Each rewrite keeps every value: padding by nothing and viewing a tensor as itself
change nothing, and a copy read only through views into a later copy reads the same
elements as the tensor it copied (a `view` of it becomes a `reshape`, which copies
where the tensor's strides need it).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.passes.shape_prop import ShapeProp

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten.transpose.int, aten.permute.default,
          aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim}
_COPIES = {aten.clone.default, aten.contiguous.default}


def composed(recipe: torch.fx.GraphModule, geometry: tuple, packing: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`packing(recipe(*weights).as_strided(*geometry))` as one graph taking the recipe's
    placeholders, simplified (module docstring)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in recipe.graph.nodes:
        if node.op == "output":
            folded = env[node.args[0]]
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    viewed = graph.call_function(aten.as_strided.default, (folded, *geometry))
    for node in packing.graph.nodes:
        if node.op == "placeholder":
            env[node] = viewed
        elif node.op == "output":
            graph.output(env[node.args[0]])
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    return torch.fx.GraphModule({**_attributes(recipe), **_attributes(packing)}, graph)


def simplify(gm: torch.fx.GraphModule, weights: list[torch.Tensor]) -> torch.fx.GraphModule:
    """The module docstring's rewrites on `gm`, which `weights` (real or meta) would be
    given: their shapes decide which views are identities."""
    ShapeProp(gm).propagate(*[torch.empty_strided(w.shape, w.stride(), dtype=w.dtype, device="meta")
                              for w in weights])
    for node in list(gm.graph.nodes):
        if _no_padding(node) or _views_itself(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    for node in list(gm.graph.nodes):
        chain = _copied_again(node)
        if chain is not None:
            for view in chain:
                if view.target is aten.view.default:
                    view.target = aten.reshape.default
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _no_padding(node: torch.fx.Node) -> bool:
    return node.target is aten.constant_pad_nd.default and not any(node.args[1])


def _views_itself(node: torch.fx.Node) -> bool:
    """An as_strided of a fresh contiguous copy with that copy's own geometry."""
    if node.target is not aten.as_strided.default:
        return False
    source, size, stride = node.args[:3]
    offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
    meta = source.meta.get("tensor_meta") if isinstance(source, torch.fx.Node) else None
    return (source.target in _COPIES and meta is not None and offset in (0, None)
            and tuple(size) == tuple(meta.shape) and tuple(stride) == tuple(meta.stride)
            and tuple(meta.stride) == _contiguous_strides(tuple(meta.shape)))


def _copied_again(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The views between the copy `node` and the one later copy that alone reads it
    through them, or None where `node` is not such a copy."""
    if node.target not in _COPIES:
        return None
    chain, current = [], node
    while len(current.users) == 1:
        (user,) = current.users
        if user.target in _COPIES and user.kwargs.get("memory_format", torch.contiguous_format) in (
                torch.contiguous_format, None):
            return chain
        if user.target not in _VIEWS or user.args[0] is not current:
            return None
        chain.append(user)
        current = user
    return None


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _attributes(gm: torch.fx.GraphModule) -> dict:
    return {str(n.target): operator.attrgetter(str(n.target))(gm) for n in gm.graph.find_nodes(op="get_attr")}
