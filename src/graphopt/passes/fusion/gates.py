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
    fused softmax kernel). The reference decoder's decode step (hidden 256, 4
    layers, 8/4 heads, 128-token cache, 1 thread) measured 0.83x `torch.compile`
    at batch 16 with the rewrite and 1.00x without, and no gain at batch 1. At
    level 1 the fused kernel replaces ~10 Python-dispatched ops and pays; with a
    query longer than one token (prefill, encoders) it pays at both levels.
    """
    return ENABLED and level == 2 and device.type == "cpu" and isinstance(query_len, int) and query_len == 1
