"""The step behind every optimized callable: `Step` holds the Backend and the
`torch.compile`d callable, and marks the batch dims of a call dynamic (`DynamicDims`
declares them on `forward`'s hints)."""

from __future__ import annotations

import inspect
import json
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from .._compat import dynamo
from .._compat.names import tree_leaves
from ..backend.backend import Backend
from ..config import GraphOptimizationConfig
from .guards import keep_input_guards
from .traces import StoredTraces


@dataclass(frozen=True)
class DynamicDims:
    """Marks dim `dim` of an argument as its batch (dynamic) dimension, in a
    `typing.Annotated` hint: `input_ids: Annotated[torch.Tensor, DynamicDims(0)]`."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"DynamicDims takes an int dimension, got {self.dim!r}")


class Step:
    """What optimize() builds for any callable: dynamic-dim marking in front of
    `torch.compile(fn, backend=Backend(config))`. Level 0 without device graphs
    is the callable itself."""

    def __init__(self, fn: Callable, config: GraphOptimizationConfig | None,
                 dynamic_dims: Mapping[str, int | DynamicDims | None] | None,
                 pad_values: Mapping[str, float | int] | None):
        config = config if config is not None else GraphOptimizationConfig()
        if not isinstance(config, GraphOptimizationConfig):
            raise TypeError(f"config must be a GraphOptimizationConfig, got {type(config).__name__}; "
                            "build one with GraphOptimizationConfig(...) or .from_json(text)")
        if not callable(fn):
            raise TypeError(f"optimize() takes an nn.Module or a function, got {type(fn).__name__}")
        forward = fn.forward if isinstance(fn, torch.nn.Module) else fn
        self.params = list(inspect.signature(forward).parameters)
        self.dynamic_dims = _resolve_dynamic_dims(forward, self.params, dynamic_dims)
        self.pad_values = _check_names("pad_values", dict(pad_values or {}), self.params)
        self.config = config
        self.backend = Backend(config, dynamic_dims=self.dynamic_dims, pad_values=self.pad_values)
        self.compiles = config.graph_opt_level != 0 or config.use_cudagraph
        guard_filter = keep_input_guards(self.params) if config.guards == "inputs" else None
        self.backend.guards_filtered = guard_filter is not None
        options = {"guard_filter_fn": guard_filter} if guard_filter is not None else None
        self.fn = torch.compile(fn, backend=self.backend, options=options) if self.compiles else fn
        self.traces = None
        # on_recompile "warn" / "error" need Dynamo's guards to say what failed, and torch cannot
        # store a trace whose guards were filtered where it guards a module's key order: no
        # stored traces then.
        # With "auto", a trace is stored once its graph's level was chosen in an earlier
        # process (the first one's runtime is chosen at its first call, after the trace).
        cached = self.backend.cache.bypass(self.backend.cache.fingerprint()) is None
        if config.graph_opt_level != 0 and config.cache_traces and cached \
                and config.on_recompile == "recompile" and guard_filter is None:
            identity = json.dumps([config.to_json(), self.dynamic_dims, self.pad_values], sort_keys=True)
            self.traces = StoredTraces(fn, self.backend, identity, self.mark_dynamic)
        self.last_call: tuple[tuple, dict] | None = None

    def mark_dynamic(self, args: tuple, kwargs: dict) -> None:
        for leaf, dim in zip(tree_leaves((args, kwargs)), self.leaf_dims(args, kwargs)):
            if dim is not None:
                dynamo.mark_dynamic(leaf, dim)

    def leaf_dims(self, args: tuple, kwargs: dict) -> list[int | None]:
        """The dynamic dim of every leaf of tree_flatten((args, kwargs)): dim 0 of
        every tensor by default, else the declared dim of each declared argument."""
        dims: list[int | None] = []
        for name, value in self._named(args, kwargs):
            for leaf in (value,) if isinstance(value, torch.Tensor) else tree_leaves(value):
                if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
                    dims.append(None)
                elif self.dynamic_dims is None:
                    dims.append(0)
                else:
                    dim = self.dynamic_dims.get(name) if leaf is value else None
                    if dim is not None and not -leaf.dim() <= dim < leaf.dim():
                        raise ValueError(f"dynamic dim {dim} of argument {name!r} is out of range for its "
                                         f"shape {tuple(leaf.shape)}; fix dynamic_dims={{{name!r}: ...}}")
                    dims.append(None if dim is None else dim % leaf.dim())
        return dims

    def _named(self, args: tuple, kwargs: dict) -> list[tuple[str | None, Any]]:
        return [(self.params[i] if i < len(self.params) else None, a) for i, a in enumerate(args)] + \
               list(kwargs.items())


def _resolve_dynamic_dims(forward: Callable, params: list[str],
                          explicit: Mapping[str, int | DynamicDims | None] | None) -> dict[str, int] | None:
    """{argument name: dynamic dim}, or None for the default (dim 0 of every tensor)."""
    declared: dict[str, int | None] = {}
    try:
        hints = typing.get_type_hints(forward, include_extras=True)
    except Exception:  # noqa: BLE001 - unresolvable string annotations carry no DynamicDims
        hints = {}
    for name, hint in hints.items():
        for meta in getattr(hint, "__metadata__", ()):
            if isinstance(meta, DynamicDims):
                declared[name] = meta.dim
    for name, dim in _check_names("dynamic_dims", dict(explicit or {}), params).items():
        if isinstance(dim, DynamicDims):
            dim = dim.dim
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
            raise TypeError(f"dynamic_dims[{name!r}] must be an int, DynamicDims(k) or None, got {dim!r}")
        declared[name] = dim
    if not declared:
        return None
    return {name: dim for name, dim in declared.items() if dim is not None}


def _check_names(what: str, given: dict[str, Any], params: list[str]) -> dict[str, Any]:
    unknown = [name for name in given if name not in params]
    if unknown:
        raise ValueError(f"{what} names {unknown}, which forward() does not take; "
                         f"its arguments are {params}")
    return given
