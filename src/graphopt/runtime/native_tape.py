"""The host graph's replay without Python per op: its tape run by a small C++ loop.

A Python replay pays the interpreter for every op, often more than the op itself
costs in a decode step; `native_tape.cpp` makes one boxed dispatcher call per op,
several times cheaper (docs/device-graphs.md, "Host graphs"). It is compiled on
first use (`kernels/native.py`): the first host graph on a machine waits for that
compile, later processes load what it built.

Where it cannot be built, host graphs replay from Python: the reason is logged once
and each capture counts it as a fallback. `GRAPHOPT_NATIVE_TAPE=0` asks for the
Python replay without trying.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Sequence

from ..kernels import native

log = logging.getLogger("graphopt")

SOURCE = Path(__file__).with_name("native_tape.cpp")
# What benchmarks and tests flip to time or check the Python replay in the same process.
ENABLED = os.environ.get("GRAPHOPT_NATIVE_TAPE", "1") != "0"


@functools.cache
def _module() -> tuple[Any, str | None]:
    """The compiled extension, or None and why not (logged once)."""
    module, error = native.build("graphopt_tape", SOURCE, ["-O2"])
    if module is None:
        log.warning("graphopt: host graphs replay from Python, the native tape could not be built: %s", error)
        return None, f"the native tape could not be built ({error})"
    return module, None


def unavailable() -> str | None:
    """Why host graphs replay from Python (None: they replay natively). Builds the
    extension on the first call."""
    if not ENABLED:
        return "GRAPHOPT_NATIVE_TAPE=0"
    return _module()[1]


def build(entries: Sequence[Any]) -> tuple[Any, int]:
    """The C++ tape for `entries` (tape.Entry, in order) and how many of them
    replay through Python. Call only when `unavailable()` is None."""
    tape, through_python = _module()[0].Tape(), 0
    for entry in entries:
        if entry.op is not None:
            name, overload = entry.op._schema.name, entry.op._schema.overload_name
            try:
                if entry.targets is None:
                    tape.call(name, overload, tuple(entry.args), dict(entry.kwargs))
                else:
                    tape.recompute(name, overload, tuple(entry.args), dict(entry.kwargs), list(entry.targets))
                continue
            except (RuntimeError, TypeError, ValueError):
                pass  # an argument C++ cannot hold as recorded: this entry replays from Python
        fn, args, kwargs = entry.python
        tape.python(functools.partial(fn, *args, **kwargs))
        through_python += 1
    return tape, through_python
