"""Attention fusion: written-out `softmax(q @ kᵀ * scale + mask) @ v` -> SDPA."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from ..._compat import fake, patterns, shapes
from ..base import CASTS, PassResult, value_of
from ..strides import restrided, same_strides, set_values
from . import FUSED_ATEN_OPS, gates
from .softmax import softmax_input

aten = torch.ops.aten

SDPA_OPS = {op for op, name in FUSED_ATEN_OPS.items() if name == "scaled_dot_product_attention"}
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# A batched matmul's decomposition re-reads its operands through these only.
_LAYOUT = _RESHAPES | {aten.expand.default, aten.clone.default}
_SCALES = {aten.mul.Tensor: False, aten.mul.Scalar: False, aten.div.Tensor: True, aten.div.Scalar: True}
_NOTS = (aten.bitwise_not.default, aten.logical_not.default)
# A softmax's input is at most this many stages (scale, mask, cast) from the product.
_MAX_STAGES = 6


def fuse_attention(gm: torch.fx.GraphModule) -> PassResult:
    """Replace each written-out attention by `scaled_dot_product_attention`.

        before:  bmm = aten.bmm(view_q, view_kt);  scores = aten.view(bmm, [b, h, l, s])
                 mul = aten.mul(scores, 0.125);  add = aten.add(mul, mask);  p = aten._softmax(add, -1, False)
                 ...;  bmm_1 = aten.bmm(view_p, view_v);  out = aten.view(bmm_1, [b, h, l, d])
        after:   sdpa = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=0.125)
                 out = getitem(sdpa, 0)

    Matches `matmul(q, kᵀ)` scaled by numbers (× c, ÷ c, or q or k multiplied
    first), at most one mask (additive, of q's dtype; or `masked_fill`/`where`
    with -inf or `finfo.min`), a softmax over the last dim (optionally in float32
    between casts) and `matmul(probs, v)`, in 3-D or 4-D. k and v repeated for GQA
    (`repeat_kv`, `repeat_interleave`) go in unrepeated with `enable_gqa=True`
    where the fused kernel takes that. SDPA is traced per match, so it becomes
    the kernel the device runs (flash on CPU; flash, efficient or cuDNN on CUDA);
    where SDPA would run its unfused math fallback, nothing changes. Nor for a
    scale after the mask, a mask of another dtype, other fills, a softmax over
    another dim, float32 on CUDA without TF32 allowed, or intermediates read
    elsewhere (attention weights returned). Query rows whose keys are all masked
    may differ: eager gives NaN for -inf fills, SDPA zeros. Single-token queries
    at level 2 on the CPU are left to Inductor, which does them faster
    (`gates.sdpa_loses`), and counted as `gated`.

    A direct FX pass, not a `PatternSet`: attention comes in more forms than
    patterns can list (the variants above, times the views, expands and clones
    each matmul decomposes into, which depend on the operands' strides). Each
    matmul is read back to its logical operands, and the stages between walked.
    """
    level = gm.meta.get("graphopt_level", 1)
    decompositions = patterns.inductor_decompositions() if level == 2 else {}
    mode = fake.fake_mode_of(gm) or contextlib.nullcontext()  # SDPA is traced on the graph's values
    fused = gated = 0
    for node in list(gm.graph.nodes):  # replaced nodes stay (dead) until the end
        found = match(gm, node) if node.op == "call_function" else None
        if found is None:
            continue
        q = value_of(found.q)
        if gates.sdpa_loses(level, q.device, q.shape[-2]):
            gated += 1
            continue
        fused += _replace(gm, found, decompositions, mode)
    if fused:
        gm.graph.eliminate_dead_code()
    counts = {"scaled_dot_product_attention": fused} if fused else {}
    return PassResult(changed=fused > 0, counts={**counts, "gated": gated} if gated else counts)


@dataclass
class Found:
    q: torch.fx.Node
    k: torch.fx.Node  # [..., s, d], or kᵀ when `k_transposed`
    v: torch.fx.Node
    out: torch.fx.Node
    scale: float
    k_transposed: bool
    mask: torch.fx.Node | None
    mask_kind: str  # "add": a float mask; "keep"/"drop": where a bool mask is True
    fill: float
    internal: set  # the nodes replaced: read by each other and by `out` only
    gqa: tuple[torch.fx.Node, torch.fx.Node] | None = None  # k and v before their repeat


def match(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Found | None:
    softmax = softmax_input(node)
    walked = _scores(gm, softmax[0], _MAX_STAGES) if softmax else None
    if walked is None:
        return None
    stages, (q, kt, internal) = walked
    scale, mask, mask_kind, fill, cast = softmax[2], None, "", -math.inf, None
    for stage, kind, value in reversed(stages):  # in the order the code computes them
        if kind == "scale" and mask is None:  # SDPA scales before it masks
            scale *= value
        elif kind == "cast" and cast is None:
            cast = stage
        elif kind in ("add", "keep", "drop") and mask is None:
            (mask, fill), mask_kind = value, kind
            if kind == "drop" and mask.target in _NOTS:
                mask, mask_kind = mask.args[0], "keep"  # `~keep` only says what to drop
        else:
            return None
    if softmax[2] != 1.0 and mask_kind == "add":  # the temperature would scale the added mask too
        return None
    internal |= softmax[1] | {stage for stage, _, _ in stages}
    probs = node
    if len(probs.users) == 1 and next(iter(probs.users)).target in CASTS:
        internal.add(probs)
        probs = next(iter(probs.users))
    consumer = _consumer(probs)
    if consumer is None:
        return None
    v, out, consumer_nodes = consumer
    q, q_factor = _unscaled(q)
    k, k_transposed = _untransposed(kt)
    k, k_factor = (kt, 1.0) if k_transposed else _unscaled(k)
    found = Found(q, k, v, out, scale * q_factor * k_factor, k_transposed, mask, mask_kind, fill,
                  internal | consumer_nodes | {probs})
    found.gqa = _repeated_pair(found)
    return found if _valid(found, cast) else None


def _scores(gm: torch.fx.GraphModule, x: Any, budget: int):
    """([(node, kind, value)] from the softmax's input back, (a, b, product's nodes))
    when `x` is `a @ b` after stages, each stage tried in every reading of it."""
    product = _matmul(x) if isinstance(x, torch.fx.Node) else None
    if product is not None:
        return [], (product[0], product[1], product[2] | {x})
    for kind, source, value in score_stages(gm, x) if budget and isinstance(x, torch.fx.Node) else ():
        rest = _scores(gm, source, budget - 1)
        if rest is not None:
            return [(x, kind, value)] + rest[0], rest[1]
    return None


def score_stages(gm: torch.fx.GraphModule, node: torch.fx.Node):
    """What `node` may do to the scores on their way to the softmax: ("scale", input,
    factor), ("cast", input, None), or a mask ("add"/"keep"/"drop", input, (mask, fill))."""
    target, args = node.target, node.args
    if target in _SCALES and not node.kwargs:
        divide = _SCALES[target]
        for chain, other in [(args[0], args[1])] + ([] if divide else [(args[1], args[0])]):
            factor = number(gm, other)
            if factor and same_shape(node, chain):
                yield "scale", chain, 1.0 / factor if divide else factor
    elif target in CASTS:
        source, val = value_of(args[0]), value_of(node)
        if source is not None and val is not None and source.dtype in (torch.float16, torch.bfloat16) \
                and val.dtype == torch.float32:
            yield "cast", args[0], None
    elif target is aten.add.Tensor and not node.kwargs:
        for scores, mask in ((args[0], args[1]), (args[1], args[0])):
            if value_of(mask) is not None and value_of(mask).dtype.is_floating_point and same_shape(node, scores):
                yield "add", scores, (mask, 0.0)
    elif target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        if number(gm, args[2]) is not None and same_shape(node, args[0]):
            yield "drop", args[0], (args[1], number(gm, args[2]))
    elif target is aten.where.self:
        for kind, scores, other in (("keep", args[1], args[2]), ("drop", args[2], args[1])):
            if number(gm, other) is not None and same_shape(node, scores):
                yield kind, scores, (args[0], number(gm, other))


def number(gm: torch.fx.GraphModule, arg: Any) -> float | None:
    """`arg` as a Python number: a literal, or a one-element constant of the graph."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    if not isinstance(arg, torch.fx.Node):
        return None
    if arg.target is aten.scalar_tensor.default:
        return number(gm, arg.args[0])
    if arg.target is aten.full.default and list(arg.args[0]) == []:
        return number(gm, arg.args[1])
    value = getattr(gm, arg.target, None) if arg.op == "get_attr" else None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not fake.is_fake(value):
        with fake.outside_fake_mode():  # passes may run inside the graph's fake mode
            return float(value.item())
    return None


