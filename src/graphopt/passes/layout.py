"""Layout conversion: run convolution regions in channels-last (NHWC) memory format.

oneDNN (CPU) and cuDNN's tensor-core kernels (CUDA, half precision) compute an NCHW
convolution by reordering to a channels-last layout and back around every call. A
region of convolutions, batch norms and pointwise ops that stays channels-last pays
one conversion at each border instead; a region too short to pay for its two
conversions is slower than NCHW (docs/passes.md, "Layout", has the figures). Weights
that are not constants are converted by an op in every step: on ResNet-18 that copy
outweighs the gain until the activations the convolutions read outnumber the weights
(`LIVE_WEIGHTS_PER_ACTIVATION`).

How a layout is decided: a region starts at each convolution, whose input is
converted unless it is channels-last already; it grows through the ops that consume
a channels-last value, for as long as torch's own meta functions (run on the graph's
fake values) say the op returns channels-last; an op whose result is the same either
way (a mean over H and W) reads the region's value as it is; any other op reads it
converted back to contiguous. Every layout is the one torch computes from the
strides, never a guess, so the graph stays exact.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from .._compat import fake, shapes
from .._compat.names import OpOverload, tensor_leaves, tree_leaves
from .base import STRIDE_READERS, GraphFacts, PassResult, alias_root, has_effect, same_layout, written_roots
from .constant_fold import constant_nodes, fold_node
from .strides import fake_run, same_sizes_and_dtypes, same_strides

aten = torch.ops.aten
NHWC, NCHW = torch.channels_last, torch.contiguous_format
_NHWC_ORDER = (0, 2, 3, 1)  # dims from outermost to innermost in memory

# Ops that may take a channels-last input and return channels-last, besides pointwise
# ops; whether one does for its arguments is asked of its meta function.
_REGION_OPS = {aten._native_batch_norm_legit_no_training.default, aten.native_batch_norm.default,
               aten.max_pool2d_with_indices.default, aten.avg_pool2d.default,
               aten._adaptive_avg_pool2d.default, aten.cat.default, aten.clone.default,
               aten._to_copy.default, operator.getitem}
# Below two convolutions per activation conversion, a channels-last region was slower
# than NCHW at batch 1 (docs/passes.md, "Layout").
CONVS_PER_CONVERSION = 2
# Live (not constant) conv weights converted per step, per element of activation the
# convolutions read at the traced batch, above which channels-last was slower: on
# ResNet-18 it lost from about 2.5 up and won below 1 (docs/passes.md, "Layout").
LIVE_WEIGHTS_PER_ACTIVATION = 1.0


def convert_layout(gm: torch.fx.GraphModule) -> PassResult:
    """Compute convolution regions in channels-last; convert only at their borders.

        before:  c1 = convolution(x, w1, ...);  b = getitem(batch_norm(c1, ...), 0);  r = relu(b)
                 c2 = convolution(r, w2, ...);  m = mean(c2, [2, 3])
        after:   x_nhwc = clone(x, memory_format=channels_last)
                 c1 = convolution(x_nhwc, w1_nhwc, ...);  ...;  c2 = convolution(r, w2_nhwc, ...)
                 m = mean(c2, [2, 3])                     # same result and strides: no conversion back
        before:  a = clone(x, memory_format=channels_last);  b = clone(a, memory_format=contiguous_format)
        after:   (b is x)

    First removes conversion pairs that cancel. Then, where the backend is faster in
    channels-last (`channels_last_faster`), the graph has at least
    `CONVS_PER_CONVERSION` convolutions per activation conversion the regions need,
    and the weights that are not constants (converted in every step) are at most
    `LIVE_WEIGHTS_PER_ACTIVATION` per element of the convolutions' inputs, converts:
    region inputs to channels-last, values leaving a region (to an op whose result
    would otherwise change, or to the graph's outputs) back to contiguous.
    Weights are converted too: once, at optimize time, when they are constants
    (frozen parameters, tensor attributes), else by an op in the graph. Values
    written in place and ops with effects are never part of a region.
    Counts: `inserted`/`removed` activation conversions, `weights` converted.
    """
    graph = gm.graph
    facts = GraphFacts(graph)
    removed = _cancel_conversions(facts, graph)
    fake_mode = fake.fake_mode_of(gm)
    written = written_roots(graph)
    seeds = [n for n in graph.nodes if _seed(n) and not _fixed(n, written)]
    plan = _plan(graph, seeds, written, fake_mode) if seeds and fake_mode is not None else None
    inserted = weights = 0
    if plan is not None and plan.convs and len(plan.convs) >= CONVS_PER_CONVERSION * plan.conversions \
            and _live_weights(gm, plan.convs) <= LIVE_WEIGHTS_PER_ACTIVATION * _conv_inputs(plan.convs):
        inserted = plan.apply(fake_mode)
        converted: dict[torch.fx.Node, torch.fx.Node] = {}
        weights = sum(_convert_weight(gm, conv, converted, fake_mode) for conv in plan.convs)
        removed += _cancel_conversions(GraphFacts(graph), graph)
    counts = {k: v for k, v in (("inserted", inserted), ("removed", removed), ("weights", weights)) if v}
    return PassResult(changed=bool(counts), counts=counts)


def _live_weights(gm: torch.fx.GraphModule, convs: list[torch.fx.Node]) -> int:
    """Elements of the convolutions' weights that are not constants: each is converted
    by an op in every step."""
    constants = constant_nodes(gm)
    weights = {conv.args[1] for conv in convs} - constants
    return sum(_elements(w) for w in weights)


def _conv_inputs(convs: list[torch.fx.Node]) -> int:
    """Elements the convolutions read as activations, at the traced batch."""
    return sum(_elements(conv.args[0]) for conv in convs)


def _elements(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return shapes.size_hint(val.numel()) if isinstance(val, torch.Tensor) else 0


def channels_last_faster(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether convolutions on `device` in `dtype` run faster channels-last.

    CPU: oneDNN, float32 and bfloat16, measured (docs/passes.md, "Layout"). CUDA: cuDNN's
    tensor-core kernels are channels-last, so float16/bfloat16 (NVIDIA's guidance;
    not measured here). float32 on CUDA, and other devices: no.
    """
    if device.type == "cpu":
        return (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
                and dtype in (torch.float32, torch.bfloat16))
    if device.type == "cuda":
        return (torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled
                and dtype in (torch.float16, torch.bfloat16))
    return False


def is_layout_conversion(node: torch.fx.Node) -> bool:
    """A copy that changes only the memory format: `clone`/`_to_copy` with a memory_format."""
    if node.op != "call_function" or node.target not in (aten.clone.default, aten._to_copy.default):
        return False
    fmt = node.kwargs.get("memory_format")
    if fmt is None or fmt is torch.preserve_format or len(node.args) != 1:
        return False
    val, src = node.meta.get("val"), node.args[0].meta.get("val")
    return (isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor)
            and val.dtype == src.dtype and val.device == src.device and not node.kwargs.get("pin_memory"))


