"""The rules of the row analysis (`rows.py`): for each ATen op that can keep rows of
the batch apart, where its outputs' rows come from, or why it mixes them.

A rule takes a `Call` and returns, per tensor output, `Rows(dim)` (that dim holds
one block per row of the batch) or None (shared: not computed from rows), or
raises `Mixes`. `rows.py` checks what every rule returns against the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import sympy
import torch

from ..._compat import ops
from ..._compat.names import tensor_leaves
from ...kernels.collective import is_collective_op
from .safety import named_arguments


@dataclass(frozen=True)
class Index:
    """Values that are positions along a dim of `per_row` entries per row, each one
    pointing into its own row: `arange(s)` (per_row 1), a sort's indices. `order` is
    that dim's order (None: the rows'); positions in a sorted order are only good for
    indexing tensors in that order, never as numbers."""
    per_row: Any
    order: Any = None
    onto: bool = False      # every position appears once (a permutation)
    identity: bool = False  # position i holds i (an arange)


@dataclass(frozen=True)
class Rows:
    dim: int
    outer: Any = 1              # blocks of rows along `dim` (the ranks' rows after an all-gather)
    index: Index | None = None  # the values are positions (see Index)
    order: Any = None           # `dim` holds the rows' entries in a sort's order (row-wise values, moved)
    bound: int | None = None    # the values lie in [0, bound) (indices from topk, argmax, sort)
    keys: bool = False          # the values are the ascending keys of the sort that made `order`


@dataclass(frozen=True)
class Groups:
    """Counts (`cumulative`: offsets) of a sort's keys over `bins` groups: they depend on
    every row, so only a grouped matmul over rows in that sort's `order` may read them."""
    order: Any
    bins: int
    cumulative: bool = False


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
        self.tensors = tensor_leaves((args, kwargs))

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

    def per_row(self, t: torch.Tensor, rows: Rows) -> Any:
        """How many entries of each row `t`'s batch dim holds."""
        return sympy.cancel(self.state.expr(t.shape[rows.dim]) / (rows.outer * self.state.symbol))

    def groups(self, t: Any) -> Groups | None:
        return self.state.groups_of(t) if isinstance(t, torch.Tensor) else None

    def follow(self) -> list[Rows | None]:
        """Each output's rows are at its one dim sized by the batch (None without one)."""
        return [Rows(dims[0]) if len(dims := self.batch_dims(t)) == 1 else None for t in self.outs]


def positional(rows: Rows | None) -> bool:
    """The values are positions in a sort's order: they depend on every row's key."""
    return rows is not None and rows.index is not None and rows.index.order is not None


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


def rule(*names: str, keeps_order: bool = False, reads_positions: bool = False,
         reads_groups: bool = False) -> Callable[[Rule], Rule]:
    """Register a rule for `names`. Only a rule that says so is given rows in a sort's
    order (`keeps_order`: it puts the order on its outputs), positions in a sorted order
    (`reads_positions`: it uses them only to index tensors in that order) or a sort's
    counts (`reads_groups`); `rows.py` refuses the others such inputs."""
    def register(fn: Rule) -> Rule:
        fn.keeps_order, fn.reads_positions, fn.reads_groups = keeps_order, reads_positions, reads_groups
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
    if ops.is_pointwise(func):
        return pointwise
    if is_collective_op(func) and func.overloadpacket.__name__ in ("all_reduce", "all_reduce_", "allreduce_",
                                                                   "broadcast", "broadcast_"):
        return pointwise
    return None


# Ops whose output holds the values of their one input: an index stays one through them.
SAME_VALUES = {"clone", "contiguous", "detach", "alias", "lift_fresh", "lift_fresh_copy", "_to_copy",
               "_to_dim_order_copy", "expand", "expand_copy"}


@rule(*SAME_VALUES, "copy", "fill", "zero", "masked_fill", "where", "resolve_conj", "resolve_neg", "clamp",
      "wait_tensor", *NO_DATA, "empty", "zeros", "ones", "full", "empty_strided", "scalar_tensor",
      keeps_order=True, reads_positions=True)
