"""The user-facing entry points: `optimize()`, `@support_graph_optimization`, and
the `OptimizedModule` / `OptimizedFunction` they produce, whose calls share one
function (`_Optimized._call`: one frame from the call to the stored trace's check)."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Iterator, Mapping

import torch

from .._compat.names import tree_flatten, tree_unflatten
from ..backend import recompiles
from ..config import GraphOptimizationConfig
from ..report import Report
from .step import DynamicDims, Step
from .traces import MISS


class _Optimized:
    """The methods every optimized callable has, over its `_step`."""

    _step: Step

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
        step = Step(model, config, dynamic_dims, pad_values)
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
        self._step = Step(fn, config, dynamic_dims, pad_values)
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
