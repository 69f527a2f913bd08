"""Decode attention over a KV cache -> `graphopt::decode_attention`, which reads the
cache in place up to each sequence's length."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ..._compat import fake, shapes
from ...kernels import decode_attention as kernel
from ..base import PassResult, value_of
from ..strides import fake_run, restrided, same_strides, set_values
from . import gates
from .attention import SDPA_OPS, Found, match, number, repeated, same_shape

aten, prims = torch.ops.aten, torch.ops.prims

_DECODE_ATTENTION = torch.ops.graphopt.decode_attention.default
# (key index, position) order of each comparison, and whether it is True where a key is allowed.
_COMPARISONS = {aten.le.Tensor: (0, True), aten.ge.Tensor: (1, True), aten.gt.Tensor: (0, False),
                aten.lt.Tensor: (1, False)}
_NOTS = (aten.bitwise_not.default, aten.logical_not.default)
_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)


def fuse_decode_attention(gm: torch.fx.GraphModule) -> PassResult:
    """Replace attention of single-token queries over a whole cache row, masked to each
    sequence's length, by `graphopt::decode_attention`.

        before:  index = aten.index(k_cache, [slots]);  keys = repeat_kv(index.transpose(1, 2))
                 allowed = aten.le(arange(128), positions[:, :, None]);  mask = where(~allowed, finfo.min, 0)
                 p = softmax(q @ keysᵀ * scale + mask[:, None]);  out = p @ values
        after:   kt = aten.permute(k_cache, [0, 2, 1, 3]);  vt = aten.permute(v_cache, [0, 2, 1, 3])
                 out = graphopt.decode_attention(q, kt, vt, slots, positions, scale)

    Matches what `fuse_attention` matches (written out, or already SDPA). When the
    mask provably allows exactly the keys whose index is at most the query's position:
    `key_index <= position` (or `>=`, `>` and `<` turned round, negated with `~`) of an
    `arange` over the keys and an integer tensor constant along them, as an additive
    mask of 0 and -inf or `finfo.min` (`where`, `masked_fill` of zeros) or a boolean
    one; broadcast by `unsqueeze` and `expand` only, never varying across heads. That
    is the reference decoder's mask from `positions` and transformers' causal mask from
    `cache_position`, the op reads keys up to each position and nothing else. Any other
    boolean mask that is the same for every head, as it is or made additive (0 where
    True, -inf or `finfo.min` elsewhere: transformers' `generate()` passes such a mask
    in, padding and causal together), is passed to the op as `allowed`, which reads
    only the keys it lets through:

        before:  mask = where(attention_mask, 0, finfo.min);  out = sdpa(q, repeat_kv(k), repeat_kv(v), mask)
        after:   out = graphopt.decode_attention(q, k, v, None, None, scale, attention_mask.select(1, 0))

    Keys and values gathered from a cache by one index tensor
    (`k_cache[slots]`, transposed or not) are read in place through `slots`; any other
    [b, kv_heads, s, d] keys are read as they are (transformers' `StaticCache`). GQA
    repeats (`repeat_kv`) are dropped. A float mask with other values (a bias) leaves
    the graph alone. A query whose every key is masked averages its row, as eager does
    under a `finfo.min` mask (under -inf eager gives NaN). Left to `fuse_attention` and counted as
    `gated`: queries longer than one token, and the CPU without the C++ kernel
    (`gates.decode_attention_loses`).
    """
    mode = fake.fake_mode_of(gm) or contextlib.nullcontext()
    made: dict[tuple, torch.fx.Node] = {}  # positions built once per mask, shared by the layers
    fused = gated = 0
    for node in list(gm.graph.nodes):  # replaced nodes stay (dead) until the end
        found = _attention(gm, node) if node.op == "call_function" else None
        plan = _plan(gm, found) if found is not None else None
        if plan is None:
            continue
        q = value_of(found.q)
        if gates.decode_attention_loses(q.device, q.shape[-2]):
            gated += 1
            continue
        fused += _replace(gm, found, plan, made, mode)
    if fused:
        gm.graph.eliminate_dead_code()
    counts = {"decode_attention": fused} if fused else {}
    return PassResult(changed=fused > 0, counts={**counts, "gated": gated} if gated else counts)


# -- the attention: written out (fuse_attention's match) or SDPA ------------------------

def _attention(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Found | None:
    if node.target in SDPA_OPS or node.target is aten.scaled_dot_product_attention.default:
        return _sdpa(gm, node)
    found = match(gm, node)
    return None if found is None or found.k_transposed else found


def _sdpa(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Found | None:
    """An SDPA op without dropout or causal flag, whose only result read is its output."""
    args = dict(zip((a.name for a in node.target._schema.arguments), node.args)) | dict(node.kwargs)
    mask = args.get("attn_mask", args.get("attn_bias"))
    if args.get("dropout_p", 0.0) != 0.0 or args.get("is_causal", False) or not isinstance(mask, torch.fx.Node):
        return None
    out, internal = node, set()
    if node.target is not aten.scaled_dot_product_attention.default:  # (output, logsumexp, ...)
        if len(node.users) != 1 or next(iter(node.users)).args[1:] != (0,):
            return None
        out, internal = next(iter(node.users)), {node}
    q, k, v = args["query"], args["key"], args["value"]
    head_dim = getattr(value_of(q), "shape", [None])[-1]
    scale = args.get("scale") or (1.0 / math.sqrt(head_dim) if isinstance(head_dim, int) else None)
    mask_val = value_of(mask)
    if scale is None or mask_val is None:
        return None
    kind = "keep" if mask_val.dtype == torch.bool else "add"
    found = Found(q, k, v, out, float(scale), False, mask, kind, -math.inf, internal)
    found.gqa = None if args.get("enable_gqa") else _unrepeated(k, v)
    return found


def _unrepeated(k: torch.fx.Node, v: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    rk, rv = repeated(k), repeated(v)
    return (rk[0], rv[0]) if rk is not None and rv is not None and rk[1] == rv[1] else None


# -- what the op reads: cache rows and positions -----------------------------------------

@dataclass
class _Plan:
    key: tuple  # (cache, permutation or None): the key operand, [n, kv_heads, s, d] after permuting
    value: tuple
    slots: torch.fx.Node | None
    positions: tuple | None  # (integer node, unsqueezed dims, rank): see _allowed
    allowed: tuple | None  # (boolean node, unsqueezed dims, rank, polarity) without positions: see _keep


def _plan(gm: torch.fx.GraphModule, found: Found) -> _Plan | None:
    q, out = value_of(found.q), value_of(found.out)
    k, v = found.gqa or (found.k, found.v)
    kv, vv = value_of(k), value_of(v)
    if q is None or kv is None or vv is None or out is None or q.dim() != 4 or kv.dim() != 4 \
            or not (q.dtype == kv.dtype == vv.dtype == out.dtype and q.dtype.is_floating_point) \
            or q.device != kv.device or not shapes.same_shape(kv, vv) or not shapes.same_shape(q, out) \
            or not shapes.known_true(q.shape[1] % kv.shape[1] == 0) \
            or not shapes.same_sizes([q.shape[0], q.shape[3]], [kv.shape[0], kv.shape[3]]):
        return None
    positions = _positions(gm, found, kv.shape[2], q)
    allowed = _keep(gm, found, kv.shape[2], q) if positions is None else None
    if positions is None and allowed is None:
        return None
    (key, key_slots), (value, value_slots) = _cache_row(k), _cache_row(v)
    if key_slots is not value_slots:  # read both as they are
        key, key_slots, value, value_slots = (k, None), None, (v, None), None
    return _Plan(key, value, key_slots, positions, allowed)


def _cache_row(node: torch.fx.Node) -> tuple[tuple, torch.fx.Node | None]:
    """((cache, permutation), slots) when `node` [b, kv_heads, s, d] is `cache[slots]`,
    possibly with dims 1 and 2 swapped after the gather; else ((node, None), None)."""
    swapped = node.target is aten.transpose.int and sorted(d % 4 for d in node.args[1:]) == [1, 2] \
        or node.target is aten.permute.default and list(node.args[1]) == [0, 2, 1, 3]
    index = node.args[0] if swapped else node
    if index.target is aten.index.Tensor and len(index.args[1]) == 1 and isinstance(index.args[1][0], torch.fx.Node):
        slots, cache = index.args[1][0], value_of(index.args[0])
        if value_of(slots) is not None and value_of(slots).dim() == 1 and not value_of(slots).dtype.is_floating_point \
                and value_of(slots).dtype != torch.bool and cache is not None and cache.dim() == 4:
            return (index.args[0], [0, 2, 1, 3] if swapped else None), slots
    return (node, None), None


def _positions(gm: torch.fx.GraphModule, found: Found, keys: Any, q: torch.Tensor) -> tuple | None:
    """(positions node, dims to unsqueeze it at, mask rank) when the mask allows exactly
    keys 0 .. position of each query, with positions the same for every head."""
    if found.mask is None:
        return None
    if found.mask_kind == "add":
        allowed = _additive(gm, found.mask)
    else:
        allowed = _allowed(gm, found.mask)
        allowed = allowed and (allowed[0], allowed[1], allowed[2] == (found.mask_kind == "keep"))
    mask = value_of(found.mask)
    if not allowed or not allowed[2] or mask is None or not shapes.same_sizes([mask.shape[-1]], [keys]):
        return None
    position, dims = allowed[0], allowed[1]
    shape = list(value_of(position).shape)  # the positions, unsqueezed as the mask was
    for d in dims:
        shape.insert(d, 1)
    rank = len(shape)
    padded = [1] * (4 - rank) + shape  # aligned with the scores [b, h, t, s]
    if rank > 4 or not all(shapes.known_true(padded[i] == 1) or shapes.same_sizes([padded[i]], [q.shape[i]])
                           for i in (0, 2)) or not shapes.known_true(padded[1] == 1):
        return None
    return position, tuple(dims), rank


def _keep(gm: torch.fx.GraphModule, found: Found, keys: Any, q: torch.Tensor) -> tuple | None:
    """(boolean node, dims to unsqueeze it at, rank, polarity) when the mask is that
    node (True: allowed, with polarity True) as it is, or made additive by `where` or
    `masked_fill`, possibly unsqueezed, and it is the same for every head: [b or 1, 1,
    t or 1, keys], aligned from the right."""
    mask, dims = _whole(found.mask), []
    while mask is not None and mask.target is aten.unsqueeze.default and value_of(mask) is not None:
        dims.insert(0, mask.args[1] % value_of(mask).dim())
        mask = _whole(mask.args[0])
    if mask is None:
        return None
    if found.mask_kind == "add":
        keep = _additive_condition(gm, mask)
    else:
        keep = mask, found.mask_kind == "keep"
    val = value_of(keep[0]) if keep else None
    if val is None or val.dtype != torch.bool:
        return None
    shape = list(val.shape)
    for d in dims:
        shape.insert(d, 1)
    if len(shape) > 4 or not shapes.same_sizes([shape[-1]], [keys]):
        return None
    padded = [1] * (4 - len(shape)) + shape
    if not (shapes.known_true(padded[1] == 1) and all(
            shapes.known_true(padded[i] == 1) or shapes.same_sizes([padded[i]], [q.shape[i]]) for i in (0, 2))):
        return None
    return keep[0], tuple(dims), len(shape), keep[1]


def _whole(node: Any) -> torch.fx.Node | None:
    """`node` without slices that keep all of a dim (transformers' eager attention takes
    `mask[:, :, :, :keys]` of a mask that has exactly that many)."""
    while isinstance(node, torch.fx.Node) and node.target is aten.slice.Tensor \
            and isinstance(node.args[0], torch.fx.Node) and value_of(node) is not None \
            and value_of(node.args[0]) is not None and shapes.same_shape(value_of(node), value_of(node.args[0])):
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) else None


def _additive_condition(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple | None:
    """(condition, polarity) of `where(condition, 0, fill)` (polarity True), turned
    round, or `masked_fill(zeros, condition, fill)` (False); fill -inf or finfo.min."""
    fill = {-math.inf, torch.finfo(value_of(node).dtype).min} if value_of(node) is not None else set()
    if node.target is aten.where.self:
        cond, a, b = node.args
        for zeros, other, polarity in ((a, b, True), (b, a, False)):
            if _zeros(gm, zeros) and number(gm, other) in fill and same_shape(cond, node):
                return cond, polarity
    if node.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        zeros, cond, value = node.args
        if _zeros(gm, zeros) and number(gm, value) in fill and same_shape(cond, node):
            return cond, False
    return None


def _additive(gm: torch.fx.GraphModule, node: torch.fx.Node):
    """`_allowed` of a float mask: 0 where allowed, -inf or finfo.min elsewhere."""
    if node.target in (aten.unsqueeze.default, aten.expand.default):
        return _viewed(gm, node, _additive)
    condition = _additive_condition(gm, node)
    allowed = _allowed(gm, condition[0]) if condition else None
    return allowed and (allowed[0], allowed[1], allowed[2] == condition[1])


def _allowed(gm: torch.fx.GraphModule, node: Any):
    """(positions, unsqueezed dims, polarity) when boolean `node` is `key <= positions`
    (polarity True) or its negation (False): key the index along the last dim."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.target in _NOTS:
        inner = _allowed(gm, node.args[0])
        return inner and (inner[0], inner[1], not inner[2])
    if node.target in (aten.unsqueeze.default, aten.expand.default):
        return _viewed(gm, node, _allowed)
    if node.target in _COMPARISONS and len(node.args) == 2:
        key_at, polarity = _COMPARISONS[node.target]
        key, position = node.args[key_at], node.args[1 - key_at]
        val, out = value_of(position), value_of(node)
        if isinstance(position, torch.fx.Node) and val is not None and out is not None and val.dim() == out.dim() \
                and not val.dtype.is_floating_point and val.dtype != torch.bool \
                and shapes.known_true(val.shape[-1] == 1) and _key_index(gm, key, out.shape[-1]):
            return position, [], polarity
    return None


def _viewed(gm: torch.fx.GraphModule, node: torch.fx.Node, inner):
    """`inner` of a broadcasting view of the mask: an unsqueeze before the key dim, or
    an expand that keeps the key dim."""
    source, val = node.args[0], value_of(node)
    if val is None or not isinstance(source, torch.fx.Node) or value_of(source) is None:
        return None
    if node.target is aten.unsqueeze.default:
        dim = node.args[1] % val.dim()
        found = inner(gm, source) if dim != val.dim() - 1 else None
        return found and (found[0], found[1] + [dim], found[2])
    if val.dim() == value_of(source).dim() and shapes.same_sizes([val.shape[-1]], [value_of(source).shape[-1]]):
        return inner(gm, source)
    return None


def _key_index(gm: torch.fx.GraphModule, node: Any, keys: Any) -> bool:
    """`node` is 0, 1, .., keys - 1 along the last dim, 1 along every other."""
    val = value_of(node)
    if val is None or val.dtype.is_floating_point or not all(shapes.known_true(s == 1) for s in val.shape[:-1]):
        return False
    while node.target in (aten.unsqueeze.default, aten.view.default, aten.reshape.default) \
            or node.target is aten.add.Tensor and number(gm, node.args[1]) == 0.0:
        node = node.args[0]
    if node.op == "get_attr":
        constant = getattr(gm, node.target, None)  # a folded arange
        if not (isinstance(constant, torch.Tensor) and not fake.is_fake(constant) and constant.dim() == 1
                and isinstance(keys, int)):
            return False
        with fake.outside_fake_mode():
            return torch.equal(constant, torch.arange(keys, dtype=constant.dtype, device=constant.device))
    if node.target in _ARANGES:
        start, end, step = ([0, *node.args, 1] if node.target is aten.arange.default else [*node.args, 1])[:3]
        return start == 0 and step == 1 and shapes.same_sizes([end], [keys])
    if node.target is prims.iota.default:
        return node.kwargs.get("start") == 0 and node.kwargs.get("step") == 1 and shapes.same_sizes(
            [node.args[0]], [keys])
    return False


def _zeros(gm: torch.fx.GraphModule, node: Any) -> bool:
    """`node` is zeros of any shape: made so, or a folded constant of zeros."""
    if isinstance(node, torch.fx.Node) and node.target in (aten.zeros.default, aten.zeros_like.default):
        return True
    if isinstance(node, torch.fx.Node) and node.target is aten.full.default:
        return number(gm, node.args[1]) == 0.0
    constant = getattr(gm, node.target, None) if isinstance(node, torch.fx.Node) and node.op == "get_attr" else None
    if isinstance(constant, torch.Tensor) and not fake.is_fake(constant):
        with fake.outside_fake_mode():
            return not constant.any()
    return number(gm, node) == 0.0


# -- the replacement ------------------------------------------------------------------

def _replace(gm: torch.fx.GraphModule, found: Found, plan: _Plan, made: dict, mode: Any) -> bool:
    graph, old = gm.graph, value_of(found.out)
    with mode:
        result = kernel.fake_result(value_of(found.q))
    changed = {found.out: result} if same_strides(result, old) else restrided(gm, {found.out: result}, mode)
    if changed is None:  # a reader needs SDPA's layout: leave it SDPA
        return False

    def call(target, *args):
        node = graph.call_function(target, args)
        node.meta["val"] = fake_run(node, {}, mode)
        node.meta["stack_trace"] = found.out.meta.get("stack_trace")
        return node

    with graph.inserting_before(found.out):
        key, value = ((call(aten.permute.default, n, p) if p else n) for n, p in (plan.key, plan.value))
        positions = allowed = None
        if plan.positions is not None:
            positions = made.get(plan.positions)
            if positions is None:
                position, dims, rank = plan.positions
                for dim in dims:
                    position = call(aten.unsqueeze.default, position, dim)
                position = call(aten.select.int, position, rank - 1, 0)  # [..., t]
                if rank in (3, 4):  # [b, 1, t] or [1, t]: drop the heads' dim
                    position = call(aten.select.int, position, 1 if rank == 4 else 0, 0)
                positions = made[plan.positions] = position
        else:
            allowed = made.get(plan.allowed)
            if allowed is None:
                allowed, dims, rank, polarity = plan.allowed
                if not polarity:
                    allowed = call(aten.logical_not.default, allowed)
                for dim in dims:
                    allowed = call(aten.unsqueeze.default, allowed, dim)
                if rank in (3, 4):  # [b, 1, t, s] or [1, t, s]: drop the heads' dim
                    allowed = call(aten.select.int, allowed, 1 if rank == 4 else 0, 0)
                allowed = made[plan.allowed] = allowed
        new = call(_DECODE_ATTENTION, found.q, key, value, plan.slots, positions, found.scale, allowed)
    found.out.replace_all_uses_with(new)
    del changed[found.out]
    set_values(changed)
    return True
