"""Lower precision where it is cheap and safe: matmuls, convolutions and attention
compute in `compute_dtype` (bfloat16), everything else in the model's float32.

Which op computes in which dtype is a table with a reason per row, as autocast's
op lists: the products whose kernels accumulate in float32 inside (oneDNN, cuBLAS)
take bfloat16 inputs; what sums many terms, exponentiates or divides by a
statistic (softmax, norms, reductions) keeps float32, because bfloat16's 8-bit
mantissa loses what those add up. An op in neither list follows its inputs, which
the rewrite leaves in float32: each lowered op's result is cast back at once.

The error is not assumed: the manager runs the graph before and after this pass on
the compile's example inputs, records how far it moved (lowered_error.py: for a causal
LM, its next-token distributions) in the report, and undoes the pass for a graph whose
error is over `precision_tolerance`.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx

from .._compat import fake, mkldnn
from ..config import GraphOptimizationConfig
from ..report import FallbackKind
from .base import PassResult, erase_dead, value_of
from .constant_fold import FOLDED_RECIPES, FROZEN_INPUTS, constant_nodes, fold_node
from .fusion.conv import add_packed, drop_packed
from .quantize import COMPUTE_DTYPE, WEIGHT_QUANTIZATION
from .strides import fake_run

aten, prims = torch.ops.aten, torch.ops.prims

# Set by the manager: the error this pass's rewrite measured (`output_error`).
PRECISION_ERROR = "graphopt_precision_error"
# Set by the manager: how many positions of each sequence the greedy-token agreement compares.
AGREEMENT_STEPS = "graphopt_token_agreement_steps"
# How many times precision_tolerance int4 weights may move a graph. int4 keeps 16 levels per
# group of 32 weights: on Gemma-3 270M its best recipe (the value and MLP output projections in
# int8) moves the next-token distributions 0.09 nats (mean KL over 255 decode positions; one
# position reads 0.05 to 0.10), where int8 moves them 0.004. Held to int8's 0.05, a user who
# asked for int4 would get it on some graphs and not others, by the chance of one position.
INT4_SLACK = 3.0
_CAST = prims.convert_element_type.default
_GEMM = "a product: the kernel (oneDNN on the CPU, cuBLAS) multiplies bfloat16 and accumulates in float32"

# op -> (what it computes in, why). "lower": compute_dtype; "float32": the model's dtype.
PRECISION_TABLE: dict[Any, tuple[str, str]] = {
    aten.mm.default: ("lower", _GEMM),
    aten.addmm.default: ("lower", _GEMM + "; the bias is rounded to bfloat16 as autocast does"),
    aten.bmm.default: ("lower", _GEMM),
    aten.baddbmm.default: ("lower", _GEMM),
    aten.matmul.default: ("lower", _GEMM),
    aten.linear.default: ("lower", _GEMM + " (recompose_linear's linears)"),
    aten.convolution.default: ("lower", "a product as a GEMM: oneDNN's bfloat16 convolution accumulates in float32"),
    aten._scaled_dot_product_flash_attention_for_cpu.default: (
        "lower", "fused attention: its softmax runs in float32 inside the kernel"),
    aten._scaled_dot_product_flash_attention.default: (
        "lower", "fused attention (CUDA): its softmax runs in float32 inside the kernel"),
    aten._scaled_dot_product_efficient_attention.default: (
        "lower", "fused attention (CUDA): its softmax runs in float32 inside the kernel"),
    aten._softmax.default: ("float32", "exponentials of differences: small probabilities vanish in bfloat16"),
    aten._log_softmax.default: ("float32", "a log of a sum of exponentials"),
    aten.native_layer_norm.default: ("float32", "mean and variance over a row: a sum of many terms"),
    aten.native_group_norm.default: ("float32", "mean and variance over a group"),
    aten._native_batch_norm_legit_no_training.default: ("float32", "divides by a stored statistic"),
    aten.sum.dim_IntList: ("float32", "a sum of many terms (the statistics of a written-out norm)"),
    aten.mean.dim: ("float32", "a sum of many terms (RMSNorm's mean of squares)"),
    aten.var_mean.correction: ("float32", "a sum of many terms"),
    aten.rsqrt.default: ("float32", "the inverse of a norm's statistic"),
    aten.exp.default: ("float32", "its relative error grows with the argument"),
    aten.cumsum.default: ("float32", "a running sum"),
}
LOWERED_OPS = frozenset(op for op, (how, _) in PRECISION_TABLE.items() if how == "lower")


def lower_precision(gm: torch.fx.GraphModule) -> PassResult:
    """Compute each op the table lowers in `gm.meta["graphopt_compute_dtype"]`, its
    result cast back to float32 at once; a cast of a constant (frozen weights) is folded.

        before:  y = aten.linear(x, w, b);  s = aten._softmax(y, -1, False)
        after:   xb = prims.convert_element_type(x, bf16);  y = aten.linear(xb, _folded_0, _folded_1)
                 y32 = prims.convert_element_type(y, f32);  s = aten._softmax(y32, -1, False)

    Only float32 inputs are cast; an op with any other floating input is left alone.
    A value cast back and then cast to bfloat16 again for the next product is read
    as the bfloat16 value itself (the round trip is exact).
    """
    dtype = gm.meta.get(COMPUTE_DTYPE)
    fake_mode = fake.fake_mode_of(gm)
    if dtype is None or fake_mode is None:
        return PassResult(changed=False)
    constants = constant_nodes(gm)
    casts: dict[torch.fx.Node, torch.fx.Node] = {}
    lowered: dict[str, int] = {}
    packed_convs = _packed_convs()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not _float32_inputs(node):
            continue
        if node.target in LOWERED_OPS:
            done, name = _lower(gm, node, dtype, casts, constants, fake_mode), node.target._opname
        elif node.target in packed_convs:
            done, name = _lower_packed_conv(gm, node, packed_convs[node.target], dtype, casts, constants,
                                            fake_mode), "packed_convolution"
        else:
            continue
        if done:
            lowered[name] = lowered.get(name, 0) + 1
    return PassResult(changed=bool(lowered), counts=lowered)


def _packed_convs() -> dict[Any, int]:
    """fuse_conv's oneDNN convolutions (which run before this pass, on float32 spellings)
    -> where their packed weight is among the arguments."""
    return {mkldnn.conv_pointwise(): 1, mkldnn.conv_add(): 2} if mkldnn.available() else {}


def _lower_packed_conv(gm: torch.fx.GraphModule, node: torch.fx.Node, at: int, dtype: torch.dtype, casts: dict,
                       constants: set, fake_mode: Any) -> bool:
    """A fused convolution in `dtype`: its weight packed again from the weight cast to
    `dtype` (oneDNN's blocked layout differs by dtype), the rest as `_lower` does. Only
    a weight whose packing has a refresh recipe (frozen parameters) can be packed again.

        before:  y = mkldnn._convolution_pointwise(x, _packed_0, b, ...)     # float32 weight
        after:   y = mkldnn._convolution_pointwise(xb, _packed_1, _folded_2, ...);  y32 = convert(y, f32)
    """
    packed = node.args[at]
    recipe = gm.meta.get(FOLDED_RECIPES, {}).get(packed.target) if packed.op == "get_attr" else None
    if recipe is None:
        return False
    lowered_packed = _packed_in(gm, packed, recipe, dtype, fake_mode)
    node.replace_input_with(packed, lowered_packed)
    if _lower(gm, node, dtype, casts, constants, fake_mode):
        if not packed.users:
            drop_packed(gm, packed)
        return True
    node.replace_input_with(lowered_packed, packed)
    drop_packed(gm, lowered_packed)
    return False


def _packed_in(gm: torch.fx.GraphModule, packed: torch.fx.Node, recipe: torch.fx.GraphModule,
               dtype: torch.dtype, fake_mode: Any) -> torch.fx.Node:
    """A new `_packed_<i>`: `packed`'s recipe with its dense weight cast to `dtype` first."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(recipe.graph, {})
    with graph.inserting_before(out):
        cast = graph.call_function(_CAST, (out.args[0], dtype))
    out.args = (cast, *out.args[1:])
    graph.output(out)
    lowered = torch.fx.GraphModule(recipe, graph)
    frozen = gm.meta[FROZEN_INPUTS]
    with fake.outside_fake_mode(), torch.inference_mode(False), torch.no_grad():
        value = lowered(*[frozen[p.target] for p in graph.find_nodes(op="placeholder")])
    with fake_mode:
        val = torch.empty_like(value_of(packed), dtype=dtype)  # the dense weight's sizes
    with gm.graph.inserting_before(packed):
        return add_packed(gm, value, lowered, val)


def _float32_inputs(node: torch.fx.Node) -> bool:
    dtypes = {value_of(i).dtype for i in node.all_input_nodes if value_of(i) is not None
              and value_of(i).dtype.is_floating_point}
    return dtypes == {torch.float32}


def _lower(gm: torch.fx.GraphModule, node: torch.fx.Node, dtype: torch.dtype, casts: dict,
           constants: set, fake_mode: Any) -> bool:
    """Rewrite one op to read `dtype` casts of its float32 inputs and cast its results back."""
    old_args, old_kwargs = node.args, node.kwargs
    sources = [s for s in node.all_input_nodes if value_of(s) is not None and value_of(s).dtype == torch.float32]
    for source in sources:
        if source not in casts:
            casts[source] = _cast_to(gm, node, source, dtype, constants, fake_mode)
        node.replace_input_with(source, casts[source])
    new_val = fake_run(node, {}, fake_mode)
    if new_val is None:  # the op refuses this dtype: put it back as it was
        node.args, node.kwargs = old_args, old_kwargs
        for source in [s for s in sources if not casts[s].users]:
            erase_dead(casts.pop(source))
        return False
    for source in sources:  # a weight's view whose cast was folded
        if source.op == "call_function" and not source.users:
            erase_dead(source)
    node.meta["val"] = new_val
    node.meta.pop("tensor_meta", None)
    if isinstance(new_val, torch.Tensor):
        _cast_back(gm, node, fake_mode)
    else:
        for item in [u for u in node.users if u.target is operator.getitem]:
            item.meta["val"] = new_val[item.args[1]]
            if isinstance(item.meta["val"], torch.Tensor) and item.meta["val"].dtype == dtype:
                _cast_back(gm, item, fake_mode)
    return True


def _cast_to(gm: torch.fx.GraphModule, user: torch.fx.Node, source: torch.fx.Node, dtype: torch.dtype,
             constants: set, fake_mode: Any) -> torch.fx.Node:
    """`source` in `dtype`, made before `user` (its first reader in this dtype): a
    value this pass cast back is read as it was; a constant's cast is folded once."""
    inner = source.args[0] if source.target is _CAST else None
    if value_of(inner) is not None and value_of(inner).dtype == dtype:
        return inner
    with gm.graph.inserting_before(user):
        cast = gm.graph.call_function(_CAST, (source, dtype))
    cast.meta["val"] = fake_run(cast, {}, fake_mode)
    if source in constants:
        return fold_node(gm, cast) or cast
    return cast


def _cast_back(gm: torch.fx.GraphModule, node: torch.fx.Node, fake_mode: Any) -> None:
    """Every reader of `node` now reads it cast back to float32."""
    with gm.graph.inserting_after(node):
        back = gm.graph.call_function(_CAST, (node, torch.float32))
    back.meta["val"] = fake_run(back, {}, fake_mode)
    node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)


