"""Convolution fusions on the CPU, with frozen weights: batch norm folded into the
convolution, then the convolution, its bias, a residual add and a ReLU as one oneDNN
call on weights packed once.

What the time of a ResNet goes to on the CPU is its convolutions (docs/benchmarks.md,
"Where the time goes"): eager torch hands oneDNN a plain NCHW weight, which oneDNN
reorders into its blocked layout at every call. ONNX Runtime folds batch norm, fuses
the activation and the residual add, and reorders its weights once; this does the same.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
import torch.fx

from ..._compat import fake, mkldnn, shapes
from .. import shared_weights
from ..base import GraphFacts, PassResult, alias_root, erase_dead, value_of
from ..constant_fold import FOLDED_RECIPES, FROZEN_INPUTS, drop_if_unread, fold_node, recipe_of_call
from ..strides import fake_run, restrided, set_values
from . import FUSED_TAG

aten = torch.ops.aten
_BATCH_NORM = aten._native_batch_norm_legit_no_training.default
# Activations oneDNN applies as a post-op, by the name its fused ops take.
_UNARY = {aten.relu.default: "relu"}


def fuse_conv(gm: torch.fx.GraphModule) -> PassResult:
    """Fold inference batch norms into the convolutions they follow, then compute each
    convolution with what follows it (an add of a tensor of its shape, a ReLU) as one
    oneDNN call on a weight packed once.

        before:  c = convolution(x, w, None, ...);  bn = _native_batch_norm_legit_no_training(c, g, b, m, v, 0.1, eps)
                 y = getitem(bn, 0);  s = add(y, identity);  r = relu(s)
        after:   r = mkldnn._convolution_pointwise.binary(x, identity, _packed_0, _folded_1, ...,
                                                          "add", None, "relu", [], None)

    with `_folded_0 = w * g / sqrt(v + eps)` (per output channel), `_folded_1 = b - m *
    g / sqrt(v + eps)` and `_packed_0` = `_folded_0` reordered for oneDNN, all computed at
    optimize time and recomputed by `refresh()` (their refresh recipes).

    Only with freeze_parameters=True, on the CPU, in float32, for 2-D convolutions
    (not transposed) whose weight, bias and batch-norm tensors are frozen parameters
    or constants the graph neither writes nor returns, and where oneDNN is built in.
    The fused op returns channels-last: a convolution whose readers cannot take that
    (a view it cannot express, a graph output) is left alone. Folding changes the
    rounding of the weights, within float32's tolerance.
    """
    frozen = gm.meta.get(FROZEN_INPUTS)
    fake_mode = fake.fake_mode_of(gm)
    if not frozen or fake_mode is None or not mkldnn.available():
        return PassResult(changed=False)
    facts = GraphFacts(gm.graph)
    folded = sum(_fold_batch_norm(gm, bn, facts, fake_mode) for bn in list(gm.graph.nodes)
                 if bn.target is _BATCH_NORM)
    facts = GraphFacts(gm.graph)
    fused: dict[str, int] = {}
    for conv in list(gm.graph.nodes):
        if conv.target is aten.convolution.default:
            kind = _fuse_pointwise(gm, conv, facts, fake_mode)
            if kind:
                fused[kind] = fused.get(kind, 0) + 1
    counts = {**({"batch_norm_folded": folded} if folded else {}), **fused}
    return PassResult(changed=bool(counts), counts=counts)


def frozen_constant(gm: torch.fx.GraphModule, node: Any, facts: GraphFacts) -> bool:
    """A frozen parameter or a tensor attribute that the graph neither writes nor returns."""
    if not isinstance(node, torch.fx.Node) or alias_root(node) in facts.written | facts.returned:
        return False
    if node.op == "placeholder":
        return node.name in gm.meta.get(FROZEN_INPUTS, {})
    return node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.Tensor)


def _cpu_float32_conv(conv: torch.fx.Node) -> bool:
    x, out = value_of(conv.args[0]), value_of(conv)
    return (x is not None and out is not None and x.dim() == 4 and x.device.type == "cpu"
            and x.dtype == torch.float32 and not conv.args[6])  # args[6]: transposed


def _fold_batch_norm(gm: torch.fx.GraphModule, bn: torch.fx.Node, facts: GraphFacts, fake_mode: Any) -> bool:
    """Fold one batch norm into the convolution before it; False when it cannot."""
    conv, weight, bias, mean, var, _momentum, eps = bn.args
    if not (isinstance(conv, torch.fx.Node) and conv.target is aten.convolution.default
            and len(conv.users) == 1 and _cpu_float32_conv(conv)):
        return False
    outs = [u for u in bn.users if u.target is operator.getitem]
    if len(outs) != len(bn.users) or any(u.args[1] != 0 for u in outs):
        return False  # the saved mean and rstd are read (training graphs)
    w, b = conv.args[1], conv.args[2]
    if not all(frozen_constant(gm, n, facts) for n in (w, mean, var)) \
            or not all(n is None or frozen_constant(gm, n, facts) for n in (b, weight, bias)):
        return False
    graph, added = gm.graph, []

    def add(target: Any, *args: Any) -> torch.fx.Node:
        with graph.inserting_before(conv):
            node = graph.call_function(target, args)
        added.append(node)
        node.meta["val"] = fake_run(node, {}, fake_mode)
        return node

    scale = add(aten.rsqrt.default, add(aten.add.Tensor, var, eps))
    if weight is not None:
        scale = add(aten.mul.Tensor, scale, weight)
    new_w = add(aten.mul.Tensor, w, add(aten.view.default, scale, [-1, 1, 1, 1]))
    shifted = add(aten.neg.default, mean) if b is None else add(aten.sub.Tensor, b, mean)
    new_b = add(aten.mul.Tensor, shifted, scale)
    if bias is not None:
        new_b = add(aten.add.Tensor, new_b, bias)
    if any(n.meta["val"] is None for n in added):
        _erase(graph, added)
        return False
    with graph.inserting_before(bn):
        new_conv = graph.call_function(conv.target, (conv.args[0], new_w, new_b, *conv.args[3:]))
    new_conv.meta = dict(conv.meta)
    # Folded while the new convolution reads them: folding erases the constants nothing reads.
    if fold_node(gm, new_w) is None or fold_node(gm, new_b) is None:  # over folding's memory bound
        graph.erase_node(new_conv)
        _erase(graph, [n for n in added if n in graph.nodes])
        return False
    for out in outs:
        out.replace_all_uses_with(new_conv)
        graph.erase_node(out)
    graph.erase_node(bn)
    erase_dead(conv)
    return True


def _erase(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    for node in reversed(nodes):
        if not node.users:
            graph.erase_node(node)


def _fuse_pointwise(gm: torch.fx.GraphModule, conv: torch.fx.Node, facts: GraphFacts, fake_mode: Any) -> str:
    """Rewrite one convolution (and its add and activation) as a oneDNN call; the kind
    of fusion made ("conv", "conv_relu", "conv_add", "conv_add_relu"), or "" for none."""
    x, w, b, stride, padding, dilation, _transposed, _output_padding, groups = conv.args
    if not (_cpu_float32_conv(conv) and frozen_constant(gm, w, facts)
            and (b is None or frozen_constant(gm, b, facts))
            and alias_root(x) not in facts.written and all(isinstance(s, int) for s in value_of(w).shape)):
        return ""
    last, other, unary = conv, None, None
    if len(last.users) == 1:
        user = next(iter(last.users))
        operands = list(user.args)
        if user.target is aten.add.Tensor and not user.kwargs and len(operands) == 2 and operands.count(last) == 1:
            candidate = operands[1 - operands.index(last)]
            val = value_of(candidate)
            if val is not None and val.dtype == value_of(last).dtype and shapes.same_shape(val, value_of(last)) \
                    and alias_root(candidate) not in facts.written:
                last, other = user, candidate
    if len(last.users) == 1 and next(iter(last.users)).target in _UNARY:
        last = next(iter(last.users))
        unary = _UNARY[last.target]
    with gm.graph.inserting_before(last):
        packed = _packed_weight(gm, conv)
        args = (padding, stride, dilation, groups)
        if other is None:
            fused = gm.graph.call_function(mkldnn.conv_pointwise(), (x, packed, b, *args, unary or "none", [], None))
        else:
            fused = gm.graph.call_function(mkldnn.conv_add(), (x, other, packed, b, *args, "add", None, unary, [],
                                                                None))
    # The fake op of the unary form, on the dense weight, gives the channels-last result.
    val = fake_run(conv, {}, fake_mode, lambda x, w, b, *_: mkldnn.conv_pointwise()(
        x, w, b, padding, stride, dilation, groups, "none", [], None))
    vals = restrided(gm, {last: val}, fake_mode) if val is not None else None
    if vals is None:
        gm.graph.erase_node(fused)
        drop_packed(gm, packed)
        return ""
    fused.meta = {**last.meta, "val": vals.pop(last), FUSED_TAG: "conv" + "_add" * (other is not None)
                  + f"_{unary}" * (unary is not None)}
    set_values(vals)
    last.replace_all_uses_with(fused)
    erase_dead(last)
    drop_if_unread(gm, w)
    return fused.meta[FUSED_TAG]


def _packed_weight(gm: torch.fx.GraphModule, conv: torch.fx.Node) -> torch.fx.Node:
    """The convolution's weight packed for its input size (`packed_weight`)."""
    x, w, _b, stride, padding, dilation, _t, _o, groups = conv.args
    size = [shapes.size_hint(s) for s in value_of(x).shape]
    return packed_weight(gm, w, mkldnn.pack_conv_weight, (padding, stride, dilation, groups, size))