def _cancel_conversions(facts: GraphFacts, graph: torch.fx.Graph) -> int:
    """`convert(convert(x, a), b)` that gives back x's own layout becomes x; returns
    the conversions removed."""
    removed = 0
    for node in graph.nodes:  # FX's iterator skips nodes erased on the way
        inner = node.args[0] if node.args else None
        if is_layout_conversion(node) and isinstance(inner, torch.fx.Node) and is_layout_conversion(inner):
            last_reader = len(inner.users) == 1
            if same_layout(node, inner.args[0]) and facts.substitute(node, inner.args[0]):
                removed += 2 if last_reader else 1
    return removed


def _seed(node: torch.fx.Node) -> bool:
    """A 2-d, non-transposed convolution on a backend that prefers channels-last."""
    if node.target is not aten.convolution.default or node.args[6]:
        return False
    x = node.args[0].meta.get("val")
    return isinstance(x, torch.Tensor) and x.dim() == 4 and channels_last_faster(x.device, x.dtype)


class _Plan:
    """Which nodes change layout (with their new fake values), and where conversions go."""

    def __init__(self) -> None:
        self.convs: list[torch.fx.Node] = []  # the convolutions that run channels-last
        self.vals: dict[torch.fx.Node, Any] = {}  # node -> its channels-last fake value
        self.to_nhwc: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # source -> the convs reading it
        self.to_nchw: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # source -> readers needing it back

    @property
    def conversions(self) -> int:
        return len(self.to_nhwc) + len(self.to_nchw)

    def apply(self, fake_mode: Any) -> int:
        """Rewrite the graph; returns the conversions inserted."""
        for source, readers in self.to_nhwc.items():
            _insert_conversion(source, readers, NHWC, fake_mode)
        old = {n: n.meta.get("val") for n in self.to_nchw}
        for node, val in self.vals.items():
            node.meta["val"] = val
            node.meta.pop("tensor_meta", None)
        for source, readers in self.to_nchw.items():
            conversion = _insert_conversion(source, readers, NCHW, fake_mode)
            conversion.meta["val"] = old[source]
        return self.conversions


