"""graphopt's C++ sources built on first use with torch's C++ extension loader (a C++
compiler and `ninja`, both already needed by Inductor's CPU code), into torch's
extensions directory (`$TORCH_EXTENSIONS_DIR`, else `~/.cache/torch_extensions`),
once per source, torch version and `key`: the first build on a machine takes about
a minute, later processes load it in milliseconds."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Sequence

from ..report import first_line


def build(stem: str, source: Path, extra_cflags: Sequence[str], key: str = "",
          python_module: bool = True) -> tuple[Any, str | None]:
    """(the loaded extension, None), or (None, why it could not be built). `key` names
    what else the build depends on (the vector ISA its flags ask for); a library that
    is no Python module registers its ops with the dispatcher as it loads."""
    import torch
    from torch.utils import cpp_extension

    digest = hashlib.sha256(source.read_bytes() + torch.__version__.encode() + key.encode()).hexdigest()[:12]
    try:
        module = cpp_extension.load(f"{stem}_{digest}", [str(source)], extra_cflags=list(extra_cflags),
                                    is_python_module=python_module)
        return module, None
    except Exception as error:  # noqa: BLE001 - no compiler, no ninja, a header torch moved: the caller falls back
        return None, first_line(error) or type(error).__name__
