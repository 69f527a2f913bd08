"""Rotary embeddings in one form per pairing: `x * cos + rotate(x) * sin`, with
rotate(x) written as `fuse_rotary` matches it (halves: `cat(-x2, x1)` of slices;
neighbouring pairs: `stack(-x[..., 1::2], x[..., ::2], -1)` flattened)."""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
import torch.fx

from ..._compat import fake, shapes
from ..base import PassResult, value_of
from ..strides import fake_run, same_strides

aten = torch.ops.aten
_END = 9223372036854775807  # how a trace writes an open-ended slice
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
# Ops that act on a complex tensor's elements as on its real pairs, by the index of
# their dim arguments: indexing (never the last dim: the pair comes after it) and views.
_PAIRWISE = {aten.index.Tensor: (), aten.unsqueeze.default: (1,), aten.select.int: (1,),
             aten.slice.Tensor: (1,)}
# How each join orders the parts it turns: (-second half, first half), (-odd, even).
_JOINS = {aten.cat.default: ("second", "first"), aten.stack.default: ("odd", "even")}


def canonicalize_rotary(gm: torch.fx.GraphModule) -> PassResult:
    """Rewrite the other spellings of a rotary embedding into the forms
    `fuse_rotary` matches.

        before:  x1, x2 = aten.split(q, 8, -1)                (chunk(2, -1) traces to it)
                 y = aten.add(aten.mul(cos, q), aten.mul(sin, aten.cat([aten.neg(x2), x1], -1)))
        after:   r = aten.cat([aten.neg(aten.slice(q, 3, 8, END)), aten.slice(q, 3, 0, 8)], -1)
                 y = aten.add(aten.mul(q, cos), aten.mul(r, sin))

        before:  c = aten.view_as_complex(aten.view(x, [2, 8, 4, 8, 2]))
                 y = aten.view(aten.view_as_real(aten.mul(c, freqs_cis)), [2, 8, 4, 16])
        after:   f = aten.view_as_real(freqs_cis);  cos = view(stack([f[..., 0]] * 2, -1), [1, 8, 1, 16])
                 y = aten.add(aten.mul(x, cos), aten.mul(rotate_pairs(x), sin))   (sin from f[..., 1])

    The first, at level 1: the halves of x's last dim taken by `split`/`chunk` are
    the slices `rotate_half` takes, and the products and the sum are written in any
    operand order (at level 2 Inductor makes one kernel of any real spelling
    itself). The second (Meta's Llama), at level 2: a complex product (a + ib)(c + is)
    is (ac - bs) + i(as + bc), GPT-J's interleaved rotary of the pair (a, b) with
    cos c and sin s, each repeated over its pair (for any freqs_cis, unit or not);
    Inductor compiles that into its kernels, where it leaves a complex product to
    ATen. At level 1 the complex product stays: it is one ATen kernel, which the
    fused op (a product and two multiply-adds) does not beat. Only where the
    rewritten sum has the original's dtype and strides (views after it rely on
    them); sites already in a fused form are left as they are. Where freqs_cis is an
    input's rows (`table[positions]`), they are gathered from `view_as_real(table)`,
    so no complex value is left for Inductor but the input's view.
    """
    mode = fake.fake_mode_of(gm) or contextlib.nullcontext()
    level = gm.meta.get("graphopt_level", 1)
    tables: dict[torch.fx.Node, tuple] = {}  # freqs_cis -> its (cos, sin, nodes made), shared by q and k
    sums = products = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.add.Tensor and level == 1 and _rewrite_sum(gm, node, mode):
            sums += 1
        elif node.target in _VIEWS and level == 2 and _rewrite_complex(gm, node, mode, tables):
            products += 1
    for made in reversed([n for kept in tables.values() if kept for n in kept[2]]):
        if not made.users:  # made for sites that were then left alone
            gm.graph.erase_node(made)
    if sums or products:
        gm.graph.eliminate_dead_code()
    counts = {name: n for name, n in (("rotary", sums), ("complex_rotary", products)) if n}
    return PassResult(changed=bool(counts), counts=counts)


def _rewrite_sum(gm: torch.fx.GraphModule, node: torch.fx.Node, mode: Any) -> bool:
    site = _sum_site(node)
    if site is None or site[4]:
        return False
    x, cos, sin, pairs, _ = site
    return _Writer(gm, node, mode).rotary(x, cos, sin, pairs)


def _sum_site(node: torch.fx.Node) -> tuple | None:
    """(x, cos, sin, pairs, canonical) when `node` adds `x * cos` and `rotate(x) * sin`
    in any order, the products and the rotation read only by the sum (a fused chain
    that something else reads is computed twice)."""
    if len(node.args) != 2 or node.kwargs or not all(_product(a) for a in node.args):
        return None
    for plain, rotated in (node.args, reversed(node.args)):
        for turned, sin in (rotated.args, reversed(rotated.args)):
            found = _rotation(turned) if len(turned.users) == 1 else None
            if found is None or found[0] not in plain.args or sin is found[0]:
                continue
            x, pairs, spelled = found
            cos = plain.args[1] if plain.args[0] is x else plain.args[0]
            canonical = spelled and plain.args[0] is x and rotated.args[0] is turned
            return x, cos, sin, pairs, canonical
    return None