def _plan(graph: torch.fx.Graph, seeds: list[torch.fx.Node], written: set, fake_mode: Any) -> _Plan:
    """Walk the graph in order, deciding each node's layout from its inputs' (see the module docstring)."""
    plan, seeds = _Plan(), set(seeds)
    vals = plan.vals

    def value(n: Any) -> Any:
        return vals.get(n, n.meta.get("val")) if isinstance(n, torch.fx.Node) else n

    for node in graph.nodes:
        if node.op == "output":
            for source in node.all_input_nodes:
                if source in vals:
                    plan.to_nchw.setdefault(source, []).append(node)
            continue
        if node.op != "call_function":
            continue
        old = node.meta.get("val")
        if node in seeds:
            x, w = node.args[0], node.args[1]
            ready = _has_strides(value(x), _NHWC_ORDER)  # C == 1 is both: no copy needed
            with fake_mode:  # the weight is converted too (`_convert_weight`)
                nhwc = {n: aten.clone.default(value(n), memory_format=NHWC) for n in (x, w)}
            new = fake_run(node, {**vals, **nhwc}, fake_mode)
            if new is not None:  # else torch refuses this conv channels-last: it stays as it is
                plan.convs.append(node)
                if not ready:
                    plan.to_nhwc.setdefault(x, []).append(node)
                if not _same_layout(new, old):
                    vals[node] = new
                continue
        changed = [i for i in node.all_input_nodes if i in vals]
        if not changed:
            continue
        new = None if _fixed(node, written) else fake_run(node, vals, fake_mode)
        if new is not None and _same_layout(new, old) and _reads_values_only(node):
            continue  # e.g. mean over H and W: same result, same strides
        if new is not None and _joins_region(node, new, old):
            vals[node] = new
            continue
        for source in changed:
            plan.to_nchw.setdefault(source, []).append(node)
    return plan


def _fixed(node: torch.fx.Node, written: set) -> bool:
    """Nodes whose layout must not change: writes, effects, values written later."""
    target = node.target
    mutable = isinstance(target, OpOverload) and target._schema.is_mutable
    return mutable or has_effect(node) or alias_root(node) in written


def _reads_values_only(node: torch.fx.Node) -> bool:
    """An ATen op (or getitem) whose result depends on its inputs' values, not their strides."""
    target = node.target
    if target is operator.getitem:
        return True
    return (isinstance(target, OpOverload) and target.namespace in ("aten", "prims")
            and target not in STRIDE_READERS)


def _joins_region(node: torch.fx.Node, new: Any, old: Any) -> bool:
    """A region op whose result, computed from channels-last inputs, is channels-last
    where it was contiguous: converting it back costs the same later as now."""
    target = node.target
    region_op = target in _REGION_OPS or (isinstance(target, OpOverload)
                                          and torch.Tag.pointwise in target.tags)
    if not region_op or not _reads_values_only(node):
        return False
    pairs = list(zip(tensor_leaves(new), tensor_leaves(old)))
    return bool(pairs) and len(tensor_leaves(new)) == len(tree_leaves(new)) and all(
        _same_layout(n, o) or (_is_nhwc(n) and _is_contiguous(o)) for n, o in pairs) \
        and any(_is_nhwc(n) and not _same_layout(n, o) for n, o in pairs)


def _insert_conversion(source: torch.fx.Node, readers: list[torch.fx.Node], fmt: torch.memory_format,
                       fake_mode: Any) -> torch.fx.Node:
    """One `clone(source, memory_format=fmt)` before the first reader, read by all of them."""
    with source.graph.inserting_before(readers[0]):
        conversion = source.graph.call_function(aten.clone.default, (source,), {"memory_format": fmt})
    with fake_mode:
        conversion.meta["val"] = aten.clone.default(source.meta["val"], memory_format=fmt)
    for reader in readers:
        reader.replace_input_with(source, conversion)
    return conversion


def _convert_weight(gm: torch.fx.GraphModule, conv: torch.fx.Node, converted: dict,
                    fake_mode: Any) -> int:
    """Make the conv's weight channels-last: folded into a buffer when it is a
    constant (converted once, at optimize time), else an op in the graph. One
    conversion per weight, shared by the convs that read it (`converted`)."""
    weight = conv.args[1]
    if weight in converted:
        conv.replace_input_with(weight, converted[weight])
        return 0
    val = weight.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 4 or _is_nhwc(val):
        return 0
    conversion = _insert_conversion(weight, [conv], NHWC, fake_mode)
    converted[weight] = fold_node(gm, conversion) or conversion
    return 1


def _same_layout(new: Any, old: Any) -> bool:
    return same_sizes_and_dtypes(new, old) and same_strides(new, old)


def _is_nhwc(val: Any) -> bool:
    """Channels-last, and not also contiguous (as it is when C == 1, or H == W == 1)."""
    return _has_strides(val, _NHWC_ORDER) and not _is_contiguous(val)


def _is_contiguous(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and _has_strides(val, tuple(range(val.dim())))


def _has_strides(val: Any, order: tuple[int, ...]) -> bool:
    """Dense strides with dims laid out in `order`, outermost first (size-1 dims: any stride)."""
    if not isinstance(val, torch.Tensor) or val.dim() != len(order):
        return False
    expected = 1
    for d in reversed(order):
        size, stride = val.shape[d], val.stride(d)
        if shapes.known_true(size == 1):
            continue
        if not shapes.known_true(stride == expected):
            return False
        expected = expected * size
    return True
