"""Row rules for views and layout ops (`rows.py`): where the batch's dim goes when
a tensor is reshaped, permuted, viewed as complex, sliced, split, concatenated, padded
or restrided."""

from __future__ import annotations

import math
from dataclasses import replace

import sympy

from ..._compat import shapes
from .row_rules import Call, Mixes, Rows, is_int, rule, whole


@rule("view", "_unsafe_view", "reshape", "_reshape_alias", "view_copy", "squeeze", "unsqueeze",
      "squeeze_copy", "unsqueeze_copy", "_reshape_copy", keeps_order=True, reads_positions=True)
def reshape(call: Call) -> list:
    """A view in row-major order keeps rows apart when the batch's blocks stay whole:
    [s, L, D] -> [s*L, D] (blocks of L), [s, H*Dh] -> [s, H, Dh]; not [2, s] -> [s, 2].
    Entries in a sort's order keep their places: the batch dim's size stays, leading."""
    x, out = call.tensors[0], call.outs[0]
    rows = call.rows(x)
    if rows is None:
        return [None]
    dims = call.batch_dims(out)
    if len(dims) != 1:
        raise Mixes(f"reshapes the batch dim into {len(dims)} dims")
    d, o, s, expr = rows.dim, dims[0], call.state.symbol, call.state.expr
    outer = expr(math.prod(x.shape[:d])) * rows.outer
    inner = expr(x.shape[d]) / (rows.outer * s) * expr(math.prod(x.shape[d + 1:]))
    outer_out = outer / expr(math.prod(out.shape[:o]))
    inner_out = inner / expr(math.prod(out.shape[o + 1:]))
    if not (whole(outer_out) and whole(inner_out) and s not in (outer_out * inner_out).free_symbols
            and sympy.cancel(outer_out * inner_out * s - expr(out.shape[o])) == 0):
        raise Mixes("reshapes so that rows of the batch interleave with another dim")
    if rows.order is not None and not (expr(math.prod(x.shape[:d])) == 1 == expr(math.prod(out.shape[:o]))
                                       and sympy.cancel(expr(x.shape[d]) - expr(out.shape[o])) == 0):
        raise Mixes("reshapes entries in a sorted order so that they change places")
    return [replace(rows, dim=o, outer=outer_out)]


@rule("permute", "permute_copy", "transpose", "transpose_copy", "t", "t_copy", keeps_order=True,
      reads_positions=True)
def permute(call: Call) -> list:
    x = call.tensors[0]
    rows = call.rows(x)
    n = x.dim()
    if rows is None or n < 2:
        return [rows]
    if call.name.startswith("permute"):
        order = [d % n for d in call.named["dims"]]
    else:
        a, b = (call.named["dim0"] % n, call.named["dim1"] % n) if "dim0" in call.named else (0, 1)
        order = list(range(n))
        order[a], order[b] = order[b], order[a]
    return [replace(rows, dim=order.index(rows.dim))]


@rule("view_as_complex", "view_as_real", keeps_order=True, reads_positions=True)
def complex_view(call: Call) -> list:
    """[..., n, 2] real pairs as [..., n] complex values and back (Meta's rotary
    embedding): the dims before the pairs, the batch's among them (a dim of 2 entries
    is never the batch's), stay where they are."""
    return [call.rows(call.tensors[0])]


@rule("cat")
def cat(call: Call) -> list:
    rank = call.outs[0].dim()
    dims = {call.dim(t) for t in call.named["tensors"] if call.rows(t) is not None}
    if call.named.get("dim", 0) % rank in dims or len(dims) > 1:
        raise Mixes("concatenates along the batch dim")
    return call.follow()


@rule("as_strided", "as_strided_", keeps_order=True)
def as_strided(call: Call) -> list:
    """Only the restriding that changes no element's place: same sizes, and the same
    strides wherever a size is not 1 (Inductor's and ATen's layouts of a fresh result)."""
    x = call.named["self"]
    rows = call.rows(x)
    size, stride = list(call.named["size"]), list(call.named["stride"])
    expr = call.state.expr
    same = len(size) == x.dim() and all(expr(a) == expr(b) for a, b in zip(x.shape, size)) \
        and all(expr(n) == 1 or expr(a) == expr(b) for n, a, b in zip(size, x.stride(), stride)) \
        and (call.named.get("storage_offset") is None
             or expr(call.named["storage_offset"]) == expr(x.storage_offset()))
    if rows is not None and not same:
        raise Mixes("restrides memory across rows of the batch")
    return [rows]


@rule("slice", keeps_order=True)
def slice_(call: Call) -> list:
    """Rows of a slice along the batch must be all of them: x[:s] is, x[1:] is not. A
    shared tensor sliced to the batch's length (`table[:s]`) has row r = table[r]."""
    x = call.named["self"]
    rows = call.rows(x)
    dim = call.named.get("dim", 0) % max(x.dim(), 1)
    if rows is None or rows.dim != dim:
        return [rows] if rows is not None else call.follow()
    start, end, step = call.named.get("start"), call.named.get("end"), call.named.get("step", 1)
    # `x[:]` and `x[:, None]` slice to sys.maxsize, which symbolic reasoning does not compare with s.
    reaches_end = end is None or isinstance(end, int) and end >= 2**62 or shapes.known_true(end >= x.shape[dim])
    every_row = (start is None or is_int(start, 0)) and is_int(step, 1) and reaches_end
    if not every_row:
        raise Mixes(f"takes some rows of the batch (dim {dim}), not all of them")
    return [rows]


@rule("split", "split_with_sizes", "unsafe_split", "unsafe_split_with_sizes", keeps_order=True)
def split(call: Call) -> list:
    """Splitting along the batch dim only separates the ranks' blocks of an all-gather."""
    x = call.named["self"]
    rows = call.rows(x)
    dim = call.named.get("dim", 0) % max(x.dim(), 1)
    if rows is None:
        return call.follow()
    if rows.dim != dim:
        return [rows] * len(call.outs)
    block = call.state.expr(x.shape[dim]) / rows.outer
    if rows.outer != 1 and all(sympy.cancel(call.state.expr(t.shape[dim]) - block) == 0 for t in call.outs):
        return [Rows(dim)] * len(call.outs)
    raise Mixes(f"splits the batch dim (dim {dim}) into parts")


@rule("all_gather_into_tensor", "all_gather_into_tensor_out")
def all_gather(call: Call) -> list:
    rows = call.rows(call.tensors[0])
    if rows is not None and rows.dim != 0:
        return [rows]
    return [None if rows is None else Rows(0, call.named["group_size"] * rows.outer)]


@rule("repeat")
def repeat(call: Call) -> list:
    x = call.tensors[0]
    d = call.dim(x)
    if d is None:
        return call.follow()
    repeats = call.named["repeats"]
    e = d + len(repeats) - x.dim()
    if not is_int(repeats[e], 1):
        raise Mixes("repeats the batch dim")
    return [Rows(e)]


@rule("constant_pad_nd")
def pad(call: Call) -> list:
    x = call.tensors[0]
    d = call.dim(x)
    if d is not None:
        first = 2 * (x.dim() - 1 - d)
        if not all(is_int(w, 0) for w in call.named["pad"][first:first + 2]):
            raise Mixes("pads the batch dim")
    return call.follow()
