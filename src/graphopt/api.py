"""The user-facing entry points: `optimize()`, `@support_graph_optimization`,
`DynamicDims`, and the `OptimizedModule` they produce."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import sys
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils._pytree import tree_leaves

from . import _compat
from .backend import GraphoptCompiler
from .config import GraphOptimizationConfig
from .report import Report


@dataclass(frozen=True)
class DynamicDims:
    """Marks dim `dim` of an argument as its batch (dynamic) dimension, in a
    `typing.Annotated` hint: `input_ids: Annotated[torch.Tensor, DynamicDims(0)]`."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"DynamicDims takes an int dimension, got {self.dim!r}")


class OptimizedModule(torch.nn.Module):
    """Behaves like the model it wraps; calls run the level's optimized step.

    Level 0 calls the model itself. Levels 1 and 2 call it through torch.compile
    with graphopt's backend, marking each argument's dynamic dim first so one
    graph serves every batch size.
    """

    def __init__(self, model: Callable, config: GraphOptimizationConfig | None = None,
                 dynamic_dims: Mapping[str, int | DynamicDims | None] | None = None,
                 pad_values: Mapping[str, float | int] | None = None):
        super().__init__()
        config = config if config is not None else GraphOptimizationConfig()
        if not isinstance(config, GraphOptimizationConfig):
            raise TypeError(f"config must be a GraphOptimizationConfig, got {type(config).__name__}; "
                            "build one with GraphOptimizationConfig(...) or .from_json(text)")
        if not callable(model):
            raise TypeError(f"optimize() takes an nn.Module or a function, got {type(model).__name__}")
        forward = model.forward if isinstance(model, torch.nn.Module) else model
        self._params = list(inspect.signature(forward).parameters)
        self.dynamic_dims = _resolve_dynamic_dims(forward, self._params, dynamic_dims)
        self.pad_values = _check_names("pad_values", dict(pad_values or {}), self._params)
        self.model = model
        self.config = config
        self._compiler = GraphoptCompiler(config)
        report = self._compiler.report
        if config.graph_opt_level == 2 and _on_cpu(model) and not _compat.inductor_available():
            report.fallback("graph_opt_level=2: Inductor found no C++ compiler for CPU code; "
                            "running level 1 (install gcc or clang to compile)")
            self._compiler = GraphoptCompiler(config.replace(graph_opt_level=1), report)
        level = self._compiler.config.graph_opt_level
        # Inductor's generated CPU kernels bypass the ATen dispatcher, so no host graph
        # can record them: level 2 on CPU pads to capture sizes instead, one
        # static-shape kernel per size.
        padded_only = config.use_cudagraph and level == 2 and _on_cpu(model)
        if level == 0:
            step = model
        elif padded_only:
            _compat.allow_recompiles(len(config.cudagraph_capture_sizes))
            step = torch.compile(model, backend=self._compiler, dynamic=False)
        else:
            _compat.allow_recompiles(2)  # batch size 1, then one graph for every other size
            step = torch.compile(model, backend=self._compiler)
        # A plain attribute, not a submodule: torch.compile's wrapper holds `model`
        # again, and state_dict() would list every weight twice.
        object.__setattr__(self, "_step", step)
        self._marks_dynamic = level > 0 and not padded_only
        self._runner = None
        if config.use_cudagraph:
            if padded_only:
                report.fallback("use_cudagraph with graph_opt_level=2 on CPU: Inductor's C++ kernels "
                                "cannot be recorded on a host graph; inputs are padded to capture sizes "
                                "so each size runs a static-shape kernel")
            from .runtime.runner import GraphRunner  # the runtime loads only when device graphs are on

            owner = getattr(model, "__self__", model)
            self._runner = GraphRunner(
                self._call_step, config, report, self._leaf_dims, self._leaf_pads,
                owner if isinstance(owner, torch.nn.Module) else None, trace=model,
                declared_dims=self.dynamic_dims is not None, device_graphs=not padded_only)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._runner is not None:
            return self._runner(args, kwargs)
        return self._call_step(*args, **kwargs)

    def _call_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._marks_dynamic and not self._compiler.compiled_dynamic:
            self._mark_dynamic(args, kwargs)
        return self._step(*args, **kwargs)

    def capture_all(self, *args: Any, **kwargs: Any) -> None:
        """Capture a device graph for every capture size now (largest first), from
        these example inputs or, without any, the last call's."""
        if self._runner is None:
            raise RuntimeError("capture_all() needs use_cudagraph=True in the config")
        if not args and not kwargs:
            if self._runner.last_call is None:
                raise ValueError("capture_all() needs example inputs: pass them, or call the module once first")
            args, kwargs = self._runner.last_call
        with _capture_progress(len(self._runner.sizes)) as advance:
            self._runner.capture_all(args, kwargs, advance)

    def _leaf_dims(self, args: tuple, kwargs: dict) -> list[int | None]:
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

    def _leaf_pads(self, args: tuple, kwargs: dict) -> list[float | int]:
        return [self.pad_values.get(name, 0) for name, value in self._named(args, kwargs)
                for _ in tree_leaves(value)]

    def _named(self, args: tuple, kwargs: dict) -> list[tuple[str | None, Any]]:
        return [(self._params[i] if i < len(self._params) else None, a) for i, a in enumerate(args)] + \
               list(kwargs.items())

    def _mark_dynamic(self, args: tuple, kwargs: dict) -> None:
        leaves = tree_leaves((args, kwargs))
        for leaf, dim in zip(leaves, self._leaf_dims(args, kwargs)):
            if dim is not None:
                _compat.mark_dynamic(leaf, dim)

    def report(self) -> Report:
        """What ran: graphs, passes and their stats, compile times, fallbacks."""
        return self._compiler.report

    def refresh(self) -> int:
        """After an in-place weight update with freeze_parameters=True: recompute
        every value constant folding computed from the weights. Returns how many."""
        from .passes.constant_fold import refresh_folded_constants

        return sum(refresh_folded_constants(gm) for gm in self._compiler.graph_modules)

    def graphs(self) -> list[torch.fx.GraphModule]:
        """The final ATen FX graphs, in compile order (none at level 0)."""
        return list(self._compiler.graph_modules)