def pointwise(call: Call) -> list:
    """Broadcasting: each input's dims line up with the output's from the right; a
    shared input broadcast along the batch (`expand(s, n)`, `zeros(s)`) gives rows alike.
    Rows in a sort's order combine only with rows in the same order."""
    if not call.outs:
        return []
    out = call.outs[0]
    found, last = None, None
    for t in call.tensors if call.name not in NO_DATA else ():
        rows = call.rows(t)
        if rows is not None:
            aligned = (rows.dim + out.dim() - t.dim(), rows.outer, rows.order)
            if found not in (None, aligned):
                raise Mixes("combines rows of the batch that broadcasting lines up with different dims"
                            if found[2] is aligned[2] else "combines rows in a sorted order with rows in another")
            found, last = aligned, rows
            if positional(rows) and call.name not in SAME_VALUES:
                raise Mixes("uses positions in a sorted order as numbers")
    if found is None:
        return call.follow()
    dim, outer, order = found
    if call.name in SAME_VALUES:
        return [replace(last, dim=dim)] * len(call.outs)
    return [Rows(dim, outer, order=order)] * len(call.outs)


@rule("arange")
def arange(call: Call) -> list:
    """arange(s*c): entry e holds e, the identity index of a dim of c entries per row
    (`x[arange(s), j]` reads row r for row r)."""
    start, end, step = call.named.get("start", 0), call.named.get("end"), call.named.get("step", 1)
    per_row = sympy.cancel(call.state.expr(end) / call.state.symbol)
    index = None
    if is_int(start, 0) and is_int(step, 1) and call.state.symbol not in per_row.free_symbols and whole(per_row):
        index = Index(per_row, onto=True, identity=True)
    return [Rows(dims[0], index=index) if len(dims := call.batch_dims(t)) == 1 else None for t in call.outs]


def _dims(value: Any, ndim: int) -> set[int]:
    """An op's `dim` argument as a set of dims: None or [] means every dim."""
    if value is None or value == []:
        return set(range(max(ndim, 1)))
    return {d % max(ndim, 1) for d in (value if isinstance(value, (list, tuple)) else [value])}


# Where an op returns indices along its dim: they lie in [0, that dim's size).
INDEX_OUTPUTS = {"topk": 1, "sort": 1, "argsort": 0, "argmax": 0, "argmin": 0, "max": 1, "min": 1}


def along_rule(what: str, argument: str) -> Rule:
    """An op along `argument`'s dims that must not be the batch's."""
    def along(call: Call) -> list:
        x = call.tensors[0]
        if "other" in call.named:  # max(a, b), min(a, b): elementwise
            return pointwise(call)
        d = call.dim(x)
        dims = _dims(call.named.get(argument), x.dim())
        if d is not None and d in dims:
            raise Mixes(f"{what} along the batch dim (dim {d})")
        result = call.follow()
        at = INDEX_OUTPUTS.get(call.name)
        if at is not None and at < len(result) and result[at] is not None and len(dims) == 1 and \
                isinstance(n := x.shape[next(iter(dims))], int):
            result[at] = replace(result[at], bound=n)
        return result
    return along


for _names, _what, _argument in [
    (("sum", "mean", "amax", "amin", "prod", "var", "std", "var_mean", "std_mean", "logsumexp", "nansum",
      "all", "any", "count_nonzero", "argmax", "argmin", "max", "min", "aminmax", "median", "nanmedian",
      "mode", "kthvalue", "linalg_vector_norm", "norm"), "reduces", "dim"),
    (("cumprod", "logcumsumexp", "cummax", "cummin", "_softmax", "_log_softmax", "topk"),
     "scans or normalises", "dim"),
    (("flip",), "reverses the order", "dims"),
    (("roll",), "rolls", "dims"),
    (("unfold",), "slides a window", "dimension"),
    (("select",), "takes one row", "dim"),
    (("unbind",), "takes rows apart", "dim"),
    (("index_select",), "gathers rows", "dim"),
    (("index_fill",), "fills rows", "dim"),
]:
    rule(*_names)(along_rule(_what, _argument))


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


@rule("decode_attention")
def decode_attention(call: Call) -> list:
    """graphopt::decode_attention: row i attends with query[i], positions[i] and
    allowed[i] (or positions and a mask shared by every row) over cache row slots[i], a
    shared cache read per row, or over key[i] and value[i] without slots."""
    query, key, value, slots, positions = (call.named[n] for n in ("query", "key", "value", "slots", "positions"))
    allowed = call.named.get("allowed")
    cache_rows = [key, value] if slots is None else []
    if call.func.namespace != "graphopt" or \
            any(call.dim(t) not in (None, 0) for t in [query, slots, *cache_rows] if t is not None) or \
            (slots is not None and (call.rows(key) is not None or call.rows(value) is not None)) or \
            positions is not None and call.dim(positions) not in (
                None, positions.dim() - 2 if positions.dim() >= 2 else -1) or \
            allowed is not None and call.dim(allowed) not in (None, allowed.dim() - 3):
        raise Mixes("attends across rows of the batch")
    return call.follow()


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
