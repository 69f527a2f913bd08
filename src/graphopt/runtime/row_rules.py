"""The rules of the row analysis (`rows.py`): for each ATen op that can keep rows of
the batch apart, where its outputs' rows come from, or why it mixes them.

A rule takes a `Call` and returns, per tensor output, `Rows(dim)` (that dim holds
one block per row of the batch) or None (shared: not computed from rows), or
raises `Mixes`. `rows.py` checks what every rule returns against the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
from torch.utils._pytree import tree_leaves

from ..kernels.collective import is_collective_op
from .safety import named_arguments


@dataclass(frozen=True)
class Rows:
    dim: int
    outer: Any = 1      # blocks of rows along `dim` (the ranks' rows after an all-gather)
    iota: bool = False  # each value is its row's index (`arange(s)`): indexing the batch with it is per row


class Mixes(Exception):
    """An op reads several rows of the batch to compute one: the message says how."""


class Call:
    """One ATen call as a rule sees it, for one batch (`state`: a BatchRows)."""

    def __init__(self, func: Any, args: tuple, kwargs: dict, outs: list, state: Any):
        self.func, self.outs, self.state = func, outs, state
        name = func.overloadpacket.__name__
        self.name = name[:-1] if name.endswith("_") and not name.endswith("__") else name
        self.named = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
        self.named.update(named_arguments(func, args, kwargs))
        self.tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]

    def rows(self, t: Any) -> Rows | None:
        return self.state.of(t) if isinstance(t, torch.Tensor) else None

    def dim(self, t: Any) -> int | None:
        """The batch dim of `t` (None: shared); rows of several ranks still interleaved mix here."""
        rows = self.rows(t)
        if rows is not None and rows.outer != 1:
            raise Mixes("reads rows that several ranks interleaved before they are split apart")
        return None if rows is None else rows.dim

    def batch_dims(self, t: torch.Tensor) -> list[int]:
        """The dims of `t` whose size carries the batch."""
        return [d for d, size in enumerate(t.shape) if self.state.carries(size)]

    def follow(self) -> list[Rows | None]:
        """Each output's rows are at its one dim sized by the batch (None without one)."""
        return [Rows(dims[0]) if len(dims := self.batch_dims(t)) == 1 else None for t in self.outs]


def free(value: Any) -> set:
    """The symbols of a SymInt / SymFloat / SymBool (empty for anything else)."""
    expr = getattr(getattr(value, "node", None), "expr", None)
    return getattr(expr, "free_symbols", set())


def is_int(value: Any, n: int) -> bool:
    """`value` is the plain int n (a SymInt is never compared: that would add a guard)."""
    return isinstance(value, int) and value == n


def whole(quotient: Any) -> bool:
    return sympy.fraction(sympy.factor(quotient))[1] == 1


Rule = Callable[[Call], list]
RULES: dict[str, Rule] = {}


