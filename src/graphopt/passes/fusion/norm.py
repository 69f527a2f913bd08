"""Norm fusions: LayerNorm and RMSNorm written out with elementary ops become one op.

LayerNorm becomes `aten.native_layer_norm` (levels 1 and 2); a residual add before a
LayerNorm becomes graphopt's `skip_layer_norm` or `add_layer_norm` (level 1, on the
CPU in float32, where its C++ kernel runs). RMSNorm, residual
add + RMSNorm, and add + RMSNorm followed by the epilogues of npugraph_ex's default
fusions (per-token dynamic int8 quantization, a float32 cast) become graphopt's ops
(level 1 only: at level 2 Inductor already makes one kernel of the decomposed
chain, and an opaque op would stop it).

The matcher compares graphs op by op, so every written form is its own pattern: a
bfloat16 trace has casts a float32 one has not, `torch.rms_norm` decomposes into
`add.Scalar` over a positive dim, LlamaRMSNorm scales on the left. A match is then
re-checked against the form traced with the matched shapes and dtypes (dims,
exponents, casts and constants included); `_valid` checks what that cannot see.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..._compat import shapes
from ...kernels import layer_norm as _layer_norm_kernels  # noqa: F401 - defines graphopt::add_layer_norm & co.
from ...kernels import norm as kernels  # defines graphopt::rms_norm & co. before patterns are traced
from ..base import PassResult, value_of
from . import gates
from .replacement import Pattern, PatternSet, _inductor_trace, fwd_only

ops = torch.ops.graphopt

# Exactly a float32: torch.rms_norm's decomposition writes eps rounded to float32,
# and only an example eps equal to the written one becomes a matched argument.
_EPS = 2.0**-20

NORMS = PatternSet("fuse_norms")


def _level_1_trace(fn: Callable, args: list, **kwargs: Any) -> torch.fx.GraphModule:
    """`fwd_only` under another name. A Pattern given `fwd_only` itself is traced
    both ways at every level of its `levels`; where the two traces are one graph,
    the second is dropped as a duplicate and the first then builds the replacement
    at level 2 too: a `native_layer_norm`, which Inductor refuses in a post-grad
    graph ("both a fallback and a decomp"). So each level gets its own pattern."""
    return fwd_only(fn, args, **kwargs)


_TRACES = {1: _level_1_trace, 2: _inductor_trace}


def _add(name: str, search: Callable, replace: Callable, examples: list, extra_check: Callable,
         levels: tuple[int, ...]) -> None:
    for level in levels:
        NORMS.add(Pattern(name, search, replace, examples, _TRACES[level], extra_check,
                          scalar_workaround={"eps": _EPS}, levels=(level,)))


def fuse_norms(gm: torch.fx.GraphModule) -> PassResult:
    """Replace LayerNorm and RMSNorm written out by one op each.

        before:  pow_1 = aten.pow(add, 2);  mean = aten.mean(pow_1, [-1], True)
                 add_1 = aten.add(mean, 1e-06);  rsqrt = aten.rsqrt(add_1)
                 mul = aten.mul(add, rsqrt);  mul_1 = aten.mul(w, mul)      (add = aten.add(x, r))
        after:   add_rms_norm = graphopt.add_rms_norm(x, r, w, 1e-06, 'none')
                 mul_1 = add_rms_norm[0];  add = add_rms_norm[1]

        before:  mean = aten.mean(x, [-1], True);  sub = aten.sub(x, mean)
                 var = aten.var(x, [-1], correction=0, keepdim=True);  add = aten.add(var, 1e-05)
                 rsqrt = aten.rsqrt(add);  mul = aten.mul(sub, rsqrt);  mul_1 = aten.mul(mul, w)
                 add_1 = aten.add(mul_1, b)
        after:   native_layer_norm = aten.native_layer_norm(x, [768], w, b, 1e-05)
                 add_1 = native_layer_norm[0]

        before:  add = aten.add(dense, hidden);  native_layer_norm = aten.native_layer_norm(add, [768], w, b, 1e-12)
                 getitem = native_layer_norm[0]
        after:   getitem = graphopt.skip_layer_norm(dense, hidden, w, b, 1e-12)

    Only over the last dim, with one Python-number eps, a weight (and bias) of shape
    [last dim], a biased variance, and intermediates nobody else reads (the sum of
    a residual add may be read anywhere: add_rms_norm returns it). A residual add
    + RMSNorm whose normalised value is then only quantized per token to int8
    (amax of abs, / 127, round, clamp to [-128, 127], to int8; the value possibly
    flattened to [tokens, hidden] first) becomes `graphopt.add_rms_norm_dynamic_quant`;
    one whose normalised value is cast to float32 (possibly flattened) becomes
    `graphopt.add_rms_norm_cast`. The RMSNorm ops compute the written form's
    roundings (`kernels.norm`'s `cast`). A residual add of two same-shape float32
    CPU tensors whose sum only a LayerNorm over the last dim reads becomes
    `graphopt.skip_layer_norm` (a post-norm encoder: BERT); one whose sum is read
    elsewhere too, `graphopt.add_layer_norm`, which returns it (a pre-norm model:
    GPT-2); only where their C++ kernel is built (`gates.add_layer_norm_loses`).
    Counts are per fused op.
    """
    return NORMS(gm)


def _valid(match: Any, *, params: tuple[str, ...] = (), same_dtype: bool = False) -> bool:
    """What the re-traced pattern does not pin down: eps is one number (not a
    tensor per row), `params` are vectors over the normalised dim (in x's dtype
    when `same_dtype`), and a residual has x's shape and dtype."""
    kwargs = match.kwargs
    eps = kwargs.get("eps")
    x = value_of(kwargs.get("x"))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or x is None or x.dim() == 0:
        return False
    if "residual" in kwargs:
        residual = value_of(kwargs["residual"])
        if residual is None or residual.dtype != x.dtype or not shapes.same_shape(residual, x):
            return False
    for name in params:
        param = value_of(kwargs.get(name))
        if param is None or not shapes.same_sizes(param.shape, (x.shape[-1],)):
            return False
        if same_dtype and param.dtype != x.dtype:
            return False
    return True


def _check(**rules: Any) -> Callable[[Any], bool]:
    return lambda match: _valid(match, **rules)


def _layer_norm_patterns() -> None:
    """LayerNorm: variance as the mean of squared centered values or `var`
    (biased), `/ sqrt` or `* rsqrt`, with weight and bias, weight only or neither,
    in x's dtype or upcast to float32 (scaled after or before the cast back)."""
    for squares in (True, False):
        for use_rsqrt in (True, False):
            for search, examples in _layer_norm_forms(squares, use_rsqrt):
                params = ("weight", "bias")[:len(examples) - 1]
                _add("layer_norm", search, _LAYER_NORMS[len(params)], [*examples, _EPS],
                     _check(params=params, same_dtype=True), levels=(1, 2))


def _layer_norm(x, eps):
    return F.layer_norm(x, (x.shape[-1],), None, None, eps)


def _scaled_layer_norm(x, weight, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, None, eps)


def _affine_layer_norm(x, weight, bias, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


_LAYER_NORMS = (_layer_norm, _scaled_layer_norm, _affine_layer_norm)  # by number of params


def _add_layer_norm_patterns() -> None:
    """Residual add + torch's LayerNorm (`nn.LayerNorm`, `F.layer_norm`), with weight
    and bias, weight only or neither. The sum-not-kept form goes first: it cannot
    match where the sum has another reader, and the sum-kept form matches either."""
    for params in range(3):
        def search_skip(x, residual, *rest, params=params):
            summed = x + residual
            return _LAYER_NORMS[params](summed, *rest)

        def replace_skip(x, residual, *rest, params=params):
            return ops.skip_layer_norm(x, residual, *_affine(params, rest))

        def search_add(x, residual, *rest, params=params):
            summed = x + residual
            return _LAYER_NORMS[params](summed, *rest), summed

        def replace_add(x, residual, *rest, params=params):
            return tuple(ops.add_layer_norm(x, residual, *_affine(params, rest)))

        x = torch.zeros(2, 3, 8)
        examples = [x, torch.zeros_like(x), *[torch.zeros(8) for _ in range(params)], _EPS]  # distinct: traced apart
        names = ("x", "residual", *("weight", "bias")[:params], "eps")
        for name, search, replace in (("skip_layer_norm", search_skip, replace_skip),
                                      ("add_layer_norm", search_add, replace_add)):
            _add(name, _named(search, names), _named(replace, names), examples, _kernel_check(params), levels=(1,))


def _affine(params: int, rest: tuple) -> tuple:
    """(weight, bias, eps) from a LayerNorm's (weight?, bias?, eps)."""
    return (*rest[:-1], *[None] * (2 - params), rest[-1])


def _named(fn: Callable, names: tuple[str, ...]) -> Callable:
    """`fn(*args)` with the parameters `names`, by which the matcher names a match's arguments."""
    fn.__signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    return fn


def _kernel_check(params: int) -> Callable[[Any], bool]:
    def check(match: Any) -> bool:
        x = value_of(match.kwargs.get("x"))
        return _valid(match, params=("weight", "bias")[:params], same_dtype=True) and \
            not gates.add_layer_norm_loses(x.device, x.dtype)

    return check


def _layer_norm_forms(squares: bool, use_rsqrt: bool) -> list:
    """(search_fn, example tensors) for each way of scaling and casting one way of
    normalising. The matcher names arguments by the search_fn's parameters, so
    these close over the choice rather than take it as a parameter."""

    def normalize(x, eps):
        centered = x - x.mean(-1, keepdim=True)
        var = centered.pow(2).mean(-1, keepdim=True) if squares else x.var(-1, keepdim=True, unbiased=False)
        return centered * torch.rsqrt(var + eps) if use_rsqrt else centered / torch.sqrt(var + eps)

    def plain(x, eps):
        return normalize(x, eps)

    def scaled(x, weight, eps):
        return normalize(x, eps) * weight

    def affine(x, weight, bias, eps):
        return normalize(x, eps) * weight + bias

    def upcast(x, eps):
        return normalize(x.to(torch.float32), eps).to(x.dtype)

    def upcast_then_affine(x, weight, bias, eps):
        return normalize(x.to(torch.float32), eps).to(x.dtype) * weight + bias

    def affine_then_cast(x, weight, bias, eps):
        return (normalize(x.to(torch.float32), eps) * weight + bias).to(x.dtype)

    x32, w, b = torch.zeros(2, 3, 8), torch.zeros(8), torch.zeros(8)
    x16, w16, b16 = (t.to(torch.bfloat16) for t in (x32, w, b))
    return [(plain, [x32]), (scaled, [x32, w]), (affine, [x32, w, b]), (upcast, [x16]),
            (upcast_then_affine, [x16, w16, b16]), (affine_then_cast, [x16, w16, b16])]


@dataclass(frozen=True)
class _RmsForm:
    """One written RMSNorm: `norm(x, weight, eps)` (`norm(x, eps)` unless `scaled`),
    traced in `dtype`, computing what graphopt's ops compute with `cast`."""

    norm: Callable
    dtype: torch.dtype
    cast: str
    scaled: bool = True


def _llama(x, weight, eps):  # transformers' LlamaRMSNorm / Qwen2RMSNorm, graphopt.models' RMSNorm
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _scale_first(x, weight, eps):  # LlamaRMSNorm's float32 graph, and the same written without casts
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _scale_last(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _torch_rms_norm(x, weight, eps):  # torch.rms_norm / nn.RMSNorm, as AOTAutograd decomposes them
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


def _llama_unscaled(x, eps):
    x32 = x.to(torch.float32)
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _unscaled(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _torch_unscaled(x, eps):
    return torch.rms_norm(x, (x.shape[-1],), None, eps)


# A float32 trace of a casting form is the no-cast form (the casts vanish): it
# would match half-precision graphs written without casts and then fail their
# re-check, so the casting forms trace in bfloat16 (the matcher ignores which
# half-precision dtype; the re-check uses the real one).
_FORMS = (
    _RmsForm(_llama, torch.bfloat16, "before_scale"),
    _RmsForm(_scale_first, torch.float32, "none"),
    _RmsForm(_scale_last, torch.float32, "none"),
    _RmsForm(_torch_rms_norm, torch.float32, "after_scale"),
    _RmsForm(_torch_rms_norm, torch.bfloat16, "after_scale"),
    _RmsForm(_llama_unscaled, torch.bfloat16, "before_scale", scaled=False),
    _RmsForm(_unscaled, torch.float32, "none", scaled=False),
    _RmsForm(_torch_unscaled, torch.float32, "after_scale", scaled=False),
    _RmsForm(_torch_unscaled, torch.bfloat16, "after_scale", scaled=False),
)


def _rms_norm_patterns() -> None:
    """Larger patterns first: where two anchor at the same node, the first wins."""
    for form in _FORMS:
        if form.scaled:
            _add_rms_norm_epilogues(form)
    for residual in (True, False):
        for form in _FORMS:
            _add_plain(form, residual=residual)


def _examples(dtype: torch.dtype, *, residual: bool, scaled: bool) -> list:
    # Zeros, not random: patterns are built on import, which must not move the RNG.
    x = torch.zeros(2, 3, 8, dtype=dtype)
    return [x, *([torch.zeros_like(x)] if residual else []), *([torch.zeros(8, dtype=dtype)] if scaled else []),
            _EPS]


def _add_plain(form: _RmsForm, *, residual: bool) -> None:
    """add_rms_norm (with a `residual`) or rms_norm of one form."""
    norm, cast = form.norm, form.cast
    if residual and form.scaled:
        def search(x, residual, weight, eps):
            summed = x + residual
            return norm(summed, weight, eps), summed

        def replace(x, residual, weight, eps):
            return tuple(ops.add_rms_norm(x, residual, weight, eps, cast))
    elif residual:
        def search(x, residual, eps):
            summed = x + residual
            return norm(summed, eps), summed

        def replace(x, residual, eps):
            return tuple(ops.add_rms_norm(x, residual, None, eps, cast))
    elif form.scaled:
        def search(x, weight, eps):
            return norm(x, weight, eps)

        def replace(x, weight, eps):
            return ops.rms_norm(x, weight, eps, cast)
    else:
        def search(x, eps):
            return norm(x, eps)

        def replace(x, eps):
            return ops.rms_norm(x, None, eps, cast)

    _add("add_rms_norm" if residual else "rms_norm", search, replace,
         _examples(form.dtype, residual=residual, scaled=form.scaled),
         _check(params=("weight",) if form.scaled else ()), levels=(1,))


def _add_rms_norm_epilogues(form: _RmsForm) -> None:
    """npugraph_ex's default fusions of add + RMSNorm (one form), each on the
    normalised value as it is and flattened to [tokens, hidden], as `view(-1,
    hidden)` writes it or as `flatten` does (a view to the real sizes)."""
    examples = _examples(form.dtype, residual=True, scaled=True)
    # A float32 normalised value has no cast to fuse: the cast patterns trace in bfloat16.
    cast_examples = _examples(torch.bfloat16, residual=True, scaled=True)
    for flat in (_same, _view_flat, _flatten):
        quant, fused_quant, cast_up, fused_cast_up = _epilogues(form, flat)
        for name, search, replace, example in (("add_rms_norm_dynamic_quant", quant, fused_quant, examples),
                                               ("add_rms_norm_cast", cast_up, fused_cast_up, cast_examples)):
            _add(name, search, replace, example, _check(params=("weight",)), levels=(1,))


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _view_flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, t.shape[-1])


def _flatten(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(0, -2)


def _epilogues(form: _RmsForm, flat: Callable) -> tuple[Callable, ...]:
    """(search, replace) for dynamic quant, then for the float32 cast, of the
    normalised value reshaped by `flat`; the fused ops' results are reshaped alike."""
    norm, cast = form.norm, form.cast

    def quant(x, residual, weight, eps):
        summed = x + residual
        return (*kernels.dynamic_quant(flat(norm(summed, weight, eps))), summed)

    def fused_quant(x, residual, weight, eps):
        values, scale, summed = ops.add_rms_norm_dynamic_quant(x, residual, weight, eps, cast)
        return flat(values), flat(scale), summed

    def cast_up(x, residual, weight, eps):
        summed = x + residual
        normed = norm(summed, weight, eps)
        return flat(normed).to(torch.float32), normed, summed

    def fused_cast_up(x, residual, weight, eps):
        normed32, normed, summed = ops.add_rms_norm_cast(x, residual, weight, eps, cast)
        return flat(normed32), normed, summed

    return quant, fused_quant, cast_up, fused_cast_up


_layer_norm_patterns()
_add_layer_norm_patterns()
_rms_norm_patterns()
