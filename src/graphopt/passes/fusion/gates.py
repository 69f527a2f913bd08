"""Where a fusion loses: the level, device and shapes at which a rewrite measured
slower than the code it replaces, so the pass leaves those matches alone.

A fusion that makes no difference at a level (Inductor generates the same kernel
from the written-out form) is not gated here: it is left out of that level's
pipeline (`passes/manager.py`, `PIPELINES`). What a gate skips is counted in the
pass's record as `gated`. The figures behind each gate come from
`benchmarks/fusion_gates.py`, which turns the gates off (`ENABLED = False`) to
time the rewrite they skip against the code they keep.
"""

from __future__ import annotations

import torch

# benchmarks/fusion_gates.py sets this False while it compiles the ungated variant.
ENABLED = True


def sdpa_loses(level: int, device: torch.device, query_len: int | torch.SymInt) -> bool:
    """Single-token queries (decode) at level 2 on the CPU.

    There the CPU flash kernel, split into query blocks it cannot fill, is slower
    than what Inductor makes of the written-out attention (two GEMMs around one
    fused softmax kernel): on the decode step of `DecoderConfig.small()` the rewrite
    made level 2 slower. At level 1 the fused kernel replaces about ten
    Python-dispatched ops and pays; with prefill or encoder queries it pays at both
    levels. Figures: docs/fusion.md, "Fusion gates".
    """
    return ENABLED and level == 2 and device.type == "cpu" and isinstance(query_len, int) and query_len == 1


def decode_attention_loses(device: torch.device, query_len: int | torch.SymInt) -> bool:
    """Queries longer than one token (prefill), and the CPU where the C++ kernel
    could not be built.

    The kernel reads a sequence's keys and values once per query token, where SDPA's
    flash kernel reads them once per block of queries; and without the C++ kernel the
    op gathers whole cache rows for SDPA, which is what `fuse_attention` makes of the
    same attention anyway. Where it runs it pays at both levels (the decode step of
    `DecoderConfig.small()`, position 7, 1 thread, `benchmarks/decode_attention.py`).
    """
    from ...kernels.decode_attention import native_unavailable

    return ENABLED and (not (isinstance(query_len, int) and query_len == 1)
                        or device.type == "cpu" and native_unavailable() is not None)


# Multiply-adds of one linear below which oneDNN's call costs more than its packed
# weight saves (fuse_packed_linear).
PACKED_LINEAR_MIN_MACS = 1 << 22


def packed_linear_loses(rows: int, in_features: int, out_features: int, dtype: torch.dtype) -> bool:
    """Small float32 GEMMs: rows x in x out < 2**22 multiply-adds (rows: the traced batch's).

    There oneDNN's per-call cost outweighs the packed weight: the small BERT encoder
    at batch 1 ran slower packed, at batch 8 and on BERT-base faster. Never in
    bfloat16: oneDNN reorders a plain bfloat16 weight at every call, so the packed one
    was faster at every shape measured, down to one row of 384 x 384 (docs/fusion.md,
    "Fusion gates").
    """
    return ENABLED and dtype == torch.float32 and rows * in_features * out_features < PACKED_LINEAR_MIN_MACS


def add_layer_norm_loses(device: torch.device, dtype: torch.dtype) -> bool:
    """Anywhere but float32 on the CPU, and on a CPU where the C++ kernel could not be built.

    There the op would run torch's add and LayerNorm behind one more call. Where the
    kernel runs it is faster than the two ops at every row shape measured
    (docs/fusion.md, "Fusion gates").
    """
    from ...kernels.layer_norm import native_unavailable

    return ENABLED and (device.type != "cpu" or dtype != torch.float32 or native_unavailable() is not None)
