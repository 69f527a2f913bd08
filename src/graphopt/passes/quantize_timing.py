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

import functools
import itertools
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
# Bytes of copies each side's weight is timed over: past the last-level cache of the CPUs
# this runs on (32 MiB an EPYC core complex, up to ~100 MiB a Xeon socket), so the
# weights are read from memory, as a step over a model's weights reads them.
COLD_BYTES = 1 << 27
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
            gemms = _float_gemms(x, torch.randn(out_features, in_features, dtype=dtype))
            weight_only, *float_ = _interleaved([_kernel(fmt, x, out_features), *gemms])
            _LOSES[key] = weight_only > min(float_)
    return _LOSES[key]


def _copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` and enough copies of it to fill COLD_BYTES: timed in turn, each is read
    from memory, as a model's step reads its weights, not from a cache one copy fits in,
    which flatters the format with more bytes: Gemma-3's down projection (2048 -> 640) at
    one row, float32 packed, took 79 us from the cache against int4's 84, and 270 us
    against 87 from memory."""
    return [weight] + [weight.clone() for _ in range(COLD_BYTES // (weight.numel() * weight.element_size()))]


def _in_turn(calls: list[Callable[[], torch.Tensor]]) -> Callable[[], torch.Tensor]:
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def _kernel(fmt: str, x: torch.Tensor, n: int) -> Callable[[], torch.Tensor]:
    k = x.shape[1]
    if fmt == "int8":
        scales = torch.rand(n, dtype=torch.bfloat16)
        calls = [functools.partial(_int8_mm, x, q, scales) for q in
                 _copies(torch.randint(-127, 128, (n, k), dtype=torch.int8))]
    else:
        packed = aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        pairs = torch.rand(k // _GROUP, n, 2, dtype=torch.bfloat16)
        calls = [functools.partial(_int4_mm, x, q, pairs) for q in _copies(packed)]
    turn = itertools.cycle(calls)

    def weight_only() -> torch.Tensor:
        return next(turn)()
    return weight_only


def _int8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return aten._weight_int8pack_mm(x.to(torch.bfloat16), q, scales).to(x.dtype)


def _int4_mm(x: torch.Tensor, q: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    return aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), q, _GROUP, pairs).to(x.dtype)


def _float_gemms(x: torch.Tensor, w: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
    weights = _copies(w)
    gemms = [_in_turn([functools.partial(F.linear, x, copy) for copy in weights])]
    if mkldnn.available() and (x.dtype == torch.float32 or mkldnn.cpu_has_native_bf16()):
        linear = mkldnn.linear_pointwise()
        gemms.append(_in_turn([functools.partial(linear, x, mkldnn.pack_linear_weight(copy, x.shape[0]), None,
                                                 "none", [], "") for copy in weights]))
    return gemms


def _interleaved(fns: list[Callable[[], torch.Tensor]]) -> list[float]:
    """Each of `fns`' fastest round's seconds per call, after a warm-up call each; the
    rounds taken in turn, so that a machine whose speed drifts (a shared 2-core VM: up to
    1.6x within an hour) drifts under every side alike."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(_ROUNDS):
        best = [min(b, _seconds(fn)) for b, fn in zip(best, fns)]
    return best


def _seconds(fn: Callable[[], torch.Tensor]) -> float:
    """One round's seconds per call: at least _ROUND_SECONDS and two calls."""
    calls, start = 0, time.perf_counter()
    while (spent := time.perf_counter() - start) < _ROUND_SECONDS or calls < 2:
        fn()
        calls += 1
    return spent / calls
