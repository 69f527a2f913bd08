"""Linears on weights packed once for oneDNN, with the activation that follows as a
post-op (frozen weights, CPU, float32 or native bfloat16, level 1).

`aten.linear` hands MKL a plain weight at every call; oneDNN's kernel on a weight
reordered once into its blocked layout, with the GELU or ReLU applied as the result is
written, is faster than linear + GELU on BERT-base's shapes (docs/fusion.md, "Fusion
gates"), as ONNX Runtime's packed MatMul + FastGelu is; small GEMMs lose (gates.py).
"""

from __future__ import annotations

import torch
import torch.fx

from ..._compat import mkldnn, shapes
from ..base import CASTS, GraphFacts, PassResult, changes_only_dtype, erase_dead, value_of
from ..constant_fold import FROZEN_INPUTS, drop_if_unread
from . import FUSED_TAG, gates
from .conv import frozen_constant, packed_weight

aten = torch.ops.aten


def fuse_packed_linear(gm: torch.fx.GraphModule) -> PassResult:
    """Compute each linear on frozen weights, with a GELU or ReLU that alone reads it,
    as one oneDNN call on a weight packed once.

        before:  l = aten.linear(x, w, b);  g = aten.gelu(l, approximate="tanh")
        after:   g = mkldnn._linear_pointwise(x, _packed_0, b, "gelu", [], "tanh")

    with `_packed_0` = `w` reordered for oneDNN at optimize time, recomputed by
    `refresh()` (its refresh recipe); in bfloat16 also a GELU that lower_precision left
    in float32 between two casts (`_post_op`). Only with freeze_parameters=True, on the CPU, in
    float32, or in bfloat16 where the CPU multiplies it natively (`compute_dtype`'s
    linears: oneDNN reorders a plain bfloat16 weight at every call), for a 2-D weight
    and a bias (or none) that are frozen parameters or constants the graph neither
    writes nor returns, and where oneDNN is built in; not for small float32 GEMMs,
    where it loses (`gates.packed_linear_loses`, counted as `gated`).
    """
    if not gm.meta.get(FROZEN_INPUTS) or not mkldnn.available():
        return PassResult(changed=False)
    facts = GraphFacts(gm.graph)
    counts: dict[str, int] = {}
    for linear in list(gm.graph.nodes):
        if linear.op == "call_function" and linear.target is aten.linear.default:
            kind = _fuse(gm, linear, facts)
            if kind:
                counts[kind] = counts.get(kind, 0) + 1
    return PassResult(changed=bool(counts), counts=counts)


def _packs(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and mkldnn.cpu_has_native_bf16())


def _activation(node: torch.fx.Node) -> tuple[str, str] | None:
    """(unary, algorithm) of an activation oneDNN applies as a post-op, or None."""
    if node.target is aten.relu.default:
        return "relu", ""
    if node.target is aten.gelu.default and len(node.args) == 1:
        approximate = node.kwargs.get("approximate", "none")
        return ("gelu", approximate) if set(node.kwargs) <= {"approximate"} else None
    return None


def _post_op(linear: torch.fx.Node, dtype: torch.dtype) -> tuple[torch.fx.Node, str, str]:
    """(the node the fused call replaces, unary, algorithm): the activation that alone
    reads the linear; for a bfloat16 linear also one computed in float32 between two
    casts, lower_precision's spelling (a GELU is not in its table), whose result only
    goes back to bfloat16. oneDNN applies the activation to its float32 sums, so the
    fused call rounds once where the casts rounded twice.

        before:  c = convert(linear(x, w, b), f32);  g = gelu(c);  y = convert(g, bf16)
        after:   y = mkldnn._linear_pointwise(x, _packed_0, b, "gelu", [], "none")
    """
    node = linear
    if dtype == torch.bfloat16 and len(node.users) == 1 and _cast_to(next(iter(node.users)), torch.float32):
        node = next(iter(node.users))
    if len(node.users) != 1 or (post := _activation(next(iter(node.users)))) is None:
        return linear, "none", ""
    activation = next(iter(node.users))
    if node is linear:
        return activation, *post
    if len(activation.users) == 1 and _cast_to(cast := next(iter(activation.users)), dtype):
        return cast, *post
    return linear, "none", ""


def _cast_to(node: torch.fx.Node, dtype: torch.dtype) -> bool:
    """A cast to `dtype` and nothing else: lower_precision's convert_element_type, or a
    model's own `.float()` / `.to(dtype)`."""
    val = value_of(node)
    return node.target in CASTS and changes_only_dtype(node) and val is not None and val.dtype == dtype


def _fuse(gm: torch.fx.GraphModule, linear: torch.fx.Node, facts: GraphFacts) -> str:
    """Rewrite one linear (and its activation); the fused kind ("linear", "linear_gelu",
    "linear_relu"), "gated", or "" for none."""
    x, w, b = (*linear.args, None)[:3]
    xv, wv, out = value_of(x), value_of(w), value_of(linear)
    if xv is None or wv is None or out is None or linear.kwargs:
        return ""
    if not (xv.device.type == "cpu" and xv.dtype == wv.dtype and _packs(xv.dtype) and wv.dim() == 2
            and all(isinstance(s, int) for s in wv.shape) and frozen_constant(gm, w, facts)
            and (b is None or frozen_constant(gm, b, facts))):
        return ""
    rows = max(int(shapes.size_hint(xv.numel() // xv.shape[-1])), 1) if xv.dim() and xv.shape[-1] else 1
    if gates.packed_linear_loses(rows, *reversed(wv.shape), xv.dtype):
        return "gated"
    last, unary, algorithm = _post_op(linear, xv.dtype)
    with gm.graph.inserting_before(last):
        packed = packed_weight(gm, w, mkldnn.pack_linear_weight, (rows,))
        fused = gm.graph.call_function(mkldnn.linear_pointwise(), (x, packed, b, unary, [], algorithm))
    fused.meta = {**last.meta, FUSED_TAG: "linear" + (f"_{unary}" if unary != "none" else "")}
    last.replace_all_uses_with(fused)
    erase_dead(last)
    drop_if_unread(gm, w)
    return fused.meta[FUSED_TAG]
