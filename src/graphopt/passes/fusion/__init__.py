"""Fusion passes: several ops replaced by one that does the same work in one call.

`fusion_passes()` lists the library's fusion passes in the order they run (larger
patterns before the smaller ones they contain); `fused_op_counts` is the fused-op
table of `report()`.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
import torch.fx

from ..._compat.names import OpOverload

aten = torch.ops.aten

# Ops a fusion produces, by the name the report shows (graphopt's own ops are
# added by namespace). Recomposed linear/matmul are not fusions: eager had them.
FUSED_ATEN_OPS: dict[object, str] = {
    aten.native_layer_norm.default: "layer_norm",
    aten._prelu_kernel.default: "prelu",
    aten.gelu.default: "gelu",
    aten.gelu_.default: "gelu",  # reinplace_intermediates makes most gelus in-place
    aten._scaled_dot_product_flash_attention_for_cpu.default: "scaled_dot_product_attention",
    aten._scaled_dot_product_flash_attention.default: "scaled_dot_product_attention",
    aten._scaled_dot_product_efficient_attention.default: "scaled_dot_product_attention",
    aten._scaled_dot_product_cudnn_attention.default: "scaled_dot_product_attention",
}
# A node's meta key naming the fused op it is, for a fusion whose result is an op
# eager code writes too (horizontal fusion's split_with_sizes).
FUSED_TAG = "graphopt_fused"


def fusion_passes() -> dict[str, Callable]:
    """The library's fusion passes by name, in pipeline order."""
    from .activation import fuse_activations
    from .attention import fuse_attention
    from .collective import fuse_all_reduce_norms
    from .conv import fuse_conv
    from .decode_attention import fuse_decode_attention
    from .eltwise import fuse_eltwise
    from .horizontal import fuse_horizontal_linear
    from .linear import fuse_matmul_transpose
    from .norm import fuse_norms
    from .pooling import fuse_pooling
    from .replacement import USER_PATTERNS
    from .rotary import fuse_rotary

    return {"user_replacements": USER_PATTERNS, "fuse_norms": fuse_norms,
            "fuse_all_reduce_norms": fuse_all_reduce_norms,
            # Before fuse_attention, which would make the same attention SDPA.
            "fuse_decode_attention": fuse_decode_attention, "fuse_attention": fuse_attention,
            "fuse_rotary": fuse_rotary, "fuse_activations": fuse_activations,
            # Before fuse_eltwise, which could take the residual add the convolution absorbs.
            "fuse_conv": fuse_conv, "fuse_eltwise": fuse_eltwise, "fuse_pooling": fuse_pooling,
            "fuse_matmul_transpose": fuse_matmul_transpose, "fuse_horizontal_linear": fuse_horizontal_linear}


def fused_op_counts(graph: torch.fx.Graph) -> dict[str, int]:
    """How many of each fused op `graph` contains, like ONNX Runtime's fused-operator
    statistics."""
    counts: Counter = Counter()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if FUSED_TAG in node.meta:
            counts[node.meta[FUSED_TAG]] += 1
        elif node.target in FUSED_ATEN_OPS:
            counts[FUSED_ATEN_OPS[node.target]] += 1
        elif isinstance(node.target, OpOverload) and node.target.namespace == "graphopt":
            counts[node.target._schema.name.split("::")[1]] += 1
    return dict(sorted(counts.items()))