def _product(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.target is aten.mul.Tensor and len(node.users) == 1 \
        and not node.kwargs and len(node.args) == 2 and all(isinstance(a, torch.fx.Node) for a in node.args)


def _rotation(node: torch.fx.Node) -> tuple | None:
    """(x, pairs, spelled as fuse_rotary matches it) when `node` is x's halves or
    neighbouring pairs (a, b) turned into (-b, a) along x's last dim."""
    pairs = node.target in _VIEWS and isinstance(node.args[0], torch.fx.Node) \
        and node.args[0].target is aten.stack.default
    joined = node.args[0] if pairs else node
    if joined.target not in _JOINS or len(joined.args) != 2 or len(joined.args[0]) != 2:
        return None
    (negated, kept), dim = joined.args
    parts = _negated(negated), _part(kept)
    if None in parts or parts[0][0] is not parts[1][0] or (parts[0][1], parts[1][1]) != _JOINS[joined.target]:
        return None
    x, rank = parts[0][0], value_of(parts[0][0]).dim()
    # cat joins along x's last dim; stack makes a new dim after it, which the view flattens back.
    if not isinstance(dim, int) or dim % (rank + pairs) != rank - 1 + pairs:
        return None
    if pairs and (value_of(node) is None or not shapes.same_sizes(value_of(node).shape, value_of(x).shape)):
        return None
    return x, pairs, parts[0][2] and parts[1][2]


def _negated(node: Any) -> tuple | None:
    return _part(node.args[0]) if isinstance(node, torch.fx.Node) and node.target is aten.neg.default else None


def _part(node: Any) -> tuple | None:
    """(x, "first" | "second" | "even" | "odd", a slice) when `node` is that part of
    x's (even, static) last dim: a slice, or an item of an even split."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) \
            and node.args[0].target in _SPLITS:
        x, size, dim = (list(node.args[0].args) + [0])[:3]
        width = _width(x, dim)
        sizes = [size] * 2 if isinstance(size, int) else list(size)
        if width is None or sizes != [width // 2] * 2 or node.args[1] not in (0, 1):
            return None
        return x, ("first", "second")[node.args[1]], False
    if node.target is not aten.slice.Tensor:
        return None
    x, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
    width = _width(x, dim)
    if width is None or not all(isinstance(n, int) for n in (start or 0, end or 0, step)):
        return None
    start, end = (start or 0) % width if start else 0, width if end is None or end >= width else end % width
    parts = {(0, width // 2, 1): "first", (width // 2, width, 1): "second", (0, width, 2): "even",
             (1, width, 2): "odd"}
    found = parts.get((start, end, step))
    return (x, found, True) if found else None


def _width(x: Any, dim: Any) -> int | None:
    """x's last dim when `dim` is it and it is a static even number."""
    val = value_of(x)
    if val is None or val.dim() == 0 or not isinstance(dim, int) or dim % val.dim() != val.dim() - 1:
        return None
    width = val.shape[-1]
    return width if isinstance(width, int) and width % 2 == 0 else None


def _rewrite_complex(gm: torch.fx.GraphModule, node: torch.fx.Node, mode: Any, tables: dict) -> bool:
    """`view(view_as_real(view_as_complex(view(x, [..., d/2, 2])) * freqs), x.shape)`
    -> the interleaved rotary of x by freqs' cosines and sines."""
    real = node.args[0]
    if not isinstance(real, torch.fx.Node) or real.target is not aten.view_as_real.default or len(real.users) != 1:
        return False
    product = real.args[0]
    if product.target is not aten.mul.Tensor or len(product.users) != 1 or len(product.args) != 2:
        return False
    for made, freqs in (product.args, reversed(product.args)):
        if isinstance(made, torch.fx.Node) and made.target is aten.view_as_complex.default \
                and len(made.users) == 1 and isinstance(freqs, torch.fx.Node):
            break
    else:
        return False
    paired = made.args[0]
    if value_of(paired) is None or value_of(freqs) is None or not value_of(freqs).is_complex() \
            or value_of(freqs).dim() > value_of(made).dim() or not isinstance(value_of(paired).shape[-2], int):
        return False
    width = 2 * value_of(paired).shape[-2]
    writer = _Writer(gm, node, mode)
    if freqs not in tables:
        tables[freqs] = writer.table(freqs, width)
    if tables[freqs] is None:
        return False
    cos, sin, _ = tables[freqs]
    # x and the result [..., d]: the views on either side may have been merged with others (a reshape
    # of the projection before, of the cache write after), so x is the pairs flattened back, and the
    # result is viewed as `node` was.
    x = writer.call(aten.view.default, paired, writer.sizes(paired)[:-2] + [width])
    return x is not None and writer.rotary(x, cos, sin, True)


class _Writer:
    """Inserts nodes before `node` and replaces it by the last, or erases them all
    when torch refuses one or the result's dtype or strides differ from `node`'s."""

    def __init__(self, gm: torch.fx.GraphModule, node: torch.fx.Node, mode: Any):
        self.gm, self.node, self.mode, self.made = gm, node, mode, []

    def call(self, target: Any, *args: Any) -> torch.fx.Node | None:
        with self.gm.graph.inserting_before(self.node):
            made = self.gm.graph.call_function(target, args)
        self.made.append(made)
        made.meta["val"] = fake_run(made, {}, self.mode)
        made.meta.setdefault("stack_trace", self.node.meta.get("stack_trace"))
        return made if made.meta["val"] is not None else None

    def undo(self) -> None:
        for made in reversed(self.made):
            self.gm.graph.erase_node(made)
        self.made = []

    def table(self, freqs: torch.fx.Node, width: int) -> tuple | None:
        """(cos, sin, the nodes made): freqs' real and imaginary parts, each repeated
        over its pair, [..., d]."""
        parts = self.real_pairs(freqs)
        sizes = self.sizes(freqs)[:-1] + [width]
        if parts is None:
            return self.undo()
        found = []
        for index in (0, 1):
            part = self.call(aten.select.int, parts, -1, index)
            pair = part and self.stack([part, part])
            found.append(pair and self.call(aten.view.default, pair, sizes))
        if None in found:
            return self.undo()
        made, self.made = self.made, []  # kept for this site and the others that read freqs
        return (*found, made)

    def real_pairs(self, freqs: torch.fx.Node) -> torch.fx.Node | None:
        """`view_as_real(freqs)`, [..., d/2, 2]. Where freqs is a graph input's rows
        (`freqs_cis[positions][:, :, None]`), the gather and views are made on the
        input's real pairs instead: Inductor leaves complex math, a gather included, to
        ATen, and a view of an input costs nothing."""
        chain, node = [], freqs
        while node.op == "call_function" and node.target in _PAIRWISE and not node.kwargs \
                and isinstance(node.args[0], torch.fx.Node):
            chain.append(node)
            node = node.args[0]
        if not chain or node.op not in ("placeholder", "get_attr"):
            return self.call(aten.view_as_real.default, freqs)
        made = self.call(aten.view_as_real.default, node)
        for step in reversed(chain):
            dims = _PAIRWISE[step.target]  # the args that are dims: a negative one counts past the pair
            args = [a - 1 if i in dims and isinstance(a, int) and a < 0 else a for i, a in enumerate(step.args)]
            made = made and self.call(step.target, made, *args[1:])
        return made

    def rotary(self, x: torch.fx.Node, cos: torch.fx.Node, sin: torch.fx.Node, pairs: bool) -> bool:
        rank, width = value_of(x).dim(), value_of(x).shape[-1]
        if pairs:
            odd, even = (self.call(aten.slice.Tensor, x, rank - 1, start, _END, 2) for start in (1, 0))
            stacked = self.stack([self.call(aten.neg.default, odd), even])
            turned = self.call(aten.view.default, stacked, self.sizes(x))
        else:
            first = self.call(aten.slice.Tensor, x, rank - 1, 0, width // 2)
            second = self.call(aten.slice.Tensor, x, rank - 1, width // 2, _END)
            turned = self.call(aten.cat.default, [self.call(aten.neg.default, second), first], -1)
        plain, rotated = self.call(aten.mul.Tensor, x, cos), self.call(aten.mul.Tensor, turned, sin)
        for order in ((plain, rotated), (rotated, plain)):
            total = self.call(aten.add.Tensor, *order)
            if total is not None and self.node.target in _VIEWS \
                    and not shapes.same_shape(value_of(total), value_of(self.node)):
                total = self.call(self.node.target, total, self.node.args[1])
            if total is not None and _same(value_of(total), value_of(self.node)):
                self.node.replace_all_uses_with(total)
                return True
        self.undo()
        return False

    def stack(self, parts: list) -> torch.fx.Node | None:
        """`stack(parts, -1)`; at level 2 as Inductor decomposes it, since Inductor
        refuses `stack` in a graph after its decompositions."""
        if self.gm.meta.get("graphopt_level", 1) != 2:
            return self.call(aten.stack.default, parts, -1)
        return self.call(aten.cat.default, [self.call(aten.unsqueeze.default, p, -1) for p in parts], -1)

    def sizes(self, x: torch.fx.Node) -> list:
        """x's sizes for a view: numbers, and `sym_size` nodes where symbolic."""
        return [s if isinstance(s, int) else self.call(aten.sym_size.int, x, i)
                for i, s in enumerate(value_of(x).shape)]


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
        and shapes.same_shape(a, b) and same_strides(a, b)