def same_shape(a: Any, b: Any) -> bool:
    va, vb = value_of(a), value_of(b)
    return va is not None and vb is not None and shapes.same_shape(va, vb)


def _matmul(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, set] | None:
    """(a, b, the product's nodes) when `node` is `matmul(a, b)` of two tensors of its
    rank, 3-D or 4-D: a `bmm`, or one in a batched matmul's decomposition."""
    out = value_of(node)
    if out is None or out.dim() not in (3, 4):
        return None
    if node.target is aten.matmul.default:
        a, b = node.args
        if all(value_of(t) is not None and value_of(t).dim() == out.dim() for t in (a, b)):
            return a, b, set()
        return None
    bmm = node.args[0] if node.target in _RESHAPES else node
    if not isinstance(bmm, torch.fx.Node) or bmm.target is not aten.bmm.default or value_of(bmm) is None \
            or value_of(bmm.args[0]) is None or (bmm is not node and len(bmm.users) != 1) \
            or (bmm is node and out.dim() != 3) or not shapes.same_sizes(value_of(bmm).shape[1:], out.shape[-2:]):
        return None
    batch, (rows, cols), inner = tuple(out.shape[:-2]), out.shape[-2:], value_of(bmm.args[0]).shape[-1]
    a, b = _logical(bmm.args[0], batch + (rows, inner)), _logical(bmm.args[1], batch + (inner, cols))
    return None if a is None or b is None else (a, b, {bmm} - {node})


