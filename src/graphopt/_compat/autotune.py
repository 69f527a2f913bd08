"""Inductor's autotuning: what its GEMM autotuning chose (its feedback hook,
`select_algorithm`'s feedback savers, private), which sees every measured choice of
every autotuned op; and whether its kernels' launcher is tuning at run time."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

import torch

# Inductor's kernel launchers (`triton_heuristics`) and the benchmarking they tune with.
_RUNTIME_DIR = os.path.join(os.path.dirname(torch.__file__), "_inductor", "runtime", "")


@contextlib.contextmanager
def gemm_choices() -> Iterator[dict[str, str]]:
    """Within the block, each autotuned op Inductor measures adds one entry:
    "mm [1, 256] x [256, 768]" -> "C++ template 41 us (ATen 70 us)". Empty on a torch
    without the hook, and for ops whose choice came from Inductor's caches."""
    chosen: dict[str, str] = {}
    try:
        from torch._inductor import select_algorithm
        cache = select_algorithm.get_algorithm_selector_cache()
        savers = cache.feedback_saver_fns
    except (ImportError, AttributeError):
        yield chosen
        return

    def saver(timings, name, input_nodes, choices, *_rest) -> None:
        if not timings:
            return
        sizes = " x ".join(str([int(s) if str(s).isdigit() else str(s) for s in n.get_size()]) for n in input_nodes)
        times = sorted((t, _kind(c)) for c, t in timings.items())
        best = min((t, kind) for t, kind in times)
        others = {kind: t for t, kind in reversed(times) if kind != best[1]}  # each other kind's best
        rest = ", ".join(f"{kind} {t * 1e3:.0f} us" for kind, t in sorted(others.items(), key=lambda kv: kv[1]))
        chosen[f"{name} {sizes}"] = f"{best[1]} {best[0] * 1e3:.0f} us" + (f" ({rest})" if rest else "")

    savers.append(saver)
    try:
        yield chosen
    finally:
        savers.remove(saver)


def _kind(choice: object) -> str:
    kind = type(getattr(choice, "_wrapped", choice)).__name__  # unwrapped from Inductor's data processors
    return {"ExternKernelCaller": "ATen", "CppTemplateCaller": "C++ template",
            "TritonTemplateCaller": "Triton template"}.get(kind, kind)


def tuning_at_run_time() -> bool:
    """Whether the ATen op being dispatched comes from Inductor's kernel launcher
    rather than the compiled step: a Triton kernel with several configurations is
    timed at its first launch (copies of its arguments, timings read back to the
    host), once per process. A launch itself dispatches no ATen op."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_RUNTIME_DIR):
            return True
        frame = frame.f_back
    return False
