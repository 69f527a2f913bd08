"""Redundant-node elimination: ops that return their input, and pairs or chains of
ops that cancel or compose into one.

Every rewrite goes through `GraphFacts.substitute`, so nothing written in place,
returned, or read through its storage changes meaning.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .._compat.shapes import known_true, same_sizes
from .base import CASTS, GraphFacts, PassResult, alias_root, changes_only_dtype, is_contiguous, value_of

aten = torch.ops.aten

_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_PERMUTES = (aten.permute.default, aten.transpose.int, aten.t.default)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
# The expands and flatten/restore reshapes around these are the decomposition of a
# linear or a batched matmul, which recompose_linear / recompose_matmul turn back
# into one call: they are left as they are.
_MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
# The `end` of `x[a:]`: symbolic sizes have no upper bound to compare it with.
_SLICE_TO_END = 2**63 - 1
_INTEGER_ROUNDING = (aten.ceil.default, aten.floor.default, aten.round.default, aten.trunc.default)

_F16, _BF16, _F32, _F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
_I8, _I16, _I32, _I64 = torch.int8, torch.int16, torch.int32, torch.int64
# dtype -> the dtypes that hold each of its values exactly.
_EXACT_WIDENINGS: dict[torch.dtype, set[torch.dtype]] = {
    torch.bool: {torch.uint8, _I8, _I16, _I32, _I64, _F16, _BF16, _F32, _F64},
    torch.uint8: {_I16, _I32, _I64, _F16, _BF16, _F32, _F64},
    _I8: {_I16, _I32, _I64, _F16, _BF16, _F32, _F64},
    _I16: {_I32, _I64, _F32, _F64},
    _I32: {_I64, _F64},
    _F16: {_F32, _F64},
    _BF16: {_F32, _F64},
    _F32: {_F64},
}


def remove_noops(gm: torch.fx.GraphModule) -> PassResult:
    """Drop ops that return their input's value unchanged.

        before:  slice_1 = aten.slice(x, 0, 0, 9223372036854775807);  y = aten.mul(slice_1, 2)
        after:   y = aten.mul(x, 2)

    Views and reshapes to the same shape, full-range slices, `expand` to the same
    shape, identity permutes, `clone`/`contiguous`/`alias`/casts/copies that keep
    dtype and layout, `cat` of one input, `repeat` by ones, zero padding, and
    rounding of integers. A copy stays when it or its source is written in place
    (the copy is what keeps the write apart), and when removing it would make an
    output alias an input or another output. Shapes are compared symbolically.
    """
    facts = GraphFacts(gm.graph)
    removed = 0
    for node in gm.graph.nodes:  # FX's iterator skips nodes erased on the way
        if node.op == "call_function":
            source = _noop_source(node)
            if source is not None and facts.substitute(node, source):
                removed += 1
    return PassResult(changed=removed > 0, counts={"removed": removed} if removed else {})


def _noop_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The value `node` equals, judged by its op and arguments (the layout and the
    aliasing are checked by `substitute`)."""
    target, args = node.target, node.args
    if not args or not isinstance(args[0], (torch.fx.Node, list, tuple)):
        return None
    if target is aten.cat.default:
        return args[0][0] if len(args[0]) == 1 else None
    if target in (aten.copy.default, aten.slice_scatter.default):
        source = args[1]  # copy(dst, src) and a scatter of src over all of dst are src
        return source if target is aten.copy.default or _full_slice(args[0], *args[2:]) else None
    x, val, x_val = args[0], value_of(node), value_of(args[0])
    if val is None or x_val is None:
        return None
    if target is aten.expand.default and _feeds_matmul(node):
        return None
    if target in (*_RESHAPES, aten.expand.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        return x if same_sizes(val.shape, x_val.shape) else None
    if target is aten.slice.Tensor:
        return x if _full_slice(x, *args[1:]) else None
    if target in _PERMUTES:
        return x if _permutation(node) == list(range(x_val.dim())) else None
    if target in (aten.alias.default, aten.clone.default, aten.lift_fresh_copy.default, *CASTS,
                  aten.view.dtype):
        return x if val.dtype == x_val.dtype and not node.kwargs.get("pin_memory") else None
    if target is aten.repeat.default:
        return x if all(r == 1 for r in args[1]) else None
    if target is aten.constant_pad_nd.default:
        return x if all(p == 0 for p in args[1]) else None
    if target in _INTEGER_ROUNDING:
        return x if not x_val.dtype.is_floating_point else None
    return None


def _feeds_matmul(node: torch.fx.Node) -> bool:
    """Whether `node`, through reshapes and expands only, is an operand of mm/addmm/bmm."""
    todo = list(node.users)
    while todo:
        user = todo.pop()
        if user.target in _MATMULS:
            return True
        if user.target in (*_RESHAPES, aten.expand.default):
            todo.extend(user.users)
    return False


def _full_slice(x: torch.fx.Node, dim: int = 0, start: object = None, end: object = None,
                step: object = 1) -> bool:
    val = value_of(x)
    if val is None:
        return False
    size = val.shape[dim]
    start, end, step = (a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in (start, end, step))
    return (start is None or known_true(start == 0)) and known_true(step == 1) \
        and (end is None or known_true(end >= _SLICE_TO_END) or known_true(end >= size))


def _permutation(node: torch.fx.Node) -> list[int] | None:
    """The dims of its input that a transpose/permute/t puts in each place."""
    val = value_of(node.args[0])
    if val is None or node.target not in _PERMUTES:
        return None
    rank = val.dim()
    perm = list(range(rank))
    if node.target is aten.permute.default:
        return [d % rank for d in node.args[1]]
    if node.target is aten.transpose.int:
        a, b = node.args[1] % max(rank, 1), node.args[2] % max(rank, 1)
        perm[a], perm[b] = perm[b], perm[a]
    elif rank == 2:  # aten.t swaps a matrix, and leaves 0-d and 1-d tensors alone
        perm = [1, 0]
    return perm


def remove_redundant(gm: torch.fx.GraphModule) -> PassResult:
    """Cancel pairs of ops and collapse chains into one op.

        before:  t1 = aten.transpose(x, 1, 2);  t2 = aten.transpose(t1, 1, 2);  y = aten.mm(a, t2)
        after:   y = aten.mm(a, x)
        before:  v1 = aten.view(x, [b, 4, 2]);  v2 = aten.view(v1, [b, 2, 4])
        after:   v2 = aten.view(x, [b, 2, 4])

    - transposes/permutes that cancel are dropped (also a double transpose of a
      matmul operand); two in a row become one `permute`;
    - `view`/`reshape` chains of a contiguous tensor become one (except the
      flatten/restore reshapes around mm/addmm/bmm, which the linear and matmul
      recompositions match);
    - `x.to(a).to(b)` becomes `x.to(b)` when `a` holds every value of x's dtype
      exactly (and is not a float step before an integer cast: out-of-range float
      to int conversion is undefined), and `x` itself when `b` is x's dtype
      (f16 -> f32 -> f16; f32 -> f16 -> f32 stays); `neg(neg(x))` becomes `x`;
    - `split(cat([a, b, c]))` into the same pieces gives back `a`, `b`, `c`.
    Chains collapse only when the inner op has no other reader, so each rewrite
    removes a node.
    """
    facts = GraphFacts(gm.graph)
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:  # FX's iterator skips nodes erased on the way
        if node.op != "call_function":
            continue
        rule = _RULES.get(node.target)
        if rule is not None and rule(facts, node):
            name = rule.__name__.lstrip("_")
            counts[name] = counts.get(name, 0) + 1
    return PassResult(changed=bool(counts), counts=counts)


def _single_user_input(node: torch.fx.Node, targets: tuple) -> torch.fx.Node | None:
    inner = node.args[0]
    if isinstance(inner, torch.fx.Node) and inner.target in targets and len(inner.users) == 1:
        return inner
    return None


def _permutes(facts: GraphFacts, node: torch.fx.Node) -> bool:
    inner = node.args[0]
    if not (isinstance(inner, torch.fx.Node) and inner.target in _PERMUTES):
        return False
    outer_perm, inner_perm = _permutation(node), _permutation(inner)
    if outer_perm is None or inner_perm is None:
        return False
    composed = [inner_perm[d] for d in outer_perm]
    source = inner.args[0]
    if composed == list(range(len(composed))):
        return facts.substitute(node, source)
    if len(inner.users) != 1:
        return False
    return facts.replace_with(node, aten.permute.default, (source, composed))


def _reshapes(facts: GraphFacts, node: torch.fx.Node) -> bool:
    inner = _single_user_input(node, _RESHAPES)
    if inner is None:
        return False
    source = inner.args[0]
    val, out = value_of(source), value_of(node)
    if val is None or out is None or not is_contiguous(val) \
            or getattr(source, "target", None) in _MATMULS or _feeds_matmul(node):
        return False
    if same_sizes(out.shape, val.shape):
        return facts.substitute(node, source)
    return facts.replace_with(node, node.target, (source, *node.args[1:]), node.kwargs)


def _casts(facts: GraphFacts, node: torch.fx.Node) -> bool:
    inner = _single_user_input(node, CASTS)
    if inner is None or not (changes_only_dtype(node) and changes_only_dtype(inner)):
        return False
    source = inner.args[0]
    x, a, b = (value_of(n) for n in (source, inner, node))
    if x is None or a is None or b is None or alias_root(source) in facts.written:
        return False  # the new cast reads `source` later than `inner` did
    exact = a.dtype == x.dtype or a.dtype in _EXACT_WIDENINGS.get(x.dtype, ())
    float_to_int = a.dtype.is_floating_point and not b.dtype.is_floating_point \
        and b.dtype is not torch.bool and x.dtype is not torch.bool
    if not exact or float_to_int:
        return False
    if b.dtype == x.dtype and facts.substitute(node, source):
        return True  # a cast and its exact inverse: f16 -> f32 -> f16 is the f16 tensor
    return facts.replace_with(node, node.target, (source, *node.args[1:]), node.kwargs)


def _negs(facts: GraphFacts, node: torch.fx.Node) -> bool:
    inner = node.args[0]
    if isinstance(inner, torch.fx.Node) and inner.target is aten.neg.default:
        return facts.substitute(node, inner.args[0])
    return False


def _splits(facts: GraphFacts, node: torch.fx.Node) -> bool:
    """`split(cat(pieces, d), sizes, d)`: each getitem of the split is its piece."""
    cat = node.args[0]
    if not (isinstance(cat, torch.fx.Node) and cat.target is aten.cat.default):
        return False
    pieces, val = cat.args[0], value_of(cat)
    split_dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    cat_dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    outs = node.meta.get("val")
    if val is None or not isinstance(outs, (list, tuple)) or len(outs) != len(pieces) \
            or split_dim % val.dim() != cat_dim % val.dim():
        return False
    if not all(value_of(p) is not None and same_sizes(value_of(p).shape, o.shape) for p, o in zip(pieces, outs)):
        return False
    replaced = False
    for user in list(node.users):
        if user.target is operator.getitem:
            replaced |= facts.substitute(user, pieces[user.args[1]])
    return replaced


_RULES = {
    **{t: _permutes for t in _PERMUTES},
    **{t: _reshapes for t in _RESHAPES},
    **{t: _casts for t in CASTS},
    aten.neg.default: _negs,
    **{t: _splits for t in _SPLITS},
}