def _logical(operand: torch.fx.Node, shape: tuple) -> torch.fx.Node | None:
    """The earliest value of `shape` in the reshape/expand/clone chain feeding
    `operand`. The chain keeps the element count (a broadcasting expand would grow
    it), so that value read in row-major order is the operand."""
    found, node = None, operand
    while isinstance(node, torch.fx.Node):
        if value_of(node) is not None and shapes.same_sizes(value_of(node).shape, shape):
            found = node
        if node.target not in _LAYOUT:
            break
        node = node.args[0]
    return found


def _consumer(probs: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, set] | None:
    """(v, output, product's nodes) when `probs`' one reader chain is `probs @ v`."""
    node, chain = probs, set()
    while len(node.users) == 1 and value_of(probs) is not None:
        user = next(iter(node.users))
        if user.target in (aten.bmm.default, aten.matmul.default) and user.args[0] is node:
            output = user
            if user.target is aten.bmm.default and value_of(probs).dim() == 4:
                output = next(iter(user.users)) if len(user.users) == 1 else user
            product = _matmul(output)
            if product is None or product[0] is not probs:
                return None
            return product[1], output, chain | product[2]
        if user.target not in _LAYOUT:
            return None
        chain.add(user)
        node = user
    return None


def _unscaled(node: torch.fx.Node) -> tuple[torch.fx.Node, float]:
    """(x, c) for an `x * c` or `x / c` that nothing else reads, else (node, 1)."""
    if node.target in (aten.mul.Tensor, aten.div.Tensor) and len(node.users) == 1 and not node.kwargs:
        x, c = node.args
        if isinstance(x, torch.fx.Node) and isinstance(c, (int, float)) and not isinstance(c, bool) and c:
            return x, float(c) if node.target is aten.mul.Tensor else 1.0 / c
    return node, 1.0


def _untransposed(kt: torch.fx.Node) -> tuple[torch.fx.Node, bool]:
    """(k, False) when `kt` swaps k's last two dims, else (kt, True)."""
    rank = value_of(kt).dim() if value_of(kt) is not None else 0
    if rank and (kt.target is aten.transpose.int and {d % rank for d in kt.args[1:]} == {rank - 2, rank - 1}
                 or kt.target is aten.permute.default
                 and [d % rank for d in kt.args[1]] == [*range(rank - 2), rank - 1, rank - 2]):
        return kt.args[0], False
    return kt, True


def repeated(node: torch.fx.Node) -> tuple[torch.fx.Node, int] | None:
    """(x, n) when `node` is x [b, h, s, d] with each head repeated n times, as
    repeat_kv and repeat_interleave decompose: `unsqueeze(x, 2).expand(b, h, n, s, d)`
    reshaped to [b, h * n, s, d]."""
    expand = node.args[0] if node.target in _RESHAPES else None
    if isinstance(expand, torch.fx.Node) and expand.target is aten.clone.default:
        expand = expand.args[0]
    if not (isinstance(expand, torch.fx.Node) and expand.target is aten.expand.default
            and expand.args[0].target is aten.unsqueeze.default and expand.args[0].args[1] in (2, -3)):
        return None
    x, sizes = expand.args[0].args[0], getattr(value_of(expand), "shape", ())
    if value_of(x) is None or value_of(x).dim() != 4 or len(sizes) != 5 or not isinstance(sizes[2], int) \
            or value_of(node) is None:
        return None
    b, h, s, d = value_of(x).shape
    if not (shapes.same_sizes(sizes, (b, h, sizes[2], s, d))
            and shapes.same_sizes(value_of(node).shape, (b, h * sizes[2], s, d))):
        return None
    return x, sizes[2]