def packed_weight(gm: torch.fx.GraphModule, w: torch.fx.Node, pack: Any, args: tuple) -> torch.fx.Node:
    """A `_packed_<i>` attribute: `pack(w, *args)`, with a refresh recipe when the
    weight comes from frozen parameters (or from a constant folded from them)."""
    dense = gm.meta[FROZEN_INPUTS][w.name] if w.op == "placeholder" else getattr(gm, w.target)
    recipe = recipe_of_call(gm, w, pack, args)

    def packed() -> torch.Tensor:
        # Not an inference tensor (a compile inside the caller's inference_mode, as refresh()
        # compiling a level-2 graph again is): refresh() updates it in place outside that mode.
        with fake.outside_fake_mode(), torch.inference_mode(False), torch.no_grad():
            return pack(dense, *args)
    value = shared_weights.computed(recipe, gm.meta.get(FROZEN_INPUTS, {}), packed)
    # The dense weight's fake value: sizes only, the layout is oneDNN's.
    return add_packed(gm, value, recipe, value_of(w))


def add_packed(gm: torch.fx.GraphModule, value: torch.Tensor, recipe: torch.fx.GraphModule | None,
               val: Any) -> torch.fx.Node:
    """`value` as a new `_packed_<i>` buffer (with its refresh recipe, if any), read by a
    get_attr made at the graph's insertion point whose fake value is `val`."""
    name = next(f"_packed_{i}" for i in itertools.count() if not hasattr(gm, f"_packed_{i}"))
    gm.register_buffer(name, value, persistent=False)
    if recipe is not None:
        gm.meta.setdefault(FOLDED_RECIPES, {})[name] = recipe
    node = gm.graph.get_attr(name)
    node.meta["val"] = val
    return node


def drop_packed(gm: torch.fx.GraphModule, packed: torch.fx.Node) -> None:
    gm.graph.erase_node(packed)
    gm.meta.get(FOLDED_RECIPES, {}).pop(packed.target, None)
    delattr(gm, packed.target)
