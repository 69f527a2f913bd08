"""Weight-only int8 and int4: the linears on frozen weights read their weight as int8
(one float scale per output channel) or as int4 (a scale and a zero per group of
`INT4_GROUP` weights along the reduction dim), through torch's own fused dequant-GEMM
kernels (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`), which stream
a quarter or an eighth of float32's weight bytes.

The kernels' fast paths take bfloat16 activations (float32 ones go to loops tens of
times slower), so the linear's input is cast to bfloat16 for them and the result cast
back; the error of both is measured with lower_precision's (`lowered_error.measured_error`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection

import torch
import torch.fx

from .._compat import fake, shapes
from . import quantize_timing, roles
from .base import PassResult, erase_dead, value_of, vocabularies
from .constant_fold import constant_nodes, fold_node
from .strides import fake_run

aten, prims = torch.ops.aten, torch.ops.prims
_CAST = prims.convert_element_type.default

# Set by the manager: the weight format (absent: the pass does nothing).
WEIGHT_QUANTIZATION = "graphopt_weight_quantization"
# Set by the manager: the dtype lower_precision's "lower" ops, the linears among them,
# compute in (absent: that pass does nothing, and quantize_timing times float32).
COMPUTE_DTYPE = "graphopt_compute_dtype"
# Set by the manager on a retry (`finer_logits`): the format of the product whose rows are
# the logits (a causal LM's output projection), "float" for its float weight.
LOGITS_FORMAT = "graphopt_logits_weight_format"
# The format the logits' product takes first, before its float weight on a retry and before
# a graph's quantization is undone: its error reaches every token's probability at once, and
# it is one layer of many (llama.cpp's Q4_K_M keeps the output weight at 6 bits for that).
_LOGITS_FIRST = {"int4": "int8", "int8": "int8"}
# Under int4, the products of these roles (roles.py) take int8: llama.cpp's Q4_K_M keeps the
# value and the MLP's output projections at more bits. Measured on Gemma-3 270M, int4 moved
# the perplexity 13.8% from float32's, int4 with these in int8 4.6% (docs/precision.md).
_FINER_ROLES = {"int4": ("int8", (roles.VALUE, roles.MLP_OUTPUT))}
# The int8 values a weight takes: -127..127, symmetric, so a scale maps max|w| to 127.
_LEVELS = 127
# How many int4 weights along the reduction dim share a scale and a zero (the kernel takes
# 32, 64, 128 or 256). 32: less error than 128 and more linears fit (K a multiple of 32),
# for slightly more kernel time and 1 bit per weight of bfloat16 scale and zero where 128
# costs 0.25 (measured in docs/precision.md, "Weight-only int4").
INT4_GROUP = 32
# The factors each int4 group's range [min, max] is shrunk by, about its middle, before
# the one with the least squared error is kept (`_best_range`; docs/precision.md,
# "Weight-only int4").
INT4_RANGES = (1.0, 0.95, 0.9, 0.85, 0.8)


@dataclass(frozen=True)
class _Format:
    name: str  # weight_quantization's
    kernel: Any  # the fused kernel: kernel(x in bfloat16 [rows, K], *operands) -> [rows, N] in bfloat16
    operands: Callable  # (gm, w, fake_mode) -> the kernel's arguments after x; their nodes are folded
    fits: Callable[[int, int], bool]  # (N, K) -> whether the kernel takes a weight [N, K]


def quantize_weights(gm: torch.fx.GraphModule) -> PassResult:
    """Compute each product of an input with a frozen 2-D float32 weight with its weight
    in int8 or int4: a linear (level 1), or the mm / addmm on the weight's transpose that
    Inductor's decompositions leave of one (level 2).

        before:  y = aten.linear(x, w, b)              (level 2: y = aten.addmm(b, x, aten.permute(w, [1, 0])))
        after:   q = aten._weight_int8pack_mm(convert(x, bf16), _folded_0, _folded_1)
                 y = aten.add(convert(q, f32), b)                      x: [s0, 64], w: [32, 64]
        int4:    q = aten._weight_int4pack_mm_for_cpu(convert(x, bf16), _folded_0, 32, _folded_1)

    int8: `_folded_0` = round(w / scale) in int8, `_folded_1` = scale = max|w| / 127 per
    output channel (in bfloat16). int4: `_folded_0` = the kernel's packing of
    round((w - zero) / scale) + 8 in 0..15 (two per byte), `_folded_1` = (scale, zero) per
    group of 32 input channels, [K / 32, N, 2] in bfloat16, with scale = f (max - min) / 15
    and zero = (max + min) / 2 + scale / 2 over the group, so the kernel's (q - 8) * scale
    + zero spans the group's range shrunk by f about its middle, f the factor of
    `INT4_RANGES` with the least squared error (f = 1: min to max). Both are folded at
    compile time with refresh recipes, so `refresh()` quantizes updated weights again. A
    weight whose shape the kernel cannot take (int8: K not a multiple of 16; int4: K not
    a multiple of 32 or N of 16) stays as it is, counted as skipped; one whose kernel is
    slower than the float GEMM at the traced rows too, counted as slower (quantize_timing.py).
    An input of more than two dims is flattened to rows and back when at most one of its
    leading sizes is symbolic. At level 2 Inductor lowers the
    kernel call itself (extern ATen kernel, or its C++ GEMM template where autotuning picks it).
    A product whose weight's rows are the vocabulary of an embedding the graph reads (a
    causal LM's output projection) takes int8, or `gm.meta[LOGITS_FORMAT]` where the manager
    set one on a retry, counted apart ("logits quantized" / "logits skipped"). Under int4, the
    attention's value projections and the MLPs' output projections take int8 (`role_formats`),
    counted as "int8 by role".
    """
    formats = _formats()
    fmt = formats.get(gm.meta.get(WEIGHT_QUANTIZATION))
    fake_mode = fake.fake_mode_of(gm)
    if fmt is None or fake_mode is None:
        return PassResult(changed=False)
    logits_fmt = formats.get(gm.meta.get(LOGITS_FORMAT, _LOGITS_FIRST[fmt.name]))
    constants, vocab = constant_nodes(gm), vocabularies(gm)
    products = weight_products(gm, constants)
    by_role = role_formats(gm, products, constants)
    counts: dict[str, int] = {}
    for node, operands in products.items():
        logits = _rows(operands[1]) in vocab
        chosen = logits_fmt if logits else formats.get(by_role[node])
        done = "skipped" if chosen is None else _quantize(gm, node, operands, constants, chosen, fake_mode)
        kind = "logits " + done if logits else \
            "int8 by role" if done == "quantized" and chosen is not fmt else done
        counts[kind] = counts.get(kind, 0) + 1
    changed = bool(counts.keys() & {"quantized", "logits quantized", "int8 by role"})
    return PassResult(changed=changed, counts=counts)


def weight_products(gm: torch.fx.GraphModule, constants: set[torch.fx.Node]) -> dict[torch.fx.Node, tuple]:
    """The products of an input with a frozen weight in `gm`, in graph order, with their
    (x, w, bias): linears, and mms / addmms on a constant's transpose (an mm of two
    activations is not one)."""
    found = {}
    for node in gm.graph.nodes:
        operands = _operands(node)
        if operands is not None and (node.target is aten.linear.default or operands[1] in constants):
            found[node] = operands
    return found


def role_formats(gm: torch.fx.GraphModule, products: Collection[torch.fx.Node],
                 constants: set[torch.fx.Node] | None = None) -> dict[torch.fx.Node, str | None]:
    """The weight format each of `products` (the graph's products of an input with a
    weight) takes: weight_quantization's, or the finer one its role asks for
    (`_FINER_ROLES`); None without weight_quantization. `constants`: constant_nodes(gm),
    computed here where a role is asked for and they are not given."""
    name = gm.meta.get(WEIGHT_QUANTIZATION)
    finer, kinds = _FINER_ROLES.get(name, (None, ()))
    if not kinds:
        return dict.fromkeys(products, name)
    constants = constant_nodes(gm) if constants is None else constants
    return {node: finer if roles.role(node, products, constants) in kinds else name for node in products}


def finer_logits(result: PassResult) -> str | None:
    """The format of the logits' product for a retry after `result` (this pass's): "float",
    where it quantized the product; else None."""
    return "float" if result.counts.get("logits quantized") else None


def _rows(weight: torch.fx.Node) -> int | None:
    value = value_of(weight)
    return int(value.shape[0]) if value is not None and value.dim() == 2 else None


def _formats() -> dict[str, _Format]:
    """The weight formats this torch has a kernel for, by `weight_quantization` name."""
    formats = {}
    if hasattr(aten, "_weight_int8pack_mm"):
        # The kernel reads the reduction dim in blocks of 16: other sizes give wrong results or crash.
        formats["int8"] = _Format("int8", aten._weight_int8pack_mm.default, _int8_operands, lambda n, k: k % 16 == 0)
    if hasattr(aten, "_weight_int4pack_mm_for_cpu"):
        # The packing pairs output channels in blocks of 16; the kernel reads whole groups.
        formats["int4"] = _Format("int4", aten._weight_int4pack_mm_for_cpu.default, _int4_operands,
                                  lambda n, k: n % 16 == 0 and k % INT4_GROUP == 0)
    return formats


def _operands(node: torch.fx.Node) -> tuple | None:
    """(x, w, bias) of a product of `x` with weight `w` [out, in], or None: a linear, or
    an mm / addmm (scaling neither term) whose second operand is `w` transposed."""
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        return (*node.args, None)[:3]
    if node.target is aten.mm.default and not node.kwargs:
        (x, wt), bias = node.args, None
    elif node.target is aten.addmm.default and not node.kwargs and len(node.args) == 3:
        bias, x, wt = node.args
    else:
        return None
    if not isinstance(wt, torch.fx.Node) or not _is_transpose(wt):
        return None
    return x, wt.args[0], bias


def _is_transpose(node: torch.fx.Node) -> bool:
    return (node.target is aten.permute.default and list(node.args[1]) == [1, 0]) or \
        node.target is aten.t.default


def _quantize(gm: torch.fx.GraphModule, node: torch.fx.Node, operands: tuple, constants: set, fmt: _Format,
              fake_mode) -> str:
    """"quantized", "skipped" (a product the kernel cannot take), or "slower" (one whose
    kernel lost to the float GEMM at the traced rows: quantize_timing.py)."""
    x, w, bias = operands
    xv, wv = value_of(x), value_of(w)
    if w not in constants or xv is None or wv is None or wv.dim() != 2 or not fmt.fits(*wv.shape) \
            or xv.dtype != torch.float32 or wv.dtype != torch.float32:
        return "skipped"
    lead = list(xv.shape[:-1])
    if not lead or sum(not isinstance(s, int) for s in lead) > 1:
        return "skipped"
    rows = max(int(shapes.size_hint(xv.numel() // xv.shape[-1])), 1)
    if quantize_timing.loses(fmt.name, rows, *wv.shape, gm.meta.get(COMPUTE_DTYPE) or torch.float32):
        return "slower"
    with gm.graph.inserting_before(node):
        args = fmt.operands(gm, w, fake_mode)
        rows = x if len(lead) == 1 else _node(gm, aten.reshape.default, (x, [-1, wv.shape[1]]), fake_mode)
        q = _node(gm, fmt.kernel, (_node(gm, _CAST, (rows, torch.bfloat16), fake_mode), *args), fake_mode)
        y = _node(gm, _CAST, (q, torch.float32), fake_mode)
        if len(lead) > 1:
            shape = [s if isinstance(s, int) else -1 for s in lead] + [wv.shape[0]]
            y = _node(gm, aten.reshape.default, (y, shape), fake_mode)
        if bias is not None:
            y = _node(gm, aten.add.Tensor, (y, bias), fake_mode)
    node.replace_all_uses_with(y)
    erase_dead(node)
    for arg in args:  # once something reads them: folding erases the constants nothing reads
        if isinstance(arg, torch.fx.Node):
            fold_node(gm, arg)
    return "quantized"


def _int8_operands(gm: torch.fx.GraphModule, w: torch.fx.Node, fake_mode) -> tuple:
    """(`w` in int8, its scales in bfloat16): nodes the caller folds."""
    def op(target, *args):
        return _node(gm, target, args, fake_mode)

    amax = op(aten.amax.default, op(aten.abs.default, w), [1])
    scale = op(aten.clamp_min.default, op(aten.div.Tensor, amax, float(_LEVELS)), 1e-12)
    ratio = op(aten.div.Tensor, w, op(aten.unsqueeze.default, scale, 1))
    rounded = op(aten.clamp_max.default, op(aten.clamp_min.default, op(aten.round.default, ratio), -float(_LEVELS)),
                 float(_LEVELS))
    return op(_CAST, rounded, torch.int8), op(_CAST, scale, torch.bfloat16)


def _int4_operands(gm: torch.fx.GraphModule, w: torch.fx.Node, fake_mode) -> tuple:
    """(`w` in int4 packed for the kernel, the group size, its scales and zeros
    [K / group, N, 2] in bfloat16): the caller folds the nodes. Each group's range is
    the one of `INT4_RANGES` with the least squared error (`_best_range`). The values are
    rounded against the bfloat16 scale and zero the kernel reads, not the float32 ones."""
    def op(target, *args):
        return _node(gm, target, args, fake_mode)

    n, k = value_of(w).shape
    groups = op(aten.reshape.default, w, [n, k // INT4_GROUP, INT4_GROUP])
    low, high = op(aten.amin.default, groups, [2]), op(aten.amax.default, groups, [2])
    scale, zero = _best_range(op, groups, low, high)
    scale_bf16, zero_bf16 = op(_CAST, scale, torch.bfloat16), op(_CAST, zero, torch.bfloat16)
    levels = _int4_levels(op, groups, op(_CAST, scale_bf16, torch.float32), op(_CAST, zero_bf16, torch.float32))
    # Its second argument (inner K tiles) is read by the CUDA packing only.
    packed = op(aten._convert_weight_to_int4pack_for_cpu.default,
                op(aten.reshape.default, op(_CAST, levels, torch.int32), [n, k]), 1)
    pairs = op(aten.permute.default, op(aten.stack.default, [scale_bf16, zero_bf16], 2), [1, 0, 2])
    return packed, INT4_GROUP, _node(gm, aten.clone.default, (pairs,), fake_mode, memory_format=torch.contiguous_format)


def _best_range(op: Callable, groups: torch.fx.Node, low: torch.fx.Node, high: torch.fx.Node) -> tuple:
    """(scale, zero) per group, float32: of the ranges [low, high] shrunk by each factor of
    `INT4_RANGES`, the one whose 16 levels come back nearest the group's values (least
    squared error). Shrinking clips the group's extremes to round the many values between
    them more finely; the full range, the first, wins ties. Each candidate is compared as it
    is made, so no intermediate is larger than the weight (folding's memory bound)."""
    best = None
    for factor in INT4_RANGES:
        # A constant group (max == min) gets a tiny scale, so it comes back as its value in bfloat16.
        scale = op(aten.clamp_min.default, op(aten.mul.Tensor, op(aten.sub.Tensor, high, low), factor / 15.0), 1e-6)
        zero = op(aten.add.Tensor, op(aten.mul.Tensor, op(aten.add.Tensor, high, low), 0.5),
                  op(aten.mul.Tensor, scale, 0.5))
        levels = _int4_levels(op, groups, scale, zero)
        back = op(aten.add.Tensor, op(aten.mul.Tensor, op(aten.sub.Tensor, levels, 8.0),
                                      op(aten.unsqueeze.default, scale, 2)), op(aten.unsqueeze.default, zero, 2))
        error = op(aten.sum.dim_IntList, op(aten.square.default, op(aten.sub.Tensor, back, groups)), [2])
        if best is None:
            best = error, scale, zero
            continue
        nearer = op(aten.lt.Tensor, error, best[0])
        best = tuple(op(aten.where.self, nearer, new, old) for new, old in zip((error, scale, zero), best))
    return best[1], best[2]


def _int4_levels(op: Callable, groups: torch.fx.Node, scale: torch.fx.Node, zero: torch.fx.Node) -> torch.fx.Node:
    """round((w - zero) / scale) + 8, clamped to 0..15, per group."""
    ratio = op(aten.div.Tensor, op(aten.sub.Tensor, groups, op(aten.unsqueeze.default, zero, 2)),
               op(aten.unsqueeze.default, scale, 2))
    shifted = op(aten.add.Tensor, op(aten.round.default, ratio), 8.0)
    return op(aten.clamp_max.default, op(aten.clamp_min.default, shifted, 0.0), 15.0)


def _node(gm: torch.fx.GraphModule, target, args: tuple, fake_mode, **kwargs) -> torch.fx.Node:
    node = gm.graph.call_function(target, args, kwargs)
    node.meta["val"] = fake_run(node, {}, fake_mode)
    return node