def _repeated_pair(found: Found) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    k, v = (None, None) if found.k_transposed else (repeated(found.k), repeated(found.v))
    return (k[0], v[0]) if k is not None and v is not None and k[1] == v[1] else None


def _valid(found: Found, cast: torch.fx.Node | None) -> bool:
    q, k, v, out, mask = (value_of(n) for n in (found.q, found.k, found.v, found.out, found.mask))
    if q is None or k is None or v is None or out is None or not math.isfinite(found.scale):
        return False
    if not (q.dtype == k.dtype == v.dtype == out.dtype and q.dtype.is_floating_point
            and q.device == k.device == v.device):
        return False
    if cast is not None and q.dtype != getattr(value_of(cast.args[0]), "dtype", None):
        return False
    if q.device.type == "cuda" and q.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return False  # CUDA's fused kernels multiply float32 in TF32, which is not allowed
    # Fills SDPA reproduces: -inf, and finfo.min as an additive mask of it.
    dtype, fills = ((q.dtype, (0.0,)) if found.mask_kind == "add"
                    else (torch.bool, (-math.inf, torch.finfo(q.dtype).min)))
    if found.mask is not None and (mask is None or mask.device != q.device or mask.dim() > q.dim()
                                   or mask.dtype != dtype or found.fill not in fills):
        return False
    return all(set(n.users) <= found.internal | {found.out} for n in found.internal)


def _replacement(found: Found, gqa: bool):
    rank3 = value_of(found.q).dim() == 3

    def attention(q, k, v, mask=None):
        k = k.transpose(-2, -1) if found.k_transposed else k
        if rank3:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if mask is not None and found.fill == -math.inf:
            mask = mask if found.mask_kind == "keep" else mask.logical_not()
        elif mask is not None and found.mask_kind != "add":  # finfo.min: additive, so all-masked rows agree
            mask = (mask if found.mask_kind == "drop" else mask.logical_not()).to(q.dtype) * found.fill
        extra = {"enable_gqa": True} if gqa else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=found.scale, **extra)
        return out.squeeze(0) if rank3 else out

    return attention


def _trace(found: Found, decompositions: dict, mode: Any) -> tuple[torch.fx.GraphModule, list] | None:
    """SDPA traced for the match's values (with k and v unrepeated first, where the
    fused kernel takes GQA), or None when it would run unfused."""
    mask = [] if found.mask is None else [found.mask]
    choices = [(True, [found.q, *found.gqa])] if found.gqa else []
    for gqa, inputs in choices + [(False, [found.q, found.k, found.v])]:
        values = [value_of(n) for n in inputs + mask]
        try:
            with mode:
                traced = patterns.trace_forward(_replacement(found, gqa), values, decompositions)
        except Exception:  # noqa: BLE001 - what SDPA cannot trace (e.g. without enable_gqa) is not fused
            continue
        if any(n.target in SDPA_OPS for n in traced.graph.nodes):
            return traced, inputs + mask
    return None


def _replace(gm: torch.fx.GraphModule, found: Found, decompositions: dict, mode: Any) -> bool:
    traced = _trace(found, decompositions, mode)
    if traced is None:
        return False
    traced, inputs = traced
    graph, out = gm.graph, value_of(found.out)
    result = value_of(next(n for n in traced.graph.nodes if n.op == "output").args[0])
    # SDPA's result may have other strides than the product: the nodes downstream take them.
    changed = {found.out: result} if same_strides(result, out) else restrided(gm, {found.out: result}, mode)
    copied = dict(zip((n for n in traced.graph.nodes if n.op == "placeholder"), inputs))
    with graph.inserting_before(found.out):
        new = graph.graph_copy(traced.graph, copied)
        if changed is None:  # a reader needs the product's layout: give SDPA's result that
            new = graph.call_function(aten.clone.default, (new,), {"memory_format": torch.contiguous_format})
            new.meta["val"] = out
    for node in [n for t, n in copied.items() if t.op != "placeholder"] + [new]:
        node.meta.setdefault("stack_trace", found.out.meta.get("stack_trace"))
    found.out.replace_all_uses_with(new)
    if changed is not None:
        del changed[found.out]
        set_values(changed)
    return True
