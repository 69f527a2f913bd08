"""The user-facing entry points: `optimize()`, `@support_graph_optimization`,
`DynamicDims`, and the `OptimizedModule` they produce."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import sys
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from . import _compat, recompiles
from ._compat.names import tree_flatten, tree_leaves, tree_unflatten
from .backend import Backend
from .config import GraphOptimizationConfig
from .guards import keep_input_guards
from .report import Report
from .traces import MISS, StoredTraces


@dataclass(frozen=True)
class DynamicDims:
    """Marks dim `dim` of an argument as its batch (dynamic) dimension, in a
    `typing.Annotated` hint: `input_ids: Annotated[torch.Tensor, DynamicDims(0)]`."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"DynamicDims takes an int dimension, got {self.dim!r}")


class _Step:
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
        # With "auto", a graph's runtime is chosen at its first call, after a trace is stored.
        cached = self.backend.cache.bypass(self.backend.cache.fingerprint()) is None
        if config.graph_opt_level in (1, 2) and config.cache_traces and cached \
                and config.on_recompile == "recompile" and guard_filter is None:
            identity = json.dumps([config.to_json(), self.dynamic_dims, self.pad_values], sort_keys=True)
            self.traces = StoredTraces(fn, self.backend, identity, self.mark_dynamic)
        self.last_call: tuple[tuple, dict] | None = None

    def mark_dynamic(self, args: tuple, kwargs: dict) -> None:
        for leaf, dim in zip(tree_leaves((args, kwargs)), self.leaf_dims(args, kwargs)):
            if dim is not None:
                _compat.mark_dynamic(leaf, dim)

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


class _Optimized:
    """The methods every optimized callable has, over its `_step`."""

    _step: _Step

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        """A call of the step: a stored trace that fits it, else torch.compile's dispatch
        with the batch dims marked dynamic. `OptimizedModule.forward` and
        `OptimizedFunction.__call__` are this function: one frame to the trace check."""
        step = self._step
        if step.config.use_cudagraph:
            step.last_call = (args, kwargs)
        if step.traces is not None:
            result = step.traces(args, kwargs)
            if result is not MISS:
                return result
        if step.compiles and (step.traces is not None or not step.backend.compiled_dynamic):
            # Marked on every call where a step could have stored traces: Dynamo then
            # makes the graphs a trace would (a dynamic batch in every graph), so the
            # compile cache serves both ways of running the step.
            step.mark_dynamic(args, kwargs)
        try:
            return step.fn(*args, **kwargs)
        except Exception as error:
            refused = recompiles.raised(error)  # Dynamo wraps what a backend raises: give the user ours
            if refused is None:
                raise
            raise refused from None

    def capture_all(self, *args: Any, **kwargs: Any) -> None:
        """Capture a device graph for every capture size now (largest first), from
        these example inputs or, without any, the last call's."""
        step = self._step
        if not step.config.use_cudagraph:
            raise RuntimeError("capture_all() needs use_cudagraph=True in the config")
        if not args and not kwargs:
            if step.last_call is None:
                raise ValueError("capture_all() needs example inputs: pass them, or call the model once first")
            args, kwargs = step.last_call
        leaves, spec = tree_flatten((args, kwargs))
        dims = step.leaf_dims(args, kwargs)
        sizes = step.config.cudagraph_capture_sizes
        if step.config.auto_capture_sizes:  # the sizes planned from the traffic the compile cache kept
            with step.backend.capture_calls():
                self._call(*args, **kwargs)
            sizes = step.backend.report().capture_sizes
        sizes = sorted(sizes, reverse=True)
        with _capture_progress(len(sizes)) as advance, step.backend.capture_calls():
            for size in sizes:
                advance(size)
                sized = [_resized(leaf, dim, size) if dim is not None else leaf for leaf, dim in zip(leaves, dims)]
                s_args, s_kwargs = tree_unflatten(sized, spec)
                for _ in range(max(step.config.cudagraph_num_of_warmups, 1) + 1):
                    self._call(*s_args, **s_kwargs)

    def report(self) -> Report:
        """What ran: graphs, passes and their stats, compile times, device graphs, fallbacks."""
        return self._step.backend.report()

    def refresh(self) -> int:
        """With freeze_parameters=True: recompute every value constant folding computed
        from the weights, and compile again each level-2 graph whose code holds Inductor's
        own copies of them (packed GEMM weights: seconds per graph, `report().repacks`).
        A call does this itself when it notices a changed weight (frozen_watch.py); call
        it after a change it cannot notice, a write through `.data`. Returns how many
        folded values were recomputed."""
        return self._step.backend.refresh()

    def graphs(self) -> list[torch.fx.GraphModule]:
        """The final ATen FX graphs, in compile order (none at level 0)."""
        return list(self._step.backend.graph_modules)

    @property
    def config(self) -> GraphOptimizationConfig:
        return self._step.config

    @property
    def dynamic_dims(self) -> dict[str, int] | None:
        """{argument: dynamic dim}, or None for the default (dim 0 of every tensor argument)."""
        return self._step.dynamic_dims


