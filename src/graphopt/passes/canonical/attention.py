"""Attention in one form: 4-D, [batch, heads, len, dim], with grouped kv heads
repeated as `repeat_kv` does, whatever the model wrote."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ..._compat import fake, shapes
from ..base import PassResult, value_of
from ..fusion.attention import score_stages
from ..fusion.softmax import softmax_input
from .emit import Emitter

aten = torch.ops.aten

# Ops that reshape or broadcast the batch dims of a matmul operand (its last two
# dims kept); a chain of them flattens [b, h, ...] in row-major order.
_BATCH_LAYOUT = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
                 aten.clone.default}
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)  # reshape: Inductor's graphs
_MAX_STAGES = 6


def canonicalize_attention(gm: torch.fx.GraphModule) -> PassResult:
    """Rewrite attention over flattened (3-D, `bmm`/`baddbmm`) or grouped (5-D,
    broadcasting) batch dims, over kv heads tiled by `repeat`, or over cache rows
    [b, s, kv, d] repeated along dim 2 before the heads move to dim 1, as 4-D
    attention whose kv heads are repeated as `repeat_kv` does, which the attention
    fusions match.

        before:  keys = aten.view(aten.repeat(k, [1, 2, 1, 1]), [8, 64, 16])
                 scores = aten.baddbmm(bias3, aten.view(q, [8, 1, 16]), aten.transpose(keys, 1, 2), alpha=0.25)
                 out = aten.bmm(aten._softmax(scores, -1, False), values)          (values likewise)
        after:   q2 = view(clone(permute(view(q, [-1, 2, 2, 1, 16]), [0, 2, 1, 3, 4])), [-1, 4, 1, 16])
                 keys = view(clone(expand(unsqueeze(k, 2), [-1, -1, 2, -1, -1])), [-1, 4, 64, 16])
                 p = _softmax(add(mul(q2 @ keysᵀ, 0.25), bias4), -1, False)      (bias4: bias3 before its reshape)
                 out2 = p @ values;  out = view(out2 with its heads permuted back, [-1, 1, 16])

    The matmuls are written as Inductor's decomposition writes them (view, bmm,
    view). Sound because every op between a matmul and its operands' 4-D sources
    only reshapes or broadcasts batch dims (their last two dims kept, or swapped by
    a transpose), so the bmm's batch index is `b * heads + head`, and the kv head a
    query head reads is read off the keys' source: `repeat(k, [1, g, 1, 1])` and
    `unsqueeze(k, 1)` broadcast to [b, g, kv] tile the kv heads (head x reads
    x % kv), `unsqueeze(k, 2)` broadcast to [b, kv, g] repeats each (x reads x // g).
    Tiled heads are made repeated ones by permuting the query heads (and a mask that
    varies per head) and the output back. Left alone: attention already in the
    form, keys and values whose heads map differently, symbolic head counts, masks
    not read per [b, heads] row, casts around the softmax, and intermediates read
    elsewhere (attention weights returned).
    """
    mode = fake.fake_mode_of(gm) or contextlib.nullcontext()
    rewritten = 0
    for node in list(gm.graph.nodes):
        site = _site(gm, node) if node.op == "call_function" else None
        if site is not None and Emitter(gm, site, mode).run():
            rewritten += 1
    if rewritten:
        gm.graph.eliminate_dead_code()
    return PassResult(changed=rewritten > 0, counts={"attention": rewritten} if rewritten else {})


@dataclass
class _Site:
    q: torch.fx.Node  # [b, h, t, d]
    k: torch.fx.Node  # [b, kv, s, d]
    v: torch.fx.Node  # [b, kv, s, dv]
    tiled: bool  # query head x reads kv head x % kv (else x // group)
    scale: float
    mask: tuple | None  # (node, kind, fill) as score_stages gives them: kind "add", "drop" or "keep"
    out: torch.fx.Node  # the product p @ v as the model shaped it
    moved: bool = False  # k and v are [b, s, kv, d]: their heads go to dim 1 first


def _site(gm: torch.fx.GraphModule, node: torch.fx.Node) -> _Site | None:
    softmax = softmax_input(node)
    walked = _scores(gm, softmax[0], _MAX_STAGES) if softmax else None
    if walked is None:
        return None
    stages, bmm, extra, top = walked
    scale, mask = softmax[2], None
    for _, kind, value in [*extra, *reversed(stages)]:  # in the order the code computes them
        if kind == "scale" and mask is None:
            scale *= value
        elif kind in ("add", "drop", "keep") and mask is None:
            mask = (value[0], kind, value[1])
        else:
            return None
    if softmax[2] != 1.0 and mask is not None and mask[1] == "add":  # the temperature would scale it too
        return None
    rank, (left, right) = value_of(softmax[0]).dim(), bmm.args[-2:]  # baddbmm's bias comes first
    q, k = _query(left), _kv(right, True)
    consumer = _consumer(node, rank)
    if q is None or k is None or consumer is None:
        return None
    out, pv, chain = consumer
    v = _kv(pv.args[1], False)
    if v is None or k[1:] != v[1:] or (rank == 4 and not (k[1] or k[3])) or not math.isfinite(scale):
        return None
    internal = {bmm, top, node, pv, *chain, *softmax[1], *(s for s, _, _ in stages)}
    if any(set(n.users) - internal - {out} for n in internal - {out}):
        return None
    site = _Site(q, k[0], v[0], k[1], scale, mask, out, k[3])
    return site if _shapes_agree(site, k[2], bmm) else None


def _scores(gm: torch.fx.GraphModule, x: Any, budget: int):
    """(stages from the softmax back, the scores' bmm, the bmm's own stages, the
    product as the model shaped it) when `x` is a batched product after at most
    `budget` scale/mask stages."""
    if not isinstance(x, torch.fx.Node):
        return None
    bmm = x.args[0] if x.target in _VIEWS else x
    if isinstance(bmm, torch.fx.Node) and bmm.target is aten.bmm.default and len(bmm.users) == 1:
        return [], bmm, [], x
    if x.target is aten.baddbmm.default and x.kwargs.get("beta", 1) == 1 and len(x.args) == 3:
        return [], x, [(x, "scale", float(x.kwargs.get("alpha", 1))), (x, "add", (x.args[0], 0.0))], x
    for kind, source, value in score_stages(gm, x) if budget else ():
        rest = _scores(gm, source, budget - 1)
        if rest is not None:
            return [(x, kind, value)] + rest[0], *rest[1:]
    return None


def _batch_chain(node: torch.fx.Node) -> tuple[torch.fx.Node, int, bool, list]:
    """(source, transposes, grows, [(node, transposes, grows) on the way]) of a matmul
    operand: walked back through ops that only reshape or broadcast its batch dims,
    or swap its last two dims."""
    swaps, grows, seen = 0, False, []
    while isinstance(node, torch.fx.Node) and isinstance(node.args[0] if node.args else None, torch.fx.Node):
        val, src = value_of(node), value_of(node.args[0])
        if val is None or src is None or src.dim() < 3:
            break
        seen.append((node, swaps, grows))
        if node.target in _BATCH_LAYOUT and shapes.same_sizes(val.shape[-2:], src.shape[-2:]):
            grows = grows or node.target is aten.expand.default and not shapes.same_sizes(val.shape, src.shape)
        elif _swaps_last_two(node):
            swaps += 1
        else:
            break
        node = node.args[0]
    return node, swaps, grows, seen + [(node, swaps, grows)]


def _swaps_last_two(node: torch.fx.Node) -> bool:
    rank = value_of(node).dim() if value_of(node) is not None else 0
    if rank < 2:
        return False
    if node.target is aten.transpose.int:
        return {d % rank for d in node.args[1:]} == {rank - 2, rank - 1}
    swapped = [*range(rank - 2), rank - 1, rank - 2]
    return node.target is aten.permute.default and [d % rank for d in node.args[1]] == swapped


def _query(operand: torch.fx.Node) -> torch.fx.Node | None:
    """The 4-D queries [b, h, t, d] the scores' left operand flattens: the earliest
    4-D value on the way, reached without transposes or broadcasts."""
    found = None
    for node, swaps, grows in _batch_chain(operand)[3]:
        if swaps or grows:
            break
        if value_of(node) is not None and value_of(node).dim() == 4:
            found = node
    return found


def _kv(operand: torch.fx.Node, transposed: bool) -> tuple | None:
    """(kv, tiled, group, moved) read by a matmul operand (transposed for the keys),
    through `repeat`, a broadcast `unsqueeze` or nothing (group 1): kv is [b, kv, s, d],
    or [b, s, kv, d] when `moved` (repeated along dim 2, then transposed)."""
    source, swaps, _, seen = _batch_chain(operand)
    tiled, group = False, 1
    if source.target is aten.repeat.default and len(source.args[1]) == 4 \
            and [source.args[1][i] for i in (0, 2, 3)] == [1, 1, 1] and isinstance(source.args[1][1], int):
        source, tiled, group = source.args[0], True, source.args[1][1]
    elif source.target is aten.unsqueeze.default and value_of(source) is not None and value_of(source).dim() == 5 \
            and source.args[1] % 5 in (1, 2):
        source, tiled, group = source.args[0], source.args[1] % 5 == 1, 0  # group from the heads
    else:  # the earliest 4-D value on the way: repeated before its heads moved to dim 1, or no GQA
        source, swaps = next(((n, t) for n, t, _ in reversed(seen)
                              if value_of(n) is not None and value_of(n).dim() == 4), (source, swaps))
        moved = _heads_moved(source)
        found = _repeated_heads_last(moved[0]) if moved else None
        if found is not None:
            return (found[0], *found[1:], True) if (swaps + moved[1]) % 2 == transposed else None
    if _swaps_last_two(source):
        source, swaps = source.args[0], swaps + 1
    val = value_of(source)
    if val is None or val.dim() != 4 or swaps % 2 != transposed:
        return None
    return source, tiled, group, False


def _heads_moved(node: torch.fx.Node) -> tuple[torch.fx.Node, int] | None:
    """(x, 0) when `node` is x [b, s, h, d] with dims 1 and 2 swapped, (x, 1) when its
    last two dims are then swapped too (a transpose pair composed into one permute)."""
    if node.target is aten.transpose.int and value_of(node) is not None and value_of(node).dim() == 4 \
            and sorted(d % 4 for d in node.args[1:]) == [1, 2]:
        return node.args[0], 0
    if node.target is aten.permute.default and list(node.args[1]) in ([0, 2, 1, 3], [0, 2, 3, 1]):
        return node.args[0], int(list(node.args[1]) == [0, 2, 3, 1])
    return None


def _repeated_heads_last(node: torch.fx.Node) -> tuple | None:
    """(x [b, s, kv, d], tiled, group) when `node` [b, s, h, d] repeats x's heads along
    dim 2: `repeat(x, [1, 1, g, 1])` (tiled) or repeat_interleave's
    `view(clone(expand(unsqueeze(x, 3))))` (repeated)."""
    if node.target is aten.repeat.default and len(node.args[1]) == 4 and isinstance(node.args[1][2], int) \
            and [node.args[1][i] for i in (0, 1, 3)] == [1, 1, 1]:
        return node.args[0], True, node.args[1][2]
    expand = node.args[0] if node.target in _VIEWS else None
    expand = expand.args[0] if isinstance(expand, torch.fx.Node) and expand.target is aten.clone.default else expand
    if not (isinstance(expand, torch.fx.Node) and expand.target is aten.expand.default
            and expand.args[0].target is aten.unsqueeze.default and expand.args[0].args[1] % 5 == 3):
        return None
    x, sizes = expand.args[0].args[0], value_of(expand).shape
    if value_of(x) is None or value_of(x).dim() != 4 or not isinstance(sizes[3], int) \
            or not shapes.same_sizes(value_of(node).shape, [*sizes[:2], sizes[2] * sizes[3], sizes[4]]):
        return None
    return x, False, sizes[3]


def _consumer(probs: torch.fx.Node, rank: int) -> tuple[torch.fx.Node, torch.fx.Node, list] | None:
    """(output as the model shaped it, the bmm, the views between) when `probs`' one
    reader is `probs @ v`."""
    node, chain = probs, []
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.target is aten.bmm.default and user.args[0] is node:
            if rank == 3:
                return user, user, chain
            out = next(iter(user.users)) if len(user.users) == 1 else None
            ok = out is not None and out.target in _VIEWS \
                and value_of(out) is not None and value_of(out).dim() == rank
            return (out, user, chain) if ok else None
        if user.target not in _BATCH_LAYOUT:
            return None
        chain.append(user)
        node = user
    return None


def _shapes_agree(site: _Site, group: int, bmm: torch.fx.Node) -> bool:
    q, k, v, out = (value_of(n) for n in (site.q, site.k, site.v, site.out))
    if q is None or k is None or v is None or out is None:
        return False
    order = [0, 2, 1, 3] if site.moved else [0, 1, 2, 3]
    k, v = [k.shape[i] for i in order], [v.shape[i] for i in order]  # [b, kv, s, d]
    b, heads, t, d = q.shape
    group = group or heads // k[1]
    static = [heads, k[1], *out.shape[1:-2]]  # the heads: the rewrite splits and permutes them
    if not all(isinstance(s, int) for s in static) or k[1] * group != heads:
        return False
    if not (shapes.same_sizes([k[0], v[0], k[3], k[2]], [b, b, d, v[2]])
            and shapes.same_sizes([value_of(bmm).shape[0]], [out.numel() // (t * v[3])])):
        return False
    return shapes.known_true(out.numel() == b * heads * t * v[3])
