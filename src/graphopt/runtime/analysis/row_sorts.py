"""Row rules for the batch's entries sorted, computed on in groups and put back
(`rows.py`): how a mixture of experts runs its experts (transformers' `grouped_mm`).

    keys, perm = sort(expert_ids)             entries of the rows, in the sort's order
    x = hidden[perm // k]                     position i reads the token of entry perm[i]
    offs = cumsum(histc(keys, E, 0, E - 1))   group bounds: counts over every row ...
    y = grouped_mm(x, w, offs)                ... that only give position i its own key's expert
    inv[perm] = arange(S);  out = y[inv]      each entry back at its row's place

Every step keeps each entry's values its own; only their places move, and `order`
(one per sort) follows them. Padded rows add entries, which moves the real entries'
places but not their values. What would let places leak into values mixes rows: a
scan or reduction along the sorted dim, a position used as a number, the counts read
by anything but a grouped matmul over the same sort's keys, a sorted output.
"""

from __future__ import annotations

from dataclasses import replace

from .row_rules import Call, Groups, Index, Mixes, Rows, along_rule, is_int, pointwise, positional, rule, whole

_SORT_ALONG_OTHER_DIMS = along_rule("sorts", "dim")
_SCAN = along_rule("scans", "dim")


@rule("sort", "argsort", keeps_order=True)
def sort(call: Call) -> list:
    """Along a 1-D batch dim: the keys (ascending: they may bound groups) and the
    entries' positions, both in a new order; along any other dim, as a scan."""
    x = call.named["self"]
    rows = call.rows(x)
    if rows is None or rows.dim != call.named["dim"] % max(x.dim(), 1):
        return _SORT_ALONG_OTHER_DIMS(call)
    if x.dim() != 1 or rows.outer != 1 or rows.order is not None:
        raise Mixes("sorts along the batch dim")
    order = object()  # this sort's order, compared by identity
    positions = Rows(0, order=order, index=Index(call.per_row(x, rows), onto=True))
    if call.name == "argsort":
        return [positions]
    return [Rows(0, order=order, bound=rows.bound, keys=not call.named["descending"]), positions]


@rule("floor_divide", "div", keeps_order=True)
def divide(call: Call) -> list:
    """`perm // k`: positions of a row's k-entry blocks become positions of the rows' entries."""
    result = pointwise(call)
    rows, k = call.rows(call.named["self"]), call.named.get("other")
    floor = call.name == "floor_divide" or call.named.get("rounding_mode") == "floor"
    if rows is None or rows.index is None or positional(rows) or not floor or not isinstance(k, int) or k < 1:
        return result
    per_row = rows.index.per_row / k
    return [replace(r, index=Index(per_row)) if whole(per_row) else r for r in result]


@rule("histc", keeps_order=True)
def histc(call: Call) -> list:
    """Counts of a sort's keys, one bin per key value: they bound the groups of that
    sort's order. Keys are proven in range by their bound (topk's indices)."""
    x, bins = call.named["self"], call.named["bins"]
    rows = call.rows(x)
    exact_bins = isinstance(bins, int) and is_int(call.named["min"], 0) and is_int(call.named["max"], bins - 1)
    bounded = rows is not None and rows.bound is not None and rows.bound <= bins
    if not (bounded and rows.keys and x.dim() == 1 and exact_bins):
        raise Mixes("counts values over every row of the batch")
    return [Groups(rows.order, bins)]


@rule("cumsum", reads_groups=True)
def cumsum(call: Call) -> list:
    groups = call.groups(call.named["self"])
    if groups is None:
        return _SCAN(call)
    if groups.cumulative or call.named["dim"] not in (0, -1):
        raise Mixes("reads counts taken over every row of the batch")
    return [replace(groups, cumulative=True)]


@rule("_grouped_mm", "grouped_mm_fallback", keeps_order=True, reads_groups=True)
def grouped_mm(call: Call) -> list:
    """x @ w[g] for each position of x, g its group: rows in a sort's order, grouped by
    the offsets of that sort's keys, so each position uses its own key's weight."""
    x, w = call.tensors[0], call.tensors[1]
    rows, groups = call.rows(x), call.groups(call.named.get("offs"))
    others = [t for t in call.tensors[1:] if call.rows(t) is not None or
              (call.groups(t) is not None and t is not call.named.get("offs"))]
    if call.func.namespace not in ("aten", "transformers") or rows is None or groups is None or others or \
            not (groups.cumulative and groups.order is rows.order and rows.order is not None and
                 rows.dim == 0 and x.dim() == 2 and w.dim() == 3 and is_int(w.shape[0], groups.bins)):
        raise Mixes("multiplies groups of rows whose bounds are not the groups of their sorted keys")
    return [Rows(0, order=rows.order)]
