"""graphopt's C++ sources built on first use with torch's C++ extension loader (a C++
compiler and `ninja`, both already needed by Inductor's CPU code), into torch's
extensions directory (`$TORCH_EXTENSIONS_DIR`, else `~/.cache/torch_extensions`),
once per source, flags, torch version and `key`: the first build on a machine takes
about a minute, later processes (of any checkout or venv with that torch) load it in
milliseconds."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

from ..report import first_line

log = logging.getLogger("graphopt")

# A build takes about a minute; a lock this old is one a killed build left behind.
STALE_LOCK_SECONDS = 15 * 60

# Compiler flags per vector ISA torch reports, as Inductor builds its CPU kernels.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}


def build(stem: str, source: Path, extra_cflags: Sequence[str], key: str = "",
          python_module: bool = True) -> tuple[Any, str | None]:
    """(the loaded extension, None), or (None, why it could not be built). `key` names
    what else the build depends on (the vector ISA its flags ask for); a library that
    is no Python module registers its ops with the dispatcher as it loads."""
    import torch

    from .._compat import autotune

    autotune.hide_cuda_home_warning()
    from torch.utils import cpp_extension

    what = b"\0".join([source.read_bytes(), torch.__version__.encode(), key.encode(), " ".join(extra_cflags).encode()])
    name = f"{stem}_{hashlib.sha256(what).hexdigest()[:12]}"
    try:
        lock = autotune.extension_build_lock(name)
        _remove_stale_lock(lock)
        built = _load_built(name, lock, python_module)
        if built is not None:
            return built, None
        module = cpp_extension.load(name, [str(source)], extra_cflags=list(extra_cflags),
                                    is_python_module=python_module)
        return module, None
    except Exception as error:  # noqa: BLE001 - no compiler, no ninja, a header torch moved: the caller falls back
        return None, first_line(error) or type(error).__name__


def _load_built(name: str, lock: str, python_module: bool) -> Any:
    """What an earlier build of `name` left, loaded as torch's loader loads it, or None.
    The name holds all the build depends on; torch's loader would build it again for
    another checkout or venv, whose paths are in its ninja file."""
    import torch

    library = os.path.join(os.path.dirname(lock), f"{name}.so")
    if os.path.exists(lock) or not os.path.exists(library):
        return None
    if not python_module:
        torch.ops.load_library(library)
        return library
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _remove_stale_lock(lock: str) -> None:
    """torch's loader waits without end on a lock that a killed build left: one older
    than any build is removed, and the build runs again."""
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return
    if age > STALE_LOCK_SECONDS:
        log.warning("graphopt: removing %s, left %.0f minutes ago by a build that did not finish", lock, age / 60)
        with contextlib.suppress(OSError):
            os.remove(lock)


@functools.cache
def cpu_kernel_unavailable(stem: str, source: Path, fallback: str) -> str | None:
    """Build `source`, a library registering CPU kernels of graphopt's ops, for the
    machine's vector ISA: None once they are registered, else why not (logged once,
    saying that `fallback` runs instead)."""
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    _, error = build(stem, source, ["-O3", *_ISA_FLAGS.get(isa, [])], key=isa, python_module=False)
    if error is not None:
        log.warning("graphopt: %s, its C++ kernel could not be built: %s", fallback, error)
        return f"the {stem.removeprefix('graphopt_')} kernel could not be built ({error})"
    return None