def tolerance(config: GraphOptimizationConfig) -> tuple[float | None, float]:
    """(the bound on the error of the lowering `config` asks for, how many times
    precision_tolerance it is): precision_tolerance, or INT4_SLACK times it for int4 weights."""
    slack = INT4_SLACK if config.weight_quantization == "int4" else 1.0
    return (None if config.precision_tolerance is None else config.precision_tolerance * slack), slack


def with_opt_in(pipeline: list[str], after: str | None, config: GraphOptimizationConfig) -> list[str]:
    """`pipeline` with the passes that lower precision the config asks for, after `after`."""
    opt_in = [name for name, key in zip(MEASURED_PASSES, ("weight_quantization", "compute_dtype"))
              if getattr(config, key) is not None]
    if not opt_in or after is None:
        return list(pipeline)
    at = pipeline.index(after) + 1
    return [*pipeline[:at], *opt_in, *pipeline[at:]]


def prepare(gm: torch.fx.GraphModule, config: GraphOptimizationConfig,
            fallback: Callable[[FallbackKind, str], None]) -> None:
    """Tell the passes that lower precision what the config asks of `gm` (`gm.meta`)."""
    if config.compute_dtype is not None:
        gm.meta[COMPUTE_DTYPE] = compute_dtype(gm, config.compute_dtype, fallback)
    gm.meta[WEIGHT_QUANTIZATION] = weight_quantization(gm, config.weight_quantization, fallback)
    gm.meta[AGREEMENT_STEPS] = config.token_agreement_steps


