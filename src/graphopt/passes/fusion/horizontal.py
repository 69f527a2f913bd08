"""Horizontal fusion: the linears that read one input computed as one matmul."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from ..._compat import fake
from ..._compat.shapes import same_sizes
from ..base import GraphFacts, PassResult, alias_root, erase_dead
from ..constant_fold import FROZEN_INPUTS, fold_node
from ..quantize import role_formats
from ..strides import restrided, set_values
from . import FUSED_TAG
from .linear import DecomposedLinear, decomposed_linear

aten = torch.ops.aten


def fuse_horizontal_linear(gm: torch.fx.GraphModule) -> PassResult:
    """Compute the linears that read the same input (q/k/v projections, an MLP's
    gate and up) as one linear on their weights concatenated, then split its result.

        before:  q = aten.linear(x, wq);  k = aten.linear(x, wk);  v = aten.linear(x, wv)
        after:   qkv = aten.linear(x, _folded_0);  [q, k, v] = aten.split_with_sizes(qkv, [nq, nk, nv], -1)

    (as at the end of level 1's pipeline; the pass itself sees and writes the
    decomposed form, `mm(view(x), t(w))` or `addmm(b, ...)` then a view back, the
    one form both levels have when fusions run: recompose_linear, later at level 1,
    turns the result into the `linear` above, and Inductor lowers it at level 2.)

    Only with freeze_parameters=True: the weights and biases must be frozen
    parameters or constants, concatenated once, at optimize time, by constant
    folding (`_folded_<i>` buffers that `OptimizedModule.refresh()` recomputes after
    an in-place weight update, like every folded value). The concatenated weights
    are a copy: they take as much memory again as the weights they join, and a
    weight also used elsewhere stays as it is there. When only some linears have a
    bias, the others get zeros (adding 0 changes no value). Not fused: linears on
    different inputs, with different dtypes or with different weight formats (under int4, a
    value projection takes int8: quantize.role_formats), and groups whose split results
    cannot replace the separate ones: a split piece is a strided view, so a view
    of it that needs contiguous memory, a write into it or a graph output (eager
    returns contiguous tensors) leaves the group alone.
    """
    frozen = gm.meta.get(FROZEN_INPUTS)
    fake_mode = fake.fake_mode_of(gm)
    if not frozen or fake_mode is None:
        return PassResult(changed=False)
    facts = GraphFacts(gm.graph)
    found = [linear for node in gm.graph.nodes if (linear := decomposed_linear(node)) is not None]
    formats = role_formats(gm, {linear.mm for linear in found})
    groups: dict[tuple, list[DecomposedLinear]] = {}
    for linear in found:
        if _frozen_constants(gm, linear, frozen, facts):
            groups.setdefault((linear.x, linear.flat_in is None, formats[linear.mm]), []).append(linear)
    fused = linears = 0
    for group in groups.values():
        if len(group) > 1 and _alike(group) and _fuse(gm, group, fake_mode):
            fused += 1
            linears += len(group)
    return PassResult(changed=fused > 0, counts={"groups": fused, "linears": linears} if fused else {})


def _frozen_constants(gm: torch.fx.GraphModule, linear: DecomposedLinear, frozen: dict,
                      facts: GraphFacts) -> bool:
    """Whether weight and bias are constants that constant folding can concatenate:
    frozen parameters or tensor attributes that the graph neither writes nor returns."""
    n = linear.weight.meta["val"].shape[0]
    if linear.bias is not None and not same_sizes(linear.bias.meta["val"].shape, (n,)):
        return False  # addmm broadcasts a [1] bias too
    for node in (linear.weight, linear.bias):
        if node is None:
            continue
        if alias_root(node) in facts.written | facts.returned:
            return False
        if not (node.op == "placeholder" and node.name in frozen
                or node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.Tensor)):
            return False
    return True


def _alike(group: list[DecomposedLinear]) -> bool:
    """One dtype and device for every weight and bias (the input's, as mm requires)."""
    vals = [p.meta["val"] for linear in group for p in (linear.weight, linear.bias) if p is not None]
    return len({(v.dtype, v.device) for v in vals}) == 1


def _fuse(gm: torch.fx.GraphModule, group: list[DecomposedLinear], fake_mode: Any) -> bool:
    """Rewrite one group; False (graph unchanged) when the split results cannot
    replace the separate ones."""
    graph, first = gm.graph, group[0]
    anchor = first.mm  # the first linear in graph order: its input exists there
    order = {node: i for i, node in enumerate(graph.nodes)}
    for linear in group:
        for const in (linear.weight, linear.bias):
            if const is not None and const.op == "get_attr" and order[const] > order[anchor]:
                anchor.prepend(const)  # attributes read nothing: any place before works
    # From the real weights: in a compile after Dynamo's (level 2 started later) a frozen
    # parameter's fake value may carry a size symbol, which a graph's arguments cannot name.
    frozen = gm.meta[FROZEN_INPUTS]
    sizes = [int((frozen[w.name] if w.op == "placeholder" else getattr(gm, w.target)).shape[0])
             for w in (linear.weight for linear in group)]
    added: list[torch.fx.Node] = []

    def add(target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        with graph.inserting_before(anchor):
            node = graph.call_function(target, args, kwargs)
        added.append(node)
        fake_args, fake_kwargs = torch.fx.map_arg((args, kwargs), lambda n: n.meta["val"])
        with fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    weight = add(aten.cat.default, [linear.weight for linear in group])
    bias = None
    if any(linear.bias is not None for linear in group):
        # A zero bias shaped by its weight, so folding bounds it by the weight's size.
        bias = add(aten.cat.default, [linear.bias if linear.bias is not None
                                      else add(aten.new_zeros.default, linear.weight, [n])
                                      for linear, n in zip(group, sizes)])
    transposed = first.mm.args[-1]  # `t` at level 1, `permute` at level 2
    transposed = add(transposed.target, weight, *transposed.args[1:])
    lhs = first.mm.args[-2]
    out = add(aten.mm.default, lhs, transposed) if bias is None \
        else add(aten.addmm.default, bias, lhs, transposed)
    if first.flat_in is not None:
        shape = list(first.out.args[1])
        shape[-1] = sum(sizes)
        out = add(first.out.target, out, shape)
    split = add(aten.split_with_sizes.default, out, sizes, -1)
    pieces = [add(operator.getitem, split, i) for i in range(len(group))]
    vals = restrided(gm, {linear.out: piece.meta["val"] for linear, piece in zip(group, pieces)}, fake_mode)
    if vals is None:
        for node in reversed(added):
            graph.erase_node(node)
        return False
    split.meta[FUSED_TAG] = "horizontal_linear"
    for linear, piece in zip(group, pieces):
        linear.out.replace_all_uses_with(piece)
        del vals[linear.out]
        erase_dead(linear.out)
    set_values(vals)
    for cat in (weight, bias):
        if cat is not None:
            fold_node(gm, cat)
    return True
