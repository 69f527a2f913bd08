"""oneDNN's fused convolution ops (`torch.ops.mkldnn`), which torch builds for
Inductor's own CPU fusions and documents nowhere: the only place graphopt names them.

`conv_pointwise` is `_convolution_pointwise(x, w, b, padding, stride, dilation,
groups, unary, scalars, algorithm)`: a convolution with an activation as a oneDNN
post-op. `conv_add` is its `.binary` overload, `(x, other, w, b, ..., "add", None,
unary, scalars, algorithm)`: the convolution's output plus `other`, then the
activation, in one call. Both return channels-last whatever the input's layout.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN and the fused convolution ops (and, registered
    here on first use, a fake implementation of `conv_add`, which torch lacks)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops, "mkldnn")
            and hasattr(torch.ops.mkldnn, "_convolution_pointwise")):
        return False
    try:
        torch.library.register_fake("mkldnn::_convolution_pointwise.binary")(_conv_add_fake)
    except RuntimeError:  # a torch that has its own
        pass
    return True


def _conv_add_fake(x: torch.Tensor, other: torch.Tensor, w: torch.Tensor, b: Any, padding: Any, stride: Any,
                   dilation: Any, groups: int, *_: Any) -> torch.Tensor:
    return conv_pointwise()(x, w, b, padding, stride, dilation, groups, "none", [], None)


def conv_pointwise() -> Any:
    return torch.ops.mkldnn._convolution_pointwise.default


def conv_add() -> Any:
    return torch.ops.mkldnn._convolution_pointwise.binary


def pack_conv_weight(weight: torch.Tensor, padding: Sequence[int], stride: Sequence[int],
                     dilation: Sequence[int], groups: int, input_size: Sequence[int]) -> torch.Tensor:
    """`weight` reordered once into the blocked layout oneDNN's kernel reads for an
    input of `input_size` (an opaque mkldnn tensor; the ops above take it as their
    weight). A dense weight is reordered at every call instead."""
    return torch.ops.aten.mkldnn_reorder_conv2d_weight.default(
        torch.ops.aten.to_mkldnn.default(weight), list(padding), list(stride), list(dilation), groups,
        list(input_size))


def linear_pointwise() -> Any:
    """`_linear_pointwise(x, w, b, unary, scalars, algorithm)`: a linear with an
    activation as a oneDNN post-op ("gelu" with algorithm "none" or "tanh", "relu",
    "none"); x of any rank, the result dense like `linear`'s."""
    return torch.ops.mkldnn._linear_pointwise.default


def pack_linear_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` ([out, in]) reordered once into oneDNN's blocked layout for inputs of
    about `rows` rows (any row count runs on it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 products natively (AVX512-BF16 or AMX), where
    oneDNN's bfloat16 GEMMs and convolutions beat float32's. Elsewhere torch emulates
    bfloat16 with float32 arithmetic: right, but slower than float32. torch asks the
    CPU only through private functions."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)
