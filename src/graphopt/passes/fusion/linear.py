"""Linear-layer fusions: linears and batched matmuls recomposed from AOTAutograd's
decomposition, and materialised transposes folded into the matmul that reads them."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.fx

from ..._compat import fake
from ..._compat.shapes import known_true, same_sizes
from ..base import GraphFacts, PassResult, alias_root, value_of
from ..strides import fake_run, restrided, set_values

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
# matmul op -> positions of its two matrix operands.
_MATMUL_OPERANDS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2),
                    aten.bmm.default: (0, 1), aten.baddbmm.default: (1, 2)}
_TRANSPOSES = (aten.t.default, aten.transpose.int, aten.permute.default)


class DecomposedLinear(NamedTuple):
    """A linear as AOTAutograd (level 1, `t`) or Inductor (level 2, `permute`)
    decomposes it: `out = restore(mm(flat_in(x), t(weight)))`, or `out = mm(x, t(weight))`
    for a 2-D x (flat_in None); `addmm(bias, ...)` with a bias."""

    x: torch.fx.Node
    weight: torch.fx.Node
    bias: torch.fx.Node | None
    flat_in: torch.fx.Node | None
    mm: torch.fx.Node
    out: torch.fx.Node


def recompose_linear(gm: torch.fx.GraphModule) -> PassResult:
    """Fold AOTAutograd's decomposition of `nn.Linear` back into one `linear` call.

        before:  t = aten.t(w);  view = aten.view(x, [b*s, k]);  mm = aten.mm(view, t)
                 y = aten._unsafe_view(mm, [b, s, n])
        after:   y = aten.linear(x, w)

    `addmm(bias, view, t)` becomes `linear(x, w, bias)`. Only for a 2-D weight, an
    input reshape that flattens exactly the leading dims and an output reshape that
    restores them, and intermediates nobody else reads. Run as FX code, one `linear`
    is one call where the decomposition is four (level 1 only: Inductor lowers the
    decomposed form itself).
    """
    graph = gm.graph
    fused = 0
    for mm in list(graph.nodes):
        parts = decomposed_linear(mm)
        if parts is None:
            continue
        x, weight, bias, flat_in, mm, out = parts
        with graph.inserting_before(out):
            linear = graph.call_function(aten.linear.default, (x, weight) if bias is None else (x, weight, bias))
        linear.meta = dict(out.meta)
        out.replace_all_uses_with(linear)
        transposed = mm.args[-1]
        for dead in dict.fromkeys((out, mm, flat_in, transposed)):
            if dead is not None and not dead.users:
                graph.erase_node(dead)
        fused += 1
    return PassResult(changed=fused > 0, counts={"linear": fused} if fused else {})


def decomposed_linear(mm: torch.fx.Node) -> DecomposedLinear | None:
    """The parts of the linear `mm` computes, or None when it is not a decomposed
    linear. Two forms: a reshape flattening x's leading dims and one restoring them,
    or a 2-D input used as it is."""
    if mm.op != "call_function" or mm.target not in (aten.mm.default, aten.addmm.default) or mm.kwargs:
        return None
    bias = mm.args[0] if mm.target is aten.addmm.default else None
    lhs, transposed = mm.args[-2], mm.args[-1]
    if not (isinstance(transposed, torch.fx.Node) and (
            transposed.target is aten.t.default
            or transposed.target is aten.permute.default and list(transposed.args[1]) == [1, 0])):
        return None
    weight = transposed.args[0]
    if value_of(weight) is None or value_of(weight).dim() != 2:
        return None
    if bias is not None and (value_of(bias) is None or value_of(bias).dim() != 1):
        return None  # addmm also broadcasts a 2-D "bias"; linear's bias is 1-D
    restore = next(iter(mm.users)) if len(mm.users) == 1 else None
    flattened = isinstance(lhs, torch.fx.Node) and lhs.target in _RESHAPES
    if flattened and restore is not None and restore.target in _RESHAPES:
        # Several linears may share one flattening view (q/k/v after CSE): it is
        # erased with its last user.
        x = lhs.args[0]
        x_val, out_val = value_of(x), value_of(restore)
        n, k = value_of(weight).shape
        if x_val is not None and out_val is not None and x_val.dim() >= 2 \
                and same_sizes(x_val.shape[:-1], out_val.shape[:-1]) \
                and same_sizes((x_val.shape[-1], out_val.shape[-1]), (k, n)):
            return DecomposedLinear(x, weight, bias, lhs, mm, restore)
    if value_of(lhs) is not None and value_of(lhs).dim() == 2:
        return DecomposedLinear(lhs, weight, bias, None, mm, mm)
    return None


def fuse_matmul_transpose(gm: torch.fx.GraphModule) -> PassResult:
    """Give a matmul the transposed view of its operand instead of a contiguous copy.

        before:  t = aten.t(w);  c = aten.clone(t, memory_format=torch.contiguous_format)
                 y = aten.mm(x, c)
        after:   t = aten.t(w);  y = aten.mm(x, t)

    `.t().contiguous()`, `.transpose(-1, -2).contiguous()`, `.mT.contiguous()` and
    `.permute(...).contiguous()` (or `.clone()`) copy an operand into a new layout
    that BLAS does not need: it reads a column-major matrix as it is (a transpose
    flag). Any operand of mm, addmm, bmm or baddbmm, directly or through the
    expand/reshape chain AOTAutograd and Inductor put before a batched matmul. Only
    when every reader of the copy is such a matmul, each reshape on the way is still
    a view of the uncopied strides, each matrix the matmul reads is row- or
    column-major (else it would copy it itself), and the source is not written in
    place (the copy would be a snapshot).

    With freeze_parameters=True the copied transpose of a weight is no run-time op
    to begin with: constant folding, which runs before the fusions, has made it a
    constant (`mm(x, _folded_0)`, refreshed with the weight).

    Reading the view is faster than the copy at every shape measured, most where
    the copy is large (docs/fusion.md, "A copied transpose before a matmul").
    """
    fake_mode = fake.fake_mode_of(gm)
    if fake_mode is None:  # strides cannot be checked
        return PassResult(changed=False)
    facts = GraphFacts(gm.graph)
    folded = 0
    for clone in list(gm.graph.nodes):
        if clone.target is not aten.clone.default:
            continue
        source = clone.args[0]
        if not (isinstance(source, torch.fx.Node) and source.target in _TRANSPOSES
                and value_of(source) is not None and alias_root(source) not in facts.written):
            continue
        chain = _matmul_chain(clone)
        if chain is None:
            continue
        vals = restrided(gm, {clone: value_of(source)}, fake_mode)
        if vals is None or not all(_blas_ready(vals.get(n, value_of(n))) and _still_view(n, vals, fake_mode)
                                   for n in chain):
            continue
        clone.replace_all_uses_with(source)
        gm.graph.erase_node(clone)
        del vals[clone]
        set_values(vals)
        folded += 1
    return PassResult(changed=folded > 0, counts={"copies_removed": folded} if folded else {})


def _matmul_chain(clone: torch.fx.Node) -> list[torch.fx.Node] | None:
    """Every node of the chains from `clone` to the matmuls reading it (clone,
    expands, reshapes), or None unless all its readers lead to a matmul operand."""
    chain, todo = [], [clone]
    while todo:
        node = todo.pop()
        chain.append(node)
        for user in node.users:
            positions = _MATMUL_OPERANDS.get(user.target)
            if positions is not None and not user.kwargs \
                    and all(i in positions for i, a in enumerate(user.args) if a is node):
                continue
            if user.target not in (aten.expand.default, *_RESHAPES) or user.args[0] is not node:
                return None
            todo.append(user)
    return chain


def _blas_ready(val: torch.Tensor) -> bool:
    """Whether each matrix of `val` (its last two dims) is row- or column-major."""
    if val.dim() < 2:
        return True
    rows, cols = val.shape[-2:]
    row_stride, col_stride = val.stride()[-2:]
    return (known_true(col_stride == 1) and known_true(row_stride >= cols)) \
        or (known_true(row_stride == 1) and known_true(col_stride >= rows))


def _still_view(node: torch.fx.Node, vals: dict, fake_mode: Any) -> bool:
    """A reshape copies where a view cannot express it: it must stay a view."""
    return node.target not in _RESHAPES or fake_run(node, vals, fake_mode, aten.view.default) is not None


def recompose_matmul(gm: torch.fx.GraphModule) -> PassResult:
    """Fold AOTAutograd's decomposition of a batched `matmul` back into one call.

        before:  ea = aten.expand(a, [b, h, m, k]);  va = aten.view(ea, [b*h, m, k])
                 eb = aten.expand(c, [b, h, k, n]);  vb = aten.view(eb, [b*h, k, n])
                 bmm = aten.bmm(va, vb);  y = aten.view(bmm, [b, h, m, n])
        after:   y = aten.matmul(a, c)

    Only when both expands are no-ops (no broadcasting), both operands have the
    same rank >= 3, and the views only flatten and restore the batch dims.
    """
    graph = gm.graph
    fused = 0
    for bmm in list(graph.nodes):
        if bmm.op != "call_function" or bmm.target is not aten.bmm.default or len(bmm.users) != 1:
            continue
        restore = next(iter(bmm.users))
        operands = [_unflattened(arg) for arg in bmm.args]
        if restore.target not in _RESHAPES or None in operands:
            continue
        (a, *a_chain), (c, *c_chain) = operands
        a_val, c_val, out_val = value_of(a), value_of(c), value_of(restore)
        if not (a_val.dim() == c_val.dim() == out_val.dim() >= 3
                and same_sizes(a_val.shape[:-2], out_val.shape[:-2])
                and same_sizes(c_val.shape[:-2], out_val.shape[:-2])):
            continue
        with graph.inserting_before(restore):
            matmul = graph.call_function(aten.matmul.default, (a, c))
        matmul.meta = dict(restore.meta)
        restore.replace_all_uses_with(matmul)
        for dead in (restore, bmm, *a_chain, *c_chain):
            if not dead.users:
                graph.erase_node(dead)
        fused += 1
    return PassResult(changed=fused > 0, counts={"matmul": fused} if fused else {})


def _unflattened(flat: object) -> tuple | None:
    """For `view(expand(x, x.shape), [batch, r, c])`: (x, view, expand)."""
    if not (isinstance(flat, torch.fx.Node) and flat.target in _RESHAPES and len(flat.users) == 1):
        return None
    expand = flat.args[0]
    if not (isinstance(expand, torch.fx.Node) and expand.target is aten.expand.default
            and len(expand.users) == 1):
        return None
    x = expand.args[0]
    if value_of(x) is None or value_of(expand) is None or not same_sizes(value_of(x).shape, value_of(expand).shape):
        return None
    return x, flat, expand
