"""torch.compile's own door: the "graphopt" backend name and the Backends it makes.

    torch.compile(model, backend="graphopt", options={"graph_opt_level": 2})
    torch.compile(model, backend="graphopt", mode="max-autotune")   # config.MODES
    CompileConfig(backend="graphopt")                 # transformers: mode="reduce-overhead"

Each torch.compile call gets one Backend, shared by every graph Dynamo compiles
for it. The registry holds a Backend for as long as torch holds its call, which is
until `torch.compiler.reset()`, even after the compiled model is dropped: Dynamo
keeps the graphs it cached for a module's `forward` and gives them to the next
model of that class compiled with the same settings. Then the Backend goes and gives
back what it took (the FX graphs it keeps for `refresh()`, its graph pools, its share
of Dynamo's recompile limit). `backends()` lists the live ones.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Sequence

import torch

from .._compat import dynamo
from ..config import GraphOptimizationConfig
from .backend import Backend

# id of a torch.compile call -> its Backend; the call's finalizer drops the entry, so an id
# is never read after its call is gone.
_BY_CALL: dict[int, Backend] = {}
# A backend called outside torch.compile (Dynamo's older `optimize`, a direct call) has no
# call to live by: one Backend per options dict, for the process; holding the dict keeps
# its id unique.
_OUTSIDE: dict[int, tuple[Any, Backend]] = {}
_MADE: weakref.WeakValueDictionary[int, Backend] = weakref.WeakValueDictionary()  # in order made
_serial = itertools.count()


def graphopt_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                     options: dict[str, Any] | None = None) -> Callable:
    """`torch.compile(model, backend="graphopt", mode=..., options={...})`: options are
    GraphOptimizationConfig keys; the graphs of one torch.compile call share a Backend."""
    call = dynamo.compile_call()
    backend = _backend_of(call, options)
    if backend is None:
        backend = Backend(GraphOptimizationConfig.from_dict(options or {}), mode=mode)
        _MADE[next(_serial)] = backend
        if call is not None:
            _BY_CALL[id(call)] = backend
            weakref.finalize(call, _BY_CALL.pop, id(call), None)
        else:
            _OUTSIDE[id(options)] = (options, backend)
    return backend(gm, example_inputs, mode=mode)


def _backend_of(call: Any, options: dict[str, Any] | None) -> Backend | None:
    if call is not None:
        return _BY_CALL.get(id(call))
    entry = _OUTSIDE.get(id(options))
    return entry[1] if entry is not None and entry[0] is options else None


def backends() -> list[Backend]:
    """The live Backends `backend="graphopt"` made, oldest first: `graphopt.backends()[-1].report()`."""
    return list(_MADE.values())
