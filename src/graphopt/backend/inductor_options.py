"""The Inductor settings graphopt compiles level 2 with, each with the measurement or
the reason behind it; the user's `inductor_compile_config` goes on top of them."""

from __future__ import annotations

from typing import Any

from .._compat import autotune, distributed

# Below this many bytes of parameters a graph's step is short enough for the Python wrapper's
# overhead to show (DecoderConfig.small, 15 MiB: 9% at batch 1); from 52 MiB up the two
# wrappers' steps are level, and the C++ one costs 10 s more to build (docs/configuration.md).
CPP_WRAPPER_MAX_WEIGHT_BYTES = 32 * 2**20


def inductor_options(device_type: str, cached: bool, frozen: bool = False, weight_bytes: int = 0) -> dict[str, Any]:
    """The Inductor settings graphopt uses at level 2 for a graph whose
    parameters take `weight_bytes` (measured: docs/configuration.md)."""
    options: dict[str, Any] = {
        # Without graphopt's cache a hit in Inductor's would skip the passes and leave
        # the report without them; with it, graphopt's cache holds their records.
        "fx_graph_cache": cached,
        **autotune.quiet_options(),
    }
    if device_type == "cpu" and frozen:
        # The C++ GEMM template packs a constant weight for its micro-kernel and wins on some
        # shapes only, so each such GEMM is timed against ATen's (GraphRecord.gemms); the
        # timings are kept in Inductor's local cache, in the compile cache's directory or, with
        # that off, for this process only (autotune.timings_kept_per; docs/configuration.md).
        options.update(max_autotune_gemm=True, max_autotune_gemm_backends="CPP,ATEN", autotune_local_cache=True)
    if device_type == "cpu" and weight_bytes < CPP_WRAPPER_MAX_WEIGHT_BYTES and \
            not distributed.distributed_initialized():
        # A C++ wrapper instead of a Python one: a small decode step runs faster, for a
        # longer compile (docs/configuration.md, "Measured: Inductor settings on the CPU").
        # It cannot call c10d's collectives, so a process with a process group goes without.
        options["cpp_wrapper"] = True
    if device_type == "cuda":
        # graphopt's GraphRunner owns device graphs; Inductor's own would nest inside it.
        options["triton.cudagraphs"] = False
    return options


# refresh()'s second compile of a frozen graph. Inductor's FX graph cache, and AOTAutograd's
# that rests on it, would hand back code holding packed copies of the old weights, so both
# are off; the C++ build cache stays on: it keys on the source, which holds no weight value
# (`force_disable_caches` would rebuild every kernel in a new temporary cache directory that
# Inductor never deletes). Outside Dynamo's trace the sizes have no hints, which the benchmark
# harness (debugging code appended to every module) asks for on torch 2.11.
RECOMPILE_OPTIONS = {"fx_graph_cache": False, "benchmark_harness": False}
