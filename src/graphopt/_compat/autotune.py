"""Inductor's autotuning: what its GEMM autotuning chose (its feedback hook,
`select_algorithm`'s feedback savers, private), which sees every measured choice of
every autotuned op; where it keeps its timings; the settings that keep it off the
user's stdout and stderr; and whether its kernels' launcher is tuning at run time."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pathlib
import sys
import tempfile
import warnings
from typing import Any, Iterator
from unittest import mock

import torch

# Inductor writes these to stderr itself (not through logging): the JSON of
# "Autotune Choices Stats" and the table of timed choices. The report carries the
# choices instead (GraphRecord.gemms). Keys an older torch lacks are left out.
_QUIET = {"max_autotune_report_choices_stats": False, "autotune_num_choices_displayed": 0}
# Inductor's kernel launchers (`triton_heuristics`) and the benchmarking they tune with.
# The dicts of the gemm_choices blocks now open, innermost last.
_OPEN: list[dict[str, str]] = []
_RUNTIME_DIR = os.path.join(os.path.dirname(torch.__file__), "_inductor", "runtime", "")


def quiet_options() -> dict[str, Any]:
    """Inductor settings that print nothing of its autotuning, for the installed torch."""
    import torch._inductor.config as inductor_config

    return {key: value for key, value in _QUIET.items() if hasattr(inductor_config, key)}


@functools.cache
def hide_inductor_storage_warning() -> None:
    """Inductor's autotuning calls the deprecated `Tensor.storage()`, whose one warning
    per process would land on the user's stderr during a compile they did not write.
    The filter matches only warnings raised from Inductor's own modules, so a user's
    own call still warns."""
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning,
                            module=r"torch\._inductor\.")


class _NoCudaHome(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


@functools.cache
def hide_cuda_home_warning() -> None:
    """A CUDA build of torch on a machine without a GPU logs, when its C++ extension
    loader is first imported (by a CPU compile: Inductor's, or graphopt's kernels),
    that it found no CUDA runtime: about the machine, not the user's model, and on
    their stderr. The filter drops that one message of that one logger."""
    logging.getLogger("torch.utils.cpp_extension").addFilter(_NoCudaHome())


@contextlib.contextmanager
def gemm_choices() -> Iterator[dict[str, str]]:
    """Within the block, each autotuned op Inductor measures adds one entry:
    "mm [1, 256] x [256, 768]" -> "C++ template 41 us (ATen 70 us)". Empty on a torch
    without the hook, and for ops whose choice came from Inductor's caches."""
    chosen: dict[str, str] = {}
    _OPEN.append(chosen)
    try:
        with _saving_into(chosen):
            yield chosen
    finally:
        _OPEN.remove(chosen)


@contextlib.contextmanager
def timings_kept_per(machine: str | None) -> Iterator[None]:
    """Inside, Inductor's local autotune cache (its GEMM timings by op, shapes, dtypes
    and strides, in one file per GPU kind and torch, none per CPU) is one file per
    `machine` as well: timings taken on one kind of CPU never choose another's kernels
    where machines share `$TORCHINDUCTOR_CACHE_DIR`. With `machine` None the file is in
    a directory of this process's, removed at its exit: the timings are kept for this
    process only, and still taken once per shape (Inductor keeps none in memory: without
    its local cache each of the ~1B decoder's 22 layers timed its two GEMM shapes again)."""
    try:
        from torch._inductor.codecache import CacheBase
        path = CacheBase.get_local_cache_path
    except (ImportError, AttributeError):
        yield
        return

    def per_machine() -> Any:
        local = path()
        if machine is None:
            return pathlib.Path(_process_directory().name) / local.name
        return local.with_name(f"{local.name}-{hashlib.sha256(machine.encode()).hexdigest()[:16]}")

    with mock.patch.object(CacheBase, "get_local_cache_path", staticmethod(per_machine)):
        yield


@functools.cache
def _process_directory() -> tempfile.TemporaryDirectory:
    """Held here until the interpreter exits, when its finalizer removes it."""
    return tempfile.TemporaryDirectory(prefix="graphopt-timings-")


def open_choices() -> list[dict[str, str]]:
    """The dicts of the `gemm_choices` blocks open now: a compile whose code is generated
    in a child process (background.py) adds the child's choices to them when it arrives."""
    return list(_OPEN)


@contextlib.contextmanager
def _saving_into(chosen: dict[str, str]) -> Iterator[None]:
    try:
        from torch._inductor import select_algorithm
        cache = select_algorithm.get_algorithm_selector_cache()
        savers = cache.feedback_saver_fns
    except (ImportError, AttributeError):
        yield
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
        yield
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


def extension_build_lock(name: str) -> str:
    """The lock file torch's C++ extension loader holds while it builds `name`: a build
    that was killed leaves it behind, and every later load of `name` waits on it."""
    from torch.utils import cpp_extension

    return os.path.join(cpp_extension._get_build_directory(name, verbose=False), "lock")