def optimize(model: Callable, config: GraphOptimizationConfig | None = None,
             dynamic_dims: Mapping[str, int | DynamicDims | None] | None = None,
             pad_values: Mapping[str, float | int] | None = None) -> OptimizedModule:
    """Wrap `model` (an nn.Module or a function) so each call runs its optimized step.

    `dynamic_dims` maps argument names to their batch dimension (None: static).
    Without it, and without `DynamicDims` hints on `forward`, dim 0 of every tensor
    argument is dynamic. `pad_values` gives the value padded rows get when a batch
    is padded up to a capture size (default 0).
    """
    return OptimizedModule(model, config, dynamic_dims, pad_values)


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
            step = OptimizedModule(self.forward, graph_opt_config)
            # object.__setattr__: registering the wrapper as a submodule would make the
            # module contain itself (state_dict, .to() and repr would recurse).
            object.__setattr__(self, "graph_opt_module", step)
            object.__setattr__(self, "forward", step)

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


def _check_names(what: str, given: dict[str, Any], params: list[str]) -> dict[str, Any]:
    unknown = [name for name in given if name not in params]
    if unknown:
        raise ValueError(f"{what} names {unknown}, which forward() does not take; "
                         f"its arguments are {params}")
    return given


def _on_cpu(model: Callable) -> bool:
    owner = getattr(model, "__self__", model)  # a decorated module passes its bound forward
    if isinstance(owner, torch.nn.Module):
        for tensor in itertools.chain(owner.parameters(), owner.buffers()):
            return tensor.device.type == "cpu"
    return True