class OptimizedModule(_Optimized, torch.nn.Module):
    """Behaves like the module it wraps; calls run the level's optimized step."""

    def __init__(self, model: torch.nn.Module, config: GraphOptimizationConfig | None = None,
                 dynamic_dims: Mapping[str, int | DynamicDims | None] | None = None,
                 pad_values: Mapping[str, float | int] | None = None):
        super().__init__()
        _watch_module_assignments()
        step = _Step(model, config, dynamic_dims, pad_values)
        self.model = model
        # A plain attribute, not a submodule: torch.compile's wrapper holds `model`
        # again, and state_dict() would list every weight twice.
        object.__setattr__(self, "_step", step)

    forward = _Optimized._call


class OptimizedFunction(_Optimized):
    """A function or bound method, optimized. Not an nn.Module, so that
    `model.forward = graphopt.optimize(model.forward, cfg)` replaces `forward`
    (an nn.Module assigned there would become a submodule and be ignored)."""

    def __init__(self, fn: Callable, config: GraphOptimizationConfig | None = None,
                 dynamic_dims: Mapping[str, int | DynamicDims | None] | None = None,
                 pad_values: Mapping[str, float | int] | None = None):
        self._step = _Step(fn, config, dynamic_dims, pad_values)
        functools.update_wrapper(self, fn)

    __call__ = _Optimized._call

    def __reduce__(self) -> tuple:
        # Pickled with the module whose forward it replaces (Dynamo's stored guards
        # copy that module): compiled state does not travel, a clear error does.
        return _unpickled_step, (getattr(self, "__qualname__", "a function"),)


def _unpickled_step(name: str) -> Callable:
    def step(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"this is a pickled copy of graphopt.optimize({name}); optimized steps do not "
                           "survive pickling: call graphopt.optimize() on the loaded model again")

    return step


def optimize(model: Callable, config: GraphOptimizationConfig | None = None,
             dynamic_dims: Mapping[str, int | DynamicDims | None] | None = None,
             pad_values: Mapping[str, float | int] | None = None) -> OptimizedModule | OptimizedFunction:
    """Wrap `model` so each call runs its optimized step: an nn.Module gives an
    `OptimizedModule`, a function or bound method an `OptimizedFunction` (which can
    replace `model.forward`, the transformers / gpt-fast idiom).

    `dynamic_dims` maps argument names to their batch dimension (None: static).
    Without it, and without `DynamicDims` hints on `forward`, dim 0 of every tensor
    argument is dynamic. `pad_values` gives the value padded rows get when a batch
    is padded up to a capture size (default 0).
    """
    if isinstance(model, torch.nn.Module):
        return OptimizedModule(model, config, dynamic_dims, pad_values)
    return OptimizedFunction(model, config, dynamic_dims, pad_values)


def support_graph_optimization(cls: type) -> type:
    """Class decorator: instances take `graph_opt_config=`; with one, their forward
    runs optimized; without one, the class behaves exactly as undecorated."""
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise TypeError(f"@support_graph_optimization decorates an nn.Module subclass, got {cls!r}")
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self: torch.nn.Module, *args: Any,
                 graph_opt_config: GraphOptimizationConfig | None = None, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if graph_opt_config is not None:
            step = OptimizedFunction(self.forward, graph_opt_config)
            self.graph_opt_module = step
            self.forward = step

    cls.__init__ = __init__
    return cls


@contextlib.contextmanager
def _capture_progress(total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on a terminal; silence elsewhere."""
    if not sys.stderr.isatty():
        yield lambda size: None
        return
    from rich.progress import Progress

    with Progress(transient=True) as progress:
        task = progress.add_task("capturing device graphs", total=total)
        yield lambda size: progress.update(task, advance=1, description=f"capturing size {size}")


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


def _resized(leaf: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`leaf` with `size` rows along `dim`: its first rows, repeated when it has fewer."""
    index = torch.arange(size, device=leaf.device) % leaf.shape[dim]
    return leaf.index_select(dim, index)


def _refuse_ignored_assignment(module: torch.nn.Module, name: str, submodule: Any) -> None:
    """nn.Module keeps a module assigned to `m.forward` as a submodule, and the
    class's `forward` keeps running: say so instead of ignoring it."""
    if isinstance(submodule, OptimizedModule) and callable(getattr(type(module), name, None)):
        raise TypeError(f"assigning an OptimizedModule to {type(module).__name__}.{name} would be ignored: "
                        f"nn.Module keeps it as a submodule and {name}() still runs the class's method. "
                        f"Optimize the method instead: m.{name} = graphopt.optimize(m.{name}, config)")


@functools.cache
def _watch_module_assignments() -> None:
    """From the first OptimizedModule on (not at import), every module assignment in the
    process passes `_refuse_ignored_assignment`: torch has no per-module hook for it."""
    torch.nn.modules.module.register_module_module_registration_hook(_refuse_ignored_assignment)


def _check_names(what: str, given: dict[str, Any], params: list[str]) -> dict[str, Any]:
    unknown = [name for name in given if name not in params]
    if unknown:
        raise ValueError(f"{what} names {unknown}, which forward() does not take; "
                         f"its arguments are {params}")
    return given