def compute_dtype(gm: torch.fx.GraphModule, name: str,
                  fallback: Callable[[FallbackKind, str], None]) -> torch.dtype | None:
    """The dtype `lower_precision` computes `gm` in: `name` where the graph's device
    computes it natively, else None, with the reason given to `fallback`."""
    dtype = getattr(torch, name)
    device = _device(gm)
    if device == "cpu" and not mkldnn.cpu_has_native_bf16():
        fallback(FallbackKind.PRECISION,
                 f"compute_dtype={name!r}: this CPU has no native bfloat16 arithmetic (AVX512-BF16 or AMX), "
                 "where bfloat16 runs slower than float32; the graph computes in float32")
        return None
    if device == "cuda" and not torch.cuda.is_bf16_supported():
        fallback(FallbackKind.PRECISION,
                 f"compute_dtype={name!r}: this GPU has no bfloat16 arithmetic; the graph computes in float32")
        return None
    return dtype


def weight_quantization(gm: torch.fx.GraphModule, name: str | None,
                        fallback: Callable[[FallbackKind, str], None]) -> str | None:
    """The weight format `quantize_weights` gives `gm`: `name`, or None where the graph's
    device has no kernel for it, with the reason given to `fallback`."""
    device = _device(gm)
    if name == "int4" and device not in (None, "cpu"):
        # torch's CUDA int4 kernel packs its weight another way, which graphopt has not been run against.
        fallback(FallbackKind.PRECISION,
                 f"weight_quantization='int4' runs on the CPU only (torch's _weight_int4pack_mm_for_cpu); "
                 f"on {device} the linears keep their float weights")
        return None
    return name


def _device(gm: torch.fx.GraphModule) -> str | None:
    for node in gm.graph.find_nodes(op="placeholder"):
        val = value_of(node)
        if val is not None:
            return val.device.type
    return None


# The passes whose error the manager measures against full precision, as `label` names them.
MEASURED_PASSES = ("quantize_weights", "lower_precision")
NOT_MEASURED = ("compute_dtype, weight_quantization: the error of lower precision was not measured (the ATen "
                "graph's inputs do not match Dynamo's example inputs), so precision_tolerance is not checked for "
                "this graph")


def label(gm: torch.fx.GraphModule) -> str:
    """What lowers the graph's precision: "int8 weights", "bfloat16", or both."""
    parts = [f"{gm.meta[WEIGHT_QUANTIZATION]} weights" if gm.meta.get(WEIGHT_QUANTIZATION) else None,
             str(gm.meta[COMPUTE_DTYPE]).removeprefix("torch.") if gm.meta.get(COMPUTE_DTYPE) else None]
    return " + ".join(p for p in parts if p)
