"""Weight-only int8: the linears on frozen weights read their weight as int8, one
float scale per output channel, through torch's own fused dequant-GEMM kernel
(`aten._weight_int8pack_mm`), which streams a quarter of float32's weight bytes.

The kernel's fast path takes bfloat16 activations (float32 ones go to a loop many
times slower), so the linear's input is cast to bfloat16 for it and its result cast
back; the error of both is measured with lower_precision's (`precision.measured_error`).
"""

from __future__ import annotations

import torch
import torch.fx

from .._compat import fake
from .base import PassResult, erase_dead, value_of
from .constant_fold import constant_nodes, fold_node
from .strides import fake_run

aten, prims = torch.ops.aten, torch.ops.prims

# Set by the manager: the weight format (absent: the pass does nothing).
WEIGHT_QUANTIZATION = "graphopt_weight_quantization"
# The kernel reads the reduction dimension in blocks of 16: other sizes give wrong
# results or crash, so those linears stay as they are.
_K_BLOCK = 16
# The int8 values a weight takes: -127..127, symmetric, so a scale maps max|w| to 127.
_LEVELS = 127


def quantize_weights(gm: torch.fx.GraphModule) -> PassResult:
    """Compute each product of an input with a frozen 2-D float32 weight with its weight
    in int8: a linear (level 1), or the mm / addmm on the weight's transpose that
    Inductor's decompositions leave of one (level 2).

        before:  y = aten.linear(x, w, b)              (level 2: y = aten.addmm(b, x, aten.permute(w, [1, 0])))
        after:   q = aten._weight_int8pack_mm(convert(x, bf16), _folded_0, _folded_1)
                 y = aten.add(convert(q, f32), b)                      x: [s0, 64], w: [32, 64]

    `_folded_0` = round(w / scale) in int8, `_folded_1` = scale = max|w| / 127 per output
    channel (in bfloat16), both folded at compile time with refresh recipes, so
    `refresh()` quantizes updated weights again. An input of more than two dims is
    flattened to rows and back when at most one of its leading sizes is symbolic.
    At level 2 Inductor lowers the kernel call itself (extern ATen kernel, or its C++
    GEMM template with the scale as an epilogue where autotuning picks it).
    """
    if gm.meta.get(WEIGHT_QUANTIZATION) != "int8" or not hasattr(aten, "_weight_int8pack_mm"):
        return PassResult(changed=False)
    fake_mode = fake.fake_mode_of(gm)
    constants = constant_nodes(gm)
    counts: dict[str, int] = {}
    for node in list(gm.graph.nodes):
        operands = _operands(node)
        # An mm is a linear's only on a weight: products of two activations are not counted.
        if operands is not None and node.target is not aten.linear.default and operands[1] not in constants:
            continue
        if operands is not None and fake_mode is not None:
            kind = "quantized" if _quantize(gm, node, operands, constants, fake_mode) else "skipped"
            counts[kind] = counts.get(kind, 0) + 1
    return PassResult(changed="quantized" in counts, counts=counts)


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


def _quantize(gm: torch.fx.GraphModule, node: torch.fx.Node, operands: tuple, constants: set, fake_mode) -> bool:
    x, w, bias = operands
    xv, wv = value_of(x), value_of(w)
    if w not in constants or xv is None or wv is None or wv.dim() != 2 or wv.shape[1] % _K_BLOCK \
            or xv.dtype != torch.float32 or wv.dtype != torch.float32:
        return False
    lead = list(xv.shape[:-1])
    if not lead or sum(not isinstance(s, int) for s in lead) > 1:
        return False
    graph = gm.graph
    with graph.inserting_before(node):
        weight, scale = _quantized_weight(gm, w, fake_mode)
        rows = x if len(lead) == 1 else _node(gm, aten.reshape.default, (x, [-1, wv.shape[1]]), fake_mode)
        q = _node(gm, aten._weight_int8pack_mm.default,
                  (_node(gm, prims.convert_element_type.default, (rows, torch.bfloat16), fake_mode), weight, scale),
                  fake_mode)
        y = _node(gm, prims.convert_element_type.default, (q, torch.float32), fake_mode)
        if len(lead) > 1:
            shape = [s if isinstance(s, int) else -1 for s in lead] + [wv.shape[0]]
            y = _node(gm, aten.reshape.default, (y, shape), fake_mode)
        if bias is not None:
            y = _node(gm, aten.add.Tensor, (y, bias), fake_mode)
    node.replace_all_uses_with(y)
    erase_dead(node)
    fold_node(gm, weight)  # once something reads them: folding erases the constants nothing reads
    fold_node(gm, scale)
    return True


def _quantized_weight(gm: torch.fx.GraphModule, w: torch.fx.Node, fake_mode) -> tuple[torch.fx.Node, torch.fx.Node]:
    """The nodes computing `w` in int8 and its scales in bfloat16 (the caller folds them)."""
    amax = _node(gm, aten.amax.default, (_node(gm, aten.abs.default, (w,), fake_mode), [1]), fake_mode)
    scale = _node(gm, aten.clamp_min.default, (_node(gm, aten.div.Tensor, (amax, float(_LEVELS)), fake_mode), 1e-12),
                  fake_mode)
    ratio = _node(gm, aten.div.Tensor, (w, _node(gm, aten.unsqueeze.default, (scale, 1), fake_mode)), fake_mode)
    rounded = _node(gm, aten.clamp.default,
                    (_node(gm, aten.round.default, (ratio,), fake_mode), -float(_LEVELS), float(_LEVELS)), fake_mode)
    weight = _node(gm, prims.convert_element_type.default, (rounded, torch.int8), fake_mode)
    return weight, _node(gm, prims.convert_element_type.default, (scale, torch.bfloat16), fake_mode)


def _node(gm: torch.fx.GraphModule, target, args: tuple, fake_mode) -> torch.fx.Node:
    node = gm.graph.call_function(target, args)
    node.meta["val"] = fake_run(node, {}, fake_mode)
    return node
