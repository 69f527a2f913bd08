"""torch.compile's own door: the "graphopt" backend name, its `options` and `mode`.

    torch.compile(model, backend="graphopt", options={"graph_opt_level": 2})
    torch.compile(model, backend="graphopt", mode="max-autotune")
    CompileConfig(backend="graphopt")                 # transformers: mode="reduce-overhead"

Each torch.compile call gets one Backend; `backends()` lists them. A mode sets its
keys where the configuration the user gave keeps graphopt's default; a key the
user set to something else wins, and the Backend's report says so. `options` and a
`Backend`'s own config are both "what the user gave".
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from . import _compat
from .config import GraphOptimizationConfig

_AUTOTUNE = {"max_autotune": True}
# torch's meanings, in graphopt's keys: device graphs are graphopt's, not Inductor's.
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "reduce-overhead": {"use_cudagraph": True},
    "max-autotune-no-cudagraphs": {"graph_opt_level": 2, "use_cudagraph": False,
                                   "inductor_compile_config": _AUTOTUNE},
    "max-autotune": {"graph_opt_level": 2, "use_cudagraph": True, "inductor_compile_config": _AUTOTUNE},
}


def with_mode(config: GraphOptimizationConfig, mode: str | None) -> tuple[GraphOptimizationConfig, list[str]]:
    """`config` with `mode`'s keys where it keeps the default, and a sentence for
    each key where the user's value wins over the mode's."""
    if mode is None:
        return config, []
    if mode not in MODES:
        raise ValueError(f"unknown torch.compile mode {mode!r} for backend 'graphopt'; known modes: "
                         f"{', '.join(repr(m) for m in MODES)}")
    defaults = GraphOptimizationConfig()
    changes: dict[str, Any] = {}
    kept: list[str] = []
    for key, wanted in MODES[mode].items():
        given, default = getattr(config, key), getattr(defaults, key)
        if key == "inductor_compile_config":
            merged = {**wanted, **given}
            kept += [f"mode={mode!r} sets inductor_compile_config[{k!r}]={v!r}, the config's {given[k]!r} is used"
                     for k, v in wanted.items() if k in given and given[k] != v]
            changes[key] = merged
        elif given == default:
            changes[key] = wanted
        elif given != wanted:
            kept.append(f"mode={mode!r} sets {key}={wanted!r}, the config's {given!r} is used")
    if not changes:
        return config, kept
    return config.replace(**changes), kept


# torch.compile call (or options dict) -> (it, its Backend); holding it keeps its id unique.
_BACKENDS: dict[int, tuple[Any, Any]] = {}


def graphopt_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                     options: dict[str, Any] | None = None) -> Callable:
    """`torch.compile(model, backend="graphopt", mode=..., options={...})`: options are
    GraphOptimizationConfig keys; the graphs of one torch.compile call share a Backend."""
    from .backend import Backend

    call = _compat.compile_call()
    owner = call if call is not None else options if options is not None else graphopt_backend
    entry = _BACKENDS.get(id(owner))
    if entry is None or entry[0] is not owner:
        backend = Backend(GraphOptimizationConfig.from_dict(options or {}), mode=mode)
        entry = _BACKENDS[id(owner)] = (owner, backend)
    return entry[1](gm, example_inputs, mode=mode)


def backends() -> list:
    """The Backends `backend="graphopt"` made, oldest first: `graphopt.backends()[-1].report()`."""
    return [backend for _, backend in _BACKENDS.values()]
