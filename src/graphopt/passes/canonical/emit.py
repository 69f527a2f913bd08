"""Writing a matched attention site (`attention._Site`) back in the canonical 4-D form."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ..._compat import shapes
from ..base import value_of
from ..strides import fake_run, same_strides

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


class _Refused(Exception):
    """torch refused a node of the rewrite (its fake run failed)."""


class Emitter:
    """Inserts the canonical attention before the site's output. The nodes are built
    by hand, not traced: the batch stays a `-1` in every view and other symbolic
    sizes are read with `sym_size`, where a trace would write them in as constants."""

    def __init__(self, gm: torch.fx.GraphModule, site: Any, mode: Any):
        self.gm, self.site, self.mode, self.made = gm, site, mode, []
        self.heads, self.kv = value_of(site.q).shape[1], value_of(site.k).shape[2 if site.moved else 1]
        self.group = self.heads // self.kv
        self.s: Any = None  # the keys' length, a number or a sym_size node once known

    def run(self) -> bool:
        site = self.site
        try:
            with self.gm.graph.inserting_before(site.out):
                final = self._attention()
        except _Refused:
            final = None
        if final is None or not same_strides(value_of(final), value_of(site.out)):
            for node in reversed(self.made):
                self.gm.graph.erase_node(node)
            return False
        for node in self.made:
            node.meta.setdefault("stack_trace", site.out.meta.get("stack_trace"))
        site.out.replace_all_uses_with(final)
        return True

    def call(self, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = self.gm.graph.call_function(target, args, kwargs)
        self.made.append(node)
        node.meta["val"] = fake_run(node, {}, self.mode)
        if node.meta["val"] is None:
            raise _Refused(node.format_node())
        return node

    def _attention(self) -> torch.fx.Node | None:
        site, h = self.site, self.heads
        k, v = site.k, site.v
        if site.moved:
            k, v = (self.call(aten.permute.default, n, [0, 2, 1, 3]) for n in (k, v))
        t, d, s, dv = (self.size(n, dim) for n, dim in ((site.q, 2), (site.q, 3), (k, 2), (v, 3)))
        self.s = s
        mask = self._mask()
        if mask is False:
            return None
        q = self._permuted(site.q, d) if site.tiled else site.q
        keys, values = self._repeated(k), self._repeated(v)
        keys_t = self.call(aten.permute.default, keys, [0, 1, 3, 2])
        scores = self._bmm(q, keys_t, [-1, t, d], [-1, d, s], [-1, h, t, s])
        if site.scale != 1.0:
            scores = self.call(aten.mul.Tensor, scores, site.scale)
        if mask is not None:
            node, kind, fill = mask
            if kind == "add":
                scores = self.call(aten.add.Tensor, scores, node)
            else:  # `where`, as Inductor decomposes masked_fill
                fill = self.call(aten.scalar_tensor.default, fill, dtype=value_of(scores).dtype,
                                 device=value_of(scores).device)
                kept = (scores, fill) if kind == "keep" else (fill, scores)
                scores = self.call(aten.where.self, node, *kept)
        probs = self._softmax(scores)
        out = self._bmm(probs, values, [-1, t, s], [-1, s, dv], [-1, h, t, dv])
        if site.tiled:
            out = self._permuted(out, dv, back=True)
        shape = list(value_of(site.out).shape)
        return out if len(shape) == 4 else self.call(aten.view.default, out, [-1, *shape[1:-2], t, dv])

    def size(self, node: torch.fx.Node, dim: int) -> Any:
        """A size of `node`'s value: the number, or a `sym_size` node where it is symbolic."""
        size = value_of(node).shape[dim]
        return size if isinstance(size, int) else self.call(aten.sym_size.int, node, dim)

    def _softmax(self, x: torch.fx.Node) -> torch.fx.Node:
        """Softmax over the last dim; at level 2 as Inductor decomposes it, since
        Inductor refuses `_softmax` in a graph after its decompositions."""
        if self.gm.meta.get("graphopt_level", 1) != 2:
            return self.call(aten._softmax.default, x, -1, False)
        shifted = self.call(aten.sub.Tensor, x, self.call(aten.amax.default, x, [-1], True))
        exp = self.call(aten.exp.default, shifted)
        return self.call(aten.div.Tensor, exp, self.call(aten.sum.dim_IntList, exp, [-1], True))

    def _bmm(self, a, b, a_shape, b_shape, out_shape) -> torch.fx.Node:
        """`a @ b` of 4-D operands as Inductor's decomposition of `matmul` writes it."""
        a = self.call(aten.view.default, self._contiguous(a), a_shape)
        b = self.call(aten.view.default, self._contiguous(b), b_shape)
        return self.call(aten.view.default, self.call(aten.bmm.default, a, b), out_shape)

    def _contiguous(self, node: torch.fx.Node) -> torch.fx.Node:
        if node.target in _VIEWS and value_of(node.args[0]) is not None \
                and node.args[0].target is aten.clone.default:
            return node  # made contiguous here
        return self.call(aten.clone.default, node, memory_format=torch.contiguous_format)

    def _repeated(self, node: torch.fx.Node) -> torch.fx.Node:
        """[b, kv, s, d] -> [b, heads, s, d], head x reading kv head x // group (repeat_kv)."""
        if self.group == 1:
            return node
        size = [self.size(node, 2), self.size(node, 3)]
        expand = self.call(aten.expand.default, self.call(aten.unsqueeze.default, node, 2),
                           [-1, -1, self.group, -1, -1])
        copy = self.call(aten.clone.default, expand, memory_format=torch.contiguous_format)
        return self.call(aten.view.default, copy, [-1, self.heads, *size])

    def _permuted(self, node: torch.fx.Node, width: Any, back: bool = False) -> torch.fx.Node:
        """Heads [b, h, x, width] reordered from tiled (h = g * kv + k) to repeated
        (h = k * group + g), or `back`."""
        rows = self.size(node, 2)
        split = [self.kv, self.group] if back else [self.group, self.kv]
        grouped = self.call(aten.view.default, self._contiguous(node), [-1, *split, rows, width])
        swapped = self.call(aten.clone.default, self.call(aten.permute.default, grouped, [0, 2, 1, 3, 4]),
                            memory_format=torch.contiguous_format)
        return self.call(aten.view.default, swapped, [-1, self.heads, rows, width])

    def _mask(self) -> tuple | None | bool:
        """The mask for 4-D scores [b, h, t, s] (its heads in the order of the
        rewritten queries), None without one, False when it cannot be read so."""
        if self.site.mask is None:
            return None
        node, kind, fill = self.site.mask
        rank, val = value_of(self.site.out).dim(), value_of(node)
        if val is None:
            return False
        if val.dim() <= 2 or val.dim() == 3 and shapes.known_true(val.shape[0] == 1):
            return node, kind, fill  # the same for every head
        if rank == 5:
            ok = val.dim() == 5 and node.target is aten.unsqueeze.default and node.args[1] % 5 in (1, 2) \
                and shapes.known_true(value_of(node.args[0]).shape[1] == 1)
            return (node.args[0], kind, fill) if ok else False
        if rank == 3:
            node = _flattened(node, self.heads)
            if node is None:
                return False
        if value_of(node).dim() != 4:
            return False
        if shapes.known_true(value_of(node).shape[1] == 1):
            return node, kind, fill
        return (self._permuted(node, self.s) if self.site.tiled else node), kind, fill


def _flattened(node: torch.fx.Node, heads: int) -> torch.fx.Node | None:
    """The [b, heads, t, s] value a 3-D mask [b * heads, t, s] flattens, or the
    [b, 1, t, s] one it was broadcast from."""
    rows = value_of(node).shape[-2:]
    while node.target in (*_VIEWS, aten.clone.default) and isinstance(node.args[0], torch.fx.Node):
        val = value_of(node)
        if val is not None and val.dim() == 4 and shapes.known_true(val.shape[1] == heads) \
                and shapes.same_sizes(val.shape[-2:], rows):
            break
        node = node.args[0]
    while node.target is aten.clone.default and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]  # a copy of the same values
    val = value_of(node)
    if val is None or val.dim() != 4 or not shapes.known_true(val.shape[1] == heads) \
            or not shapes.same_sizes(val.shape[-2:], rows):
        return None
    source = node.args[0] if node.target is aten.expand.default else None
    if source is not None and value_of(source) is not None and value_of(source).dim() == 4 \
            and shapes.known_true(value_of(source).shape[1] == 1):
        return source
    return node
