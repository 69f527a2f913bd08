"""Row rules for indexing (`rows.py`): lookups, gathers and writes at positions taken
from data. Positions that point into their own row (`arange(s)`, a sort's indices)
may index the batch dim; the result's rows are then in the positions' order."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import sympy
import torch

from .row_rules import PER_ROW_WRITES, Call, Index, Mixes, Rows, _dims, positional, rule


def order_of(call: Call, tensors: list) -> Any:
    """The one order the rows of `tensors` are in (None: the rows' own)."""
    orders = {call.rows(t).order for t in tensors if call.rows(t) is not None}
    if len(orders) > 1:
        raise Mixes("combines rows in a sorted order with rows in another")
    return next(iter(orders), None)


def in_order(result: list, order: Any) -> list:
    return [r if r is None else replace(r, order=order) for r in result]


def _points_into(call: Call, position: Rows | None, x: torch.Tensor, rows: Rows) -> bool:
    """`position`'s values are positions along x's batch dim, each in its own row."""
    index = position.index if position is not None else None
    return index is not None and index.order is rows.order and \
        sympy.cancel(index.per_row - call.per_row(x, rows)) == 0


def _no_positions(call: Call, tensors: list, what: str) -> None:
    if any(positional(call.rows(t)) for t in tensors):
        raise Mixes(f"uses positions in a sorted order {what}")


@rule("embedding", "one_hot", "bucketize", "searchsorted", keeps_order=True)
def lookup(call: Call) -> list:
    """A table (or boundaries) indexed by rows of the batch: the table must be shared."""
    table = call.named.get("weight", call.named.get("boundaries", call.named.get("sorted_sequence")))
    if call.rows(table) is not None:
        raise Mixes("looks rows of the batch up by index")
    return in_order(call.follow(), order_of(call, call.tensors))


@rule("index", "_unsafe_index", keeps_order=True, reads_positions=True)
def index(call: Call) -> list:
    """x[i, j]: a shared x indexed per row, rows of x indexed along other dims, or x's
    batch dim indexed by positions of its own rows (`x[arange(s), j]`, `h[perm // k]`)."""
    x, indices = call.named["self"], call.named["indices"]
    given = [i for i in indices if i is not None]
    _no_positions(call, [x], "as values")
    rows, d = call.rows(x), call.dim(x)
    if d is not None and d < len(indices) and indices[d] is not None:
        if not _points_into(call, call.rows(indices[d]), x, rows):
            raise Mixes("indexes the batch dim with indices taken from data")
        rank = max(i.dim() for i in given)  # index tensors broadcast together
        if len({call.dim(i) + rank - i.dim() for i in given if call.rows(i) is not None}) > 1:
            raise Mixes("indexes the batch with rows of the batch that broadcasting lines up differently")
        _no_positions(call, [i for i in given if i is not indices[d]], "to index a tensor not in that order")
        return in_order(call.follow(), order_of(call, given))
    _no_positions(call, given, "to index a tensor not in that order")
    return in_order(call.follow(), order_of(call, given + ([x] if d is not None else [])))


@rule("gather", "take_along_dim")
def gather(call: Call) -> list:
    x, index_ = call.named["self"], call.named.get("index", call.named.get("indices"))
    d = call.dim(x)
    if d is not None and (_dims(call.named.get("dim"), x.dim()) == {d} or call.dim(index_) != d):
        raise Mixes("gathers along the batch dim")
    return call.follow()


@rule(*PER_ROW_WRITES, keeps_order=True, reads_positions=True)
def write_at(call: Call) -> list:
    """Writes at positions from data: into a shared tensor (a cache) they are trusted to be
    per row; into rows of the batch they must stay inside each row."""
    x = call.named["self"]
    data = [t for t in call.tensors[1:] if call.rows(t) is not None]
    rows, d = call.rows(x), call.dim(x)
    if d is None:
        _no_positions(call, data, "to write into a tensor not in that order")
        order_of(call, data)  # a cache's indices and values come from the same rows
        return [None] * len(call.outs)
    _no_positions(call, [x], "as values")
    if call.name in ("index_put", "_index_put_impl"):
        indices, values = call.named["indices"], call.named["values"]
        at = indices[d] if d < len(indices) else None
        _no_positions(call, [values, *[i for i in indices if i is not None and i is not at]], "as values")
        if _row_mask(call, indices, d) and call.rows(values) is None:
            return [Rows(d, order=rows.order)] * len(call.outs)  # h[mask] = v, mask[r] choosing row r
        if at is not None:
            return [_put_positions(call, x, rows, indices, values)] * len(call.outs)
        if any(call.rows(i) for i in indices if i is not None):
            raise Mixes("writes across rows of the batch at positions taken from data")
        order_of(call, [x, values])
        if call.dim(values) is not None:  # its rows must land on the rows of x[indices]
            target = torch.ops.aten.index.Tensor(x, indices)
            if call.batch_dims(target) != [call.dim(values) + target.dim() - values.dim()]:
                raise Mixes("writes rows of the batch into other rows")
        return [Rows(d, order=rows.order)] * len(call.outs)
    dims = _dims(call.named.get("dim"), x.dim())
    source = call.named.get("source", call.named.get("src"))
    _no_positions(call, [source], "as values")
    if call.name in ("index_add", "index_copy") and dims == {d} and \
            _points_into(call, call.rows(call.named["index"]), x, rows) and call.dim(source) == d and \
            order_of(call, [call.named["index"], source]) is call.rows(call.named["index"]).order:
        return [Rows(d, order=rows.order)] * len(call.outs)  # out.index_add_(0, perm // k, y): y's rows home
    _no_positions(call, data, "outside indexing")
    if dims == {d} or any(call.dim(t) not in (None, d) for t in call.tensors[1:]):
        raise Mixes("writes along the batch dim at positions taken from data")
    order_of(call, [x, *data])
    return [Rows(d, order=rows.order)] * len(call.outs)


def _put_positions(call: Call, x: torch.Tensor, rows: Rows, indices: list, values: Any) -> Rows:
    """x[positions] = values along x's batch dim (1-D), each position in its own row.
    Values in the positions' order land in their own rows; `arange` values written
    through a permutation make x the inverse permutation (`inv[perm] = arange(S)`)."""
    position = call.rows(indices[rows.dim])
    if x.dim() != 1 or indices[rows.dim].dim() != 1 or len([i for i in indices if i is not None]) != 1 or \
            not _points_into(call, position, x, rows):
        raise Mixes("writes across rows of the batch at positions taken from data")
    written = call.rows(values)
    if written is None:
        return Rows(rows.dim, order=rows.order)
    if written.index is not None and written.index.identity and written.order is None and position.index.onto \
            and not call.named.get("accumulate") and values.dim() == 1:
        # Value i written at positions[i] is i: the position, in the positions' order, of each entry.
        return Rows(rows.dim, order=rows.order, index=Index(written.index.per_row, position.order))
    if written.order is not position.order or written.dim + 1 - values.dim() != 0:
        raise Mixes("writes rows of the batch into other rows")
    return Rows(rows.dim, order=rows.order)


def _row_mask(call: Call, indices: list, d: int) -> bool:
    """indices[d] is a boolean mask whose first dim is the batch, the only index with rows."""
    mask = indices[d] if d < len(indices) else None
    return mask is not None and mask.dtype == torch.bool and call.dim(mask) == 0 and \
        order_of(call, [mask, call.named["self"]]) is None and \
        all(call.rows(i) is None for i in indices if i is not None and i is not mask)
