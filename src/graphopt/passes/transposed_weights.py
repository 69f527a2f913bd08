"""Folded GEMM weights stored in the layout the GEMM reads (level 2, frozen weights)."""

from __future__ import annotations

import torch
import torch.fx

from .._compat import fake
from . import shared_weights
from .base import PassResult
from .constant_fold import FOLDED_RECIPES, FROZEN_INPUTS, fold_node, may_be_read

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
    it is: two copies of it would save nothing. An old value nothing else reads or shares
    memory with takes its own transpose, through one scratch buffer, instead of new memory.
    """
    recipes = gm.meta.get(FOLDED_RECIPES, {})
    stored, scratch = 0, _Scratch()
    for node in list(gm.graph.find_nodes(op="get_attr")):
        if node.target not in recipes or may_be_read(getattr(gm, node.target)) or not node.users \
                or not all(_transposed_for_gemms(u) for u in node.users):
            continue
        value = getattr(gm, node.target)
        in_place = len(node.users) == 1 and _owns_its_memory(gm, node, value)
        for permute in list(node.users):
            with gm.graph.inserting_after(permute):
                copy = gm.graph.call_function(aten.clone.default, (permute,),
                                              {"memory_format": torch.contiguous_format})
            copy.meta["val"] = permute.meta["val"].clone(memory_format=torch.contiguous_format)
            permute.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)
            compute = (lambda: scratch.transposed_in_place(value)) if in_place else None
            if fold_node(gm, copy, compute) is None:  # past folding's memory bound: a copy each call would cost
                copy.replace_all_uses_with(permute)
                gm.graph.erase_node(copy)
            else:
                stored += 1
    return PassResult(changed=stored > 0, counts={"stored": stored} if stored else {})


class _Scratch:
    """The buffer each transposing copy goes through, touched once for them all: a new
    2.5 GB of transposed weights, page by page, was most of this pass on the ~1B decoder
    (a gate/up weight took 243 ms; through warm memory and back, about 60 ms)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def transposed_in_place(self, value: torch.Tensor) -> torch.Tensor:
        """`value`'s transpose, contiguous, in `value`'s own memory (its old contents are gone)."""
        rows, cols = value.shape
        # Outside inference mode, as folding computes `value`: a buffer made under the
        # caller's inference mode would refuse the in-place copy below.
        with fake.outside_fake_mode(), torch.inference_mode(False), torch.no_grad():
            if self.buffer is None or self.buffer.numel() < value.numel() or self.buffer.dtype != value.dtype:
                self.buffer = None  # the smaller one goes before the larger one is taken
                self.buffer = torch.empty(value.numel(), dtype=value.dtype)
            through = self.buffer[:value.numel()].view(cols, rows)
            through.copy_(value.t())
            value.view(-1).copy_(through.view(-1))
            return value.view(cols, rows)


def _owns_its_memory(gm: torch.fx.GraphModule, node: torch.fx.Node, value: torch.Tensor) -> bool:
    """Whether `value` may be overwritten once `node`, its only reader, reads its transpose:
    all of its storage is its own, no other attribute of `gm`, no frozen input and no
    other graph (shared_weights.py) shares it."""
    if not value.is_contiguous() or value.storage_offset() != 0 or value.dim() != 2 \
            or value.untyped_storage().nbytes() != value.numel() * value.element_size() \
            or len(gm.graph.find_nodes(op="get_attr", target=node.target)) != 1:
        return False
    others = [*(t for name, t in gm.named_buffers() if name != node.target), *gm.parameters(),
              *gm.meta.get(FROZEN_INPUTS, {}).values()]
    return all(t.untyped_storage().data_ptr() != value.untyped_storage().data_ptr() for t in others) \
        and shared_weights.withdraw(value)  # last: it stops offering the value to other graphs


def _transposed_for_gemms(node: torch.fx.Node) -> bool:
    """`node` is the 2-D transpose of its input, and only GEMMs read it, as their weight."""
    return (node.op == "call_function" and node.target is aten.permute.default and list(node.args[1]) == [1, 0]
            and bool(node.users) and all(u.target in GEMMS and u.args[-1] is node and node not in u.args[:-1]
                                         for u in node.users))
