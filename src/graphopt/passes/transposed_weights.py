"""Folded GEMM weights stored in the layout the GEMM reads (level 2, frozen weights)."""

from __future__ import annotations

import torch
import torch.fx

from .base import PassResult
from .constant_fold import FOLDED_RECIPES, fold_node, may_be_read

aten = torch.ops.aten
GEMMS = (aten.mm.default, aten.addmm.default)


def store_transposed_weights(gm: torch.fx.GraphModule) -> PassResult:
    """Store a folded weight that GEMMs read only through its transpose transposed, so
    that they read the constant itself.

        before:  w = get_attr[_folded_0];  wt = aten.permute(w, [1, 0]);  y = aten.mm(x, wt)
        after:   wt = get_attr[_folded_1];  y = aten.mm(x, wt)         # _folded_1: permute(_folded_0), contiguous

    Inductor's C++ GEMM template packs a constant weight for its micro-kernel and drops
    the original from the graph, but only a constant the GEMM reads directly: read
    through the transpose, the original stayed alive beside its packed copy (a float32
    QKV and gate/up concatenation per layer and per graph, 2.5 GB per graph on the ~1B
    decoder). Runs after the fusions and the quantization, which read the transpose as
    part of a linear. The old value and its recipe go once nothing reads them; a value
    small enough that a pass may have read it (`may_be_read`) stays, and so is left as
    it is: two copies of it would save nothing.
    """
    recipes = gm.meta.get(FOLDED_RECIPES, {})
    stored = 0
    for node in list(gm.graph.find_nodes(op="get_attr")):
        if node.target not in recipes or may_be_read(getattr(gm, node.target)) or not node.users \
                or not all(_transposed_for_gemms(u) for u in node.users):
            continue
        for permute in list(node.users):
            with gm.graph.inserting_after(permute):
                copy = gm.graph.call_function(aten.clone.default, (permute,),
                                              {"memory_format": torch.contiguous_format})
            copy.meta["val"] = permute.meta["val"].clone(memory_format=torch.contiguous_format)
            permute.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)
            if fold_node(gm, copy) is None:  # past folding's memory bound: a copy each call would cost
                copy.replace_all_uses_with(permute)
                gm.graph.erase_node(copy)
            else:
                stored += 1
    return PassResult(changed=stored > 0, counts={"stored": stored} if stored else {})


def _transposed_for_gemms(node: torch.fx.Node) -> bool:
    """`node` is the 2-D transpose of its input, and only GEMMs read it, as their weight."""
    return (node.op == "call_function" and node.target is aten.permute.default and list(node.args[1]) == [1, 0]
            and bool(node.users) and all(u.target in GEMMS and u.args[-1] is node and node not in u.args[:-1]
                                         for u in node.users))
