"""Whether a weight-only int8 or int4 kernel is faster than the float GEMM it would
replace, at one shape: timed once per process on random values of that shape.

Fewer weight bytes are the point of quantization only where the GEMM is bound by them
(a decode step's few rows); with more rows it is bound by arithmetic, where the fused
dequant kernels lose to a float GEMM on a packed weight. On all-MiniLM-L6-v2 at batch
16 (16-token sentences, 1 thread) int8 weights made the encoder 1.9x slower than
float32 eager, and nothing had timed it. So quantize_weights asks `loses` per product,
at the rows the graph was traced with, as Inductor times its GEMM templates against
ATen's per shape.

The float side is the fastest form a float GEMM takes here: ATen's, and oneDNN's on a
weight packed once (what fuse_packed_linear, or at level 2 Inductor's C++ template,
makes of it), in the dtype the graph computes its linears in.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from .._compat import fake, mkldnn

aten = torch.ops.aten
# Weights of fewer elements are quantized untimed: their GEMMs take microseconds either
# way, within the timer's noise, and a timing would cost more than it could save.
MIN_TIMED_WEIGHTS = 1 << 16
# How many int4 weights share a scale and a zero (quantize.INT4_GROUP).
_GROUP = 32
_ROUNDS, _ROUND_SECONDS = 5, 0.005
_LOSES: dict[tuple, bool] = {}


def loses(fmt: str, rows: int, out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether `fmt`'s kernel ("int8" or "int4"), with the casts of its activations to
    bfloat16 and back, is slower than the float GEMM [rows, in] x [in, out] in `dtype`.
    Remembered per shape for the process."""
    if out_features * in_features < MIN_TIMED_WEIGHTS:
        return False
    key = (fmt, rows, out_features, in_features, dtype, torch.get_num_threads())
    if key not in _LOSES:
        with fake.outside_fake_mode(), torch.no_grad():  # the pass runs on fake values
            x = torch.randn(rows, in_features, dtype=dtype)
            weight_only = _kernel(fmt, x, out_features)
            float_ = _fastest(_float_gemms(x, torch.randn(out_features, in_features, dtype=dtype)))
            _LOSES[key] = _seconds(weight_only) > float_
    return _LOSES[key]


def _kernel(fmt: str, x: torch.Tensor, n: int) -> Callable[[], torch.Tensor]:
    k = x.shape[1]
    if fmt == "int8":
        q, scales = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, dtype=torch.bfloat16)

        def weight_only() -> torch.Tensor:
            return aten._weight_int8pack_mm(x.to(torch.bfloat16), q, scales).to(x.dtype)
        return weight_only
    packed = aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    pairs = torch.rand(k // _GROUP, n, 2, dtype=torch.bfloat16)

    def weight_only() -> torch.Tensor:
        return aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, _GROUP, pairs).to(x.dtype)
    return weight_only


def _float_gemms(x: torch.Tensor, w: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
    def aten_gemm() -> torch.Tensor:
        return F.linear(x, w)

    gemms = [aten_gemm]
    if mkldnn.available() and (x.dtype == torch.float32 or mkldnn.cpu_has_native_bf16()):
        packed = mkldnn.pack_linear_weight(w, x.shape[0])

        def onednn_gemm() -> torch.Tensor:
            return mkldnn.linear_pointwise()(x, packed, None, "none", [], "")
        gemms.append(onednn_gemm)
    return gemms


def _fastest(gemms: list[Callable[[], torch.Tensor]]) -> float:
    return min(_seconds(gemm) for gemm in gemms)


def _seconds(fn: Callable[[], torch.Tensor]) -> float:
    """The fastest of a few rounds' seconds per call, after a warm-up call."""
    fn()
    best = float("inf")
    for _ in range(_ROUNDS):
        calls, start = 0, time.perf_counter()
        while (spent := time.perf_counter() - start) < _ROUND_SECONDS or calls < 2:
            fn()
            calls += 1
        best = min(best, spent / calls)
    return best