def rule(*names: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        RULES.update(dict.fromkeys(names, fn))
        return fn
    return register


# Arguments where the batch size may appear: sizes of views and of new tensors.
SIZE_ARGUMENTS = {"size", "shape", "stride", "sizes", "split_size", "split_sizes", "end", "N"}
# Ops that read only their inputs' shapes, dtypes and devices.
NO_DATA = {"empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones",
           "new_full", "new_empty_strided"}
# Ops that read metadata only and return numbers or nothing.
METADATA = {"device", "layout", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride", "dim",
            "is_contiguous", "_assert_tensor_metadata", "is_same_size", "record_stream"}
# Writes at positions the data chooses: trusted to be per row (a padded row writes where pad_values sends it).
PER_ROW_WRITES = {"index_put", "_index_put_impl", "index_copy", "index_add", "scatter", "scatter_add",
                  "scatter_reduce"}


def rowwise(call: Call) -> list:
    """An op the user declared row-wise (`rowwise_ops`)."""
    return call.follow()


def pointwise_rule(func: Any) -> Rule | None:
    if torch.Tag.pointwise in getattr(func, "tags", ()):
        return pointwise
    if is_collective_op(func) and func.overloadpacket.__name__ in ("all_reduce", "all_reduce_", "allreduce_",
                                                                   "broadcast", "broadcast_"):
        return pointwise
    return None


# Ops whose output holds the values of their one input: an iota stays one through them.
SAME_VALUES = {"clone", "contiguous", "detach", "alias", "lift_fresh", "lift_fresh_copy", "_to_copy",
               "_to_dim_order_copy", "expand", "expand_copy"}


@rule(*SAME_VALUES, "copy", "fill", "zero", "masked_fill", "where", "resolve_conj", "resolve_neg", "clamp",
      "wait_tensor", *NO_DATA, "empty", "zeros", "ones", "full", "empty_strided", "scalar_tensor")
def pointwise(call: Call) -> list:
    """Broadcasting: each input's dims line up with the output's from the right; a
    shared input broadcast along the batch (`expand(s, n)`, `zeros(s)`) gives rows alike."""
    if not call.outs:
        return []
    out = call.outs[0]
    found, iota = None, False
    for t in call.tensors if call.name not in NO_DATA else ():
        rows = call.rows(t)
        if rows is not None:
            aligned = (rows.dim + out.dim() - t.dim(), rows.outer)
            if found not in (None, aligned):
                raise Mixes("combines rows of the batch that broadcasting lines up with different dims")
            found, iota = aligned, rows.iota
    if found is None:
        return call.follow()
    return [Rows(*found, iota and call.name in SAME_VALUES)] * len(call.outs)


@rule("arange")
def arange(call: Call) -> list:
    """arange(s): row r holds r, an iota (`x[arange(s), j]` reads row r for row r)."""
    start, end, step = call.named.get("start", 0), call.named.get("end"), call.named.get("step", 1)
    iota = is_int(start, 0) and is_int(step, 1) and call.state.expr(end) == call.state.symbol
    return [Rows(dims[0], 1, iota) if len(dims := call.batch_dims(t)) == 1 else None for t in call.outs]


def _dims(value: Any, ndim: int) -> set[int]:
    """An op's `dim` argument as a set of dims: None or [] means every dim."""
    if value is None or value == []:
        return set(range(max(ndim, 1)))
    return {d % max(ndim, 1) for d in (value if isinstance(value, (list, tuple)) else [value])}


def _along(what: str, argument: str) -> Rule:
    def along(call: Call) -> list:
        x = call.tensors[0]
        if "other" in call.named:  # max(a, b), min(a, b): elementwise
            return pointwise(call)
        d = call.dim(x)
        if d is not None and d in _dims(call.named.get(argument), x.dim()):
            raise Mixes(f"{what} along the batch dim (dim {d})")
        return call.follow()
    return along


for _names, _what, _argument in [
    (("sum", "mean", "amax", "amin", "prod", "var", "std", "var_mean", "std_mean", "logsumexp", "nansum",
      "all", "any", "count_nonzero", "argmax", "argmin", "max", "min", "aminmax", "median", "nanmedian",
      "mode", "kthvalue", "linalg_vector_norm", "norm"), "reduces", "dim"),
    (("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "_softmax", "_log_softmax", "sort",
      "argsort", "topk"), "scans, sorts or normalises", "dim"),
    (("flip",), "reverses the order", "dims"),
    (("roll",), "rolls", "dims"),
    (("unfold",), "slides a window", "dimension"),
    (("select",), "takes one row", "dim"),
    (("unbind",), "takes rows apart", "dim"),
    (("index_select",), "gathers rows", "dim"),
    (("index_fill",), "fills rows", "dim"),
]:
    rule(*_names)(_along(_what, _argument))


@rule("tril", "triu")
def triangle(call: Call) -> list:
    x = call.tensors[0]
    if call.dim(x) is not None and call.dim(x) >= x.dim() - 2:
        raise Mixes("masks a triangle across the batch dim")
    return [call.rows(x)]


@rule("native_layer_norm", "_fused_rms_norm")
def norm(call: Call) -> list:
    x = call.tensors[0]
    d = call.dim(x)
    if d is not None and d >= x.dim() - len(call.named["normalized_shape"]):
        raise Mixes(f"normalises along the batch dim (dim {d})")
    return call.follow()


@rule("native_group_norm", "_native_batch_norm_legit_no_training", "native_batch_norm",
      "_native_batch_norm_legit", "convolution", "_convolution", "max_pool2d_with_indices", "avg_pool2d",
      "_adaptive_avg_pool2d", "adaptive_max_pool2d", "max_pool3d_with_indices", "avg_pool3d",
      "_adaptive_avg_pool3d", "upsample_nearest2d", "upsample_bilinear2d", "_upsample_nearest_exact2d",
      "upsample_bicubic2d", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "im2col", "col2im",
      "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d", "replication_pad2d",
      "replication_pad3d", "grid_sampler_2d")
def per_sample(call: Call) -> list:
    """Image ops: each sample of dim 0 is computed alone (a batch norm only with running statistics)."""
    if call.named.get("training"):
        raise Mixes("normalises with statistics of the whole batch (a batch norm in training mode)")
    if call.dim(call.tensors[0]) not in (None, 0) or any(call.dim(t) is not None for t in call.tensors[1:]):
        raise Mixes("mixes samples: only dim 0 of its input may carry the batch")
    return call.follow()


_OPERANDS = {"mm": ("self", "mat2"), "bmm": ("self", "mat2"), "mv": ("self", "vec"), "dot": ("self", "tensor"),
             "addmm": ("mat1", "mat2"), "baddbmm": ("batch1", "batch2"), "addmv": ("mat", "vec")}


@rule(*_OPERANDS)
def matmul(call: Call) -> list:
    """(batched) a @ b: a's rows and leading dims, b's columns and leading dims pass; the
    contracted dims (a's last, b's first of its matrix dims) must not carry the batch."""
    a, b = (call.named[n] for n in _OPERANDS[call.name])
    da, db = call.dim(a), call.dim(b)
    if da == a.dim() - 1 or db == max(b.dim() - 2, 0):
        raise Mixes("contracts the batch dim (a matmul that sums over rows)")
    if da is not None and db is not None and not da == db < a.dim() - 2:
        raise Mixes("multiplies rows of the batch with each other")
    out = call.outs[0]
    d = da if da is not None else None if db is None else out.dim() - 1 if db == b.dim() - 1 else db
    bias = call.named.get("self") if call.name.startswith("add") or call.name == "baddbmm" else None
    if call.dim(bias) is not None:
        aligned = call.dim(bias) + out.dim() - bias.dim()
        if d not in (None, aligned):
            raise Mixes("adds a bias whose rows line up with another dim of the product")
        d = aligned
    return [None if d is None else Rows(d)]


@rule("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
      "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
      "_scaled_dot_product_fused_attention_overrideable")
def attention(call: Call) -> list:
    """Attention over [batch, heads, length, dim] (a mask broadcasts from the right):
    the batch and the heads are independent, the lengths are not."""
    rank = call.tensors[0].dim()
    dims = {d + rank - t.dim() for t in call.tensors if (d := call.dim(t)) is not None}
    if len(dims) > 1 or dims - {0, 1}:
        raise Mixes("attends across rows of the batch (it is not a leading dim of q, k and v)")
    return call.follow()


@rule("embedding", "one_hot", "bucketize", "searchsorted")
def lookup(call: Call) -> list:
    """A table (or boundaries) indexed by rows of the batch: the table must be shared."""
    table = call.named.get("weight", call.named.get("boundaries", call.named.get("sorted_sequence")))
    if call.rows(table) is not None:
        raise Mixes("looks rows of the batch up by index")
    return call.follow()


@rule("index", "_unsafe_index")
def index(call: Call) -> list:
    """x[i, j]: a shared x indexed per row, or rows of x indexed along other dims."""
    x, indices = call.named["self"], call.named["indices"]
    d = call.dim(x)
    if d is not None and d < len(indices) and indices[d] is not None:
        if not getattr(call.rows(indices[d]), "iota", False):
            raise Mixes("indexes the batch dim with indices taken from data")
        rank = max(i.dim() for i in indices if i is not None)  # index tensors broadcast together
        if len({call.dim(i) + rank - i.dim() for i in indices if call.rows(i) is not None}) > 1:
            raise Mixes("indexes the batch with rows of the batch that broadcasting lines up differently")
    return call.follow()


@rule("gather", "take_along_dim")
def gather(call: Call) -> list:
    x, index_ = call.named["self"], call.named.get("index", call.named.get("indices"))
    d = call.dim(x)
    if d is not None and (_dims(call.named.get("dim"), x.dim()) == {d} or call.dim(index_) != d):
        raise Mixes("gathers along the batch dim")
    return call.follow()


@rule(*PER_ROW_WRITES)
def write_at(call: Call) -> list:
    """Writes at positions from data: into a shared tensor (a cache) they are trusted to be
    per row; into rows of the batch they must stay inside each row."""
    x = call.named["self"]
    d = call.dim(x)
    if d is None:
        return [None] * len(call.outs)
    if call.name in ("index_put", "_index_put_impl"):
        indices = call.named["indices"]
        if _row_mask(call, indices, d) and call.rows(call.named["values"]) is None:
            return [Rows(d)] * len(call.outs)  # h[mask] = v with mask[r] choosing row r: per row
        if (d < len(indices) and indices[d] is not None) or any(call.rows(i) for i in indices if i is not None):
            raise Mixes("writes across rows of the batch at positions taken from data")
        values = call.named["values"]
        if call.dim(values) is not None:  # its rows must land on the rows of x[indices]
            target = torch.ops.aten.index.Tensor(x, indices)
            if call.batch_dims(target) != [call.dim(values) + target.dim() - values.dim()]:
                raise Mixes("writes rows of the batch into other rows")
    elif _dims(call.named.get("dim"), x.dim()) == {d} or any(
            call.dim(t) not in (None, d) for t in call.tensors[1:]):
        raise Mixes("writes along the batch dim at positions taken from data")
    return [Rows(d)] * len(call.outs)


def _row_mask(call: Call, indices: list, d: int) -> bool:
    """indices[d] is a boolean mask whose first dim is the batch, the only index with rows."""
    mask = indices[d] if d < len(indices) else None
    return mask is not None and mask.dtype == torch.bool and call.dim(mask) == 0 and \
        all(call.rows(i) is None for i in indices if i is not None and i is not mask)
