"""Linear-layer fusions."""

from __future__ import annotations

import torch
import torch.fx

from ..._compat import same_sizes
from ..manager import PassResult

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


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
        parts = _match(mm)
        if parts is None:
            continue
        x, weight, bias, flat_in, out = parts
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


def _match(mm: torch.fx.Node):
    """(x, weight, bias, input reshape or None, node producing the result) when
    `mm` is a decomposed linear, else None. Two forms: a reshape flattening x's
    leading dims and one restoring them, or a 2-D input used as it is."""
    if mm.op != "call_function" or mm.target not in (aten.mm.default, aten.addmm.default) or mm.kwargs:
        return None
    bias = mm.args[0] if mm.target is aten.addmm.default else None
    lhs, transposed = mm.args[-2], mm.args[-1]
    if not (isinstance(transposed, torch.fx.Node) and transposed.target is aten.t.default):
        return None
    weight = transposed.args[0]
    if _val(weight) is None or _val(weight).dim() != 2:
        return None
    if bias is not None and (_val(bias) is None or _val(bias).dim() != 1):
        return None  # addmm also broadcasts a 2-D "bias"; linear's bias is 1-D
    restore = next(iter(mm.users)) if len(mm.users) == 1 else None
    flattened = isinstance(lhs, torch.fx.Node) and lhs.target in _RESHAPES
    if flattened and restore is not None and restore.target in _RESHAPES:
        # Several linears may share one flattening view (q/k/v after CSE): it is
        # erased with its last user.
        x = lhs.args[0]
        x_val, out_val = _val(x), _val(restore)
        n, k = _val(weight).shape
        if x_val is not None and out_val is not None and x_val.dim() >= 2 \
                and same_sizes(x_val.shape[:-1], out_val.shape[:-1]) \
                and same_sizes((x_val.shape[-1], out_val.shape[-1]), (k, n)):
            return x, weight, bias, lhs, restore
    if _val(lhs) is not None and _val(lhs).dim() == 2:
        return lhs, weight, bias, None, mm
    return None


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


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
        a_val, c_val, out_val = _val(a), _val(c), _val(restore)
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
    if _val(x) is None or _val(expand) is None or not same_sizes(_val(x).shape, _val(expand).shape):
        return None
    return x, flat, expand
