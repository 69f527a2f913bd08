"""GraphRunner: one model's device graphs, one per capture size, replayed safely.

A call picks the smallest capture size >= its batch, copies the inputs into that
graph's static buffers (padding the dynamic dim), replays, and returns the outputs
sliced back to the real batch. Everything that could make a replay wrong is
checked on every call: moved parameters, buffers or mutated inputs cause a
recapture; a batch above the largest capture size, or a capture that was refused,
runs the level's callable directly, with the reason logged once and counted.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import _compat
from ..config import GraphOptimizationConfig
from ..report import CaptureRecord, Report
from .device_graph import DeviceGraph, graph_pool_handle
from .safety import CaptureGuard


@dataclass
class _Input:
    """One tensor leaf of the call: where it sits, its batch dim, its pad value."""

    index: int                  # position among the call's flattened leaves
    dim: int | None             # dynamic (batch) dim, or None
    pad: float | int
    static: torch.Tensor | None = None
    written: bool = False       # the step writes it in place (a mutated input)


@dataclass
class _Graph:
    """Everything kept for one capture size and input signature."""

    size: int
    inputs: list[_Input]
    static_leaves: list[Any]
    in_spec: Any
    out_dims: list[int | None]
    warmups_left: int
    graph: DeviceGraph | None = None  # set once captured
    out_leaves: list[Any] = field(default_factory=list)
    out_spec: Any = None
    state: tuple[int, ...] = ()
    observed: bool = False            # writes and capture safety learned from a first run
    handed_out: list[weakref.ref] = field(default_factory=list)


class GraphRunner:
    def __init__(self, step: Callable, config: GraphOptimizationConfig, report: Report,
                 input_dims: Callable[[tuple, dict], list[int | None]],
                 pad_values: Callable[[tuple, dict], list[float | int]],
                 module: torch.nn.Module | None, trace: Callable, declared_dims: bool,
                 device_graphs: bool = True):
        """`input_dims` and `pad_values` give, for a call, each flattened input leaf's
        dynamic dim and pad value. `trace` is the unoptimized callable, traced on fake
        tensors to find which output dims follow the batch. With `declared_dims`
        False (the default dim 0 of every tensor), inputs whose dim 0 differs from
        the first one's (a KV cache passed as an argument) are treated as static."""
        self.step = step
        self.config = config
        self.report = report
        self.input_dims = input_dims
        self.pad_values = pad_values
        self.trace = trace
        self.declared_dims = declared_dims
        self.device_graphs = device_graphs
        self._state_slots = _state_slots(module) if module is not None else []
        self._state_tensors: list[torch.Tensor] = []
        self._state_epoch = -1
        self.sizes = list(config.cudagraph_capture_sizes)
        self.report.capture_sizes = self.sizes
        # At least one warm-up call: it compiles the step and shows which inputs it writes.
        self.warmups = max(config.cudagraph_num_of_warmups, 1)
        self.graphs: dict[Any, _Graph | None] = {}   # None: capture refused
        self.pool = config.graph_pool
        # Graphs of one pool share memory: they must never replay at once, across runners too.
        self.lock = _pool_lock(config.graph_pool)
        self.callers: set[int] = set()
        self.last_call: tuple[tuple, dict] | None = None
        self._warned_held_outputs = False

    # ---- the hot path -------------------------------------------------------
    def __call__(self, args: tuple, kwargs: dict) -> Any:
        leaves, spec = _flatten(args, kwargs)
        dims = self.input_dims(args, kwargs)
        batch = _batch_size(leaves, dims, strict=self.declared_dims)
        size = next((s for s in self.sizes if s >= batch), None) if batch is not None else None
        if size is None:
            reason = (f"batch size {batch} is above the largest capture size {self.sizes[-1]}"
                      if batch is not None else "no input has a dynamic dim, so there is no batch size")
            self.report.fallback(f"use_cudagraph: {reason}; running without a device graph")
            return self.step(*args, **kwargs)
        key = (size, spec, _signature(leaves, dims))
        with self.lock:
            self.callers.add(threading.get_ident())
            self.last_call = (args, kwargs)
            if key not in self.graphs:
                self.graphs[key] = self._prepare(size, args, kwargs, leaves, dims)
            entry = self.graphs[key]
            if entry is None:
                return self.step(*args, **kwargs)
            if entry.graph is not None and self._moved(entry, leaves):
                entry.graph.reset()
                entry.graph = None
                self.report.recaptures += 1
            if entry.graph is None:
                _rebind_written(entry, leaves)
            self._copy_in(entry, leaves, batch)
            outputs = self._run(entry)
            if outputs is None:  # refused during its first run
                self.graphs[key] = None
                return self.step(*args, **kwargs)
            for spec_ in entry.inputs:  # a mutated input with a batch dim: its real rows go back
                if spec_.written and spec_.dim is not None:
                    leaves[spec_.index].copy_(spec_.static.narrow(spec_.dim, 0, batch))
            return self._hand_out(entry, outputs, batch)

    def _run(self, entry: _Graph) -> list[Any] | None:
        """This call's outputs at the capture size: a replay once captured, else a
        warm-up run of the step on the static inputs or the capture itself."""
        if entry.graph is not None:
            if entry.handed_out and not self.config.clone_output and any(r() is not None for r in entry.handed_out):
                self._warn_held_outputs()
            entry.graph.replay()
            self.report.replays += 1
            return entry.out_leaves
        s_args, s_kwargs = tree_unflatten(entry.static_leaves, entry.in_spec)
        if not entry.observed:
            return self._first_run(entry, s_args, s_kwargs)
        if entry.warmups_left > 0 or not self.device_graphs:
            entry.warmups_left -= 1
            with _side_stream(entry.static_leaves):
                outputs, entry.out_spec = tree_flatten(self.step(*s_args, **s_kwargs))
            return outputs
        return self._capture(entry, s_args, s_kwargs)

    def _first_run(self, entry: _Graph, s_args: tuple, s_kwargs: dict) -> list[Any] | None:
        """The first warm-up: learns which inputs the step writes, and refuses the
        capture (before it starts) if the step does something a graph cannot replay."""
        guard = CaptureGuard(collect=True)
        with _side_stream(entry.static_leaves), WriteObserver([i.static for i in entry.inputs]) as observer, guard:
            outputs, entry.out_spec = tree_flatten(self.step(*s_args, **s_kwargs))
        entry.observed = True
        entry.warmups_left = self.warmups - 1
        if guard.problems and self.device_graphs:
            first = guard.problems[0]
            self.report.fallback(f"use_cudagraph: capture of size {entry.size} refused: {first.op} at "
                                 f"{first.location}: {first.message}")
            return None
        for spec, written in zip(entry.inputs, observer.written):
            spec.written = written
            if not written and spec.dim is None and self.config.clone_input:
                spec.static = spec.static.clone()
                entry.static_leaves[spec.index] = spec.static
        return outputs

    def _capture(self, entry: _Graph, s_args: tuple, s_kwargs: dict) -> list[Any]:
        start = time.perf_counter()
        device = _device(entry.static_leaves)
        graph = DeviceGraph(device, self.config.capture_error_mode, self._graph_pool(device))
        graph.capture_begin()
        try:
            entry.out_leaves, entry.out_spec = tree_flatten(self.step(*s_args, **s_kwargs))
        except BaseException:
            graph.abort()
            raise
        graph.capture_end([t for t in entry.out_leaves if isinstance(t, torch.Tensor)])
        if not graph.executes_during_capture:
            graph.replay()  # a CUDA capture records without running
        entry.graph, entry.state = graph, self._state()
        self.report.captures.append(CaptureRecord(entry.size, graph.nbytes, time.perf_counter() - start))
        self.report.pool_bytes = self._pool_bytes()
        return entry.out_leaves

    def _hand_out(self, entry: _Graph, outputs: list[Any], batch: int) -> Any:
        clone = self.config.clone_output or len(self.callers) > 1 or entry.graph is None
        result = [_rows(out, dim, batch, clone) for out, dim in zip(outputs, entry.out_dims)]
        if not clone:
            entry.handed_out = [weakref.ref(t) for t in result if isinstance(t, torch.Tensor)]
        return tree_unflatten(result, entry.out_spec)

    def _copy_in(self, entry: _Graph, leaves: list[Any], batch: int) -> None:
        for spec in entry.inputs:
            value = leaves[spec.index]
            if spec.dim is not None:
                _copy_padded(spec.static, value, spec.dim, batch, spec.pad)
            elif not spec.written and spec.static.data_ptr() != value.data_ptr():
                spec.static.copy_(value)

    def _moved(self, entry: _Graph, leaves: list[Any]) -> bool:
        """Parameters, buffers or mutated inputs no longer where the graph reads them."""
        if entry.state != self._state():
            return True
        return any(spec.written and spec.dim is None and leaves[spec.index].data_ptr() != spec.static.data_ptr()
                   for spec in entry.inputs)

    def _state(self) -> tuple[int, ...]:
        """Addresses of the module's parameters and buffers. The tensors are fetched
        again from their owning dicts only after some module registered a new
        Parameter or buffer (a reassignment), which torch's registration hooks count."""
        if self._state_epoch != _registrations[0]:
            self._state_epoch = _registrations[0]
            self._state_tensors = [d[name] for d, name in self._state_slots if d.get(name) is not None]
        return tuple([t.data_ptr() for t in self._state_tensors])

    # ---- preparing a capture size ------------------------------------------
    def capture_all(self, args: tuple, kwargs: dict, progress: Callable[[int], None] = lambda size: None) -> None:
        """Warm up and capture every capture size now, largest first, from one example call."""
        leaves, spec = tree_flatten((args, kwargs))
        dims = self.input_dims(args, kwargs)
        _batch_size(leaves, dims, strict=self.declared_dims)
        for size in sorted(self.sizes, reverse=True):
            progress(size)
            sized = [_resized(leaf, dim, size) if dim is not None else leaf for leaf, dim in zip(leaves, dims)]
            s_args, s_kwargs = tree_unflatten(sized, spec)
            for _ in range(self.warmups + 1):
                self(s_args, s_kwargs)

    def _prepare(self, size: int, args: tuple, kwargs: dict, leaves: list[Any],
                 dims: list[int | None]) -> _Graph | None:
        """Static input buffers for `size`, and which output dims follow the batch."""
        pads = self.pad_values(args, kwargs)
        inputs = [_Input(i, dims[i], pads[i]) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        static = list(leaves)
        for spec in inputs:
            leaf = leaves[spec.index]
            spec.static = _padded(leaf, spec.dim, size, spec.pad) if spec.dim is not None else leaf
            static[spec.index] = spec.static
        in_spec = tree_flatten((args, kwargs))[1]
        try:
            out_dims = _compat.output_batch_dims(self.trace, static, in_spec, dims)
        except Exception as error:  # noqa: BLE001 - any failure to trace means "cannot slice"
            self.report.fallback(f"use_cudagraph: capture of size {size} refused: the outputs' batch dims "
                                 f"could not be found ({error})")
            return None
        return _Graph(size, inputs, static, in_spec, out_dims, warmups_left=self.warmups)

    def _graph_pool(self, device: torch.device) -> Any:
        if self.config.graph_pool is None and not self.config.reuse_pool_in_same_graph:
            return None  # each graph its own pool
        if self.pool is None:
            self.pool = graph_pool_handle(device)
        return self.pool

    def _pool_bytes(self) -> int:
        if isinstance(getattr(self.pool, "nbytes", None), int):
            return self.pool.nbytes
        sizes = [g.graph.nbytes for g in self.graphs.values() if g is not None and g.graph is not None]
        shared = self.config.graph_pool is not None or self.config.reuse_pool_in_same_graph
        return max(sizes, default=0) if shared else sum(sizes)

    def _warn_held_outputs(self) -> None:
        if not self._warned_held_outputs:
            self._warned_held_outputs = True
            warnings.warn("an output of the previous replay is still referenced and has just been "
                          "overwritten by this replay, as with any device graph; pass "
                          "clone_output=True to get fresh tensors from every call", stacklevel=5)


@contextlib.contextmanager
def _side_stream(leaves: list[Any]) -> Iterator[None]:
    """CUDA warm-ups run on a side stream, as capture does, so the caching
    allocator's state is the one the capture will see."""
    device = _device(leaves)
    if device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream(device).wait_stream(stream)


_pool_locks: dict[int, threading.RLock] = {}
_pool_locks_guard = threading.Lock()


def _pool_lock(pool: Any) -> threading.RLock:
    """One lock per user pool (shared by every runner given it); a private one otherwise."""
    if pool is None:
        return threading.RLock()
    with _pool_locks_guard:
        return _pool_locks.setdefault(id(pool), threading.RLock())


def _rebind_written(entry: _Graph, leaves: list[Any]) -> None:
    """Until captured, a mutated input is simply the caller's tensor of this call."""
    for spec in entry.inputs:
        if spec.written and spec.dim is None:
            spec.static = entry.static_leaves[spec.index] = leaves[spec.index]


def _device(leaves: list[Any]) -> torch.device:
    return next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)), torch.device("cpu"))


def _batch_size(leaves: list[Any], dims: list[int | None], strict: bool) -> int | None:
    """The call's batch size. Declared dynamic dims must agree; with the default
    dims, an input whose dim 0 differs from the first one's becomes static (in place)."""
    batch = None
    for i, (leaf, dim) in enumerate(zip(leaves, dims)):
        if dim is None:
            continue
        if batch is not None and leaf.shape[dim] != batch:
            if not strict:
                dims[i] = None
                continue
            raise ValueError(f"inputs disagree on the batch size: {batch} and {leaf.shape[dim]} rows along "
                             "their dynamic dims; fix the inputs or declare dynamic_dims")
        batch = leaf.shape[dim]
    return batch


def _signature(leaves: list[Any], dims: list[int | None]) -> tuple:
    """What else a graph is specialised to: every input's dtype, device and
    non-batch sizes, and the value of every non-tensor input."""
    out = []
    for leaf, dim in zip(leaves, dims):
        if isinstance(leaf, torch.Tensor):
            shape = tuple(-1 if d == dim else s for d, s in enumerate(leaf.shape))
            out.append((leaf.dtype, leaf.device, shape))
        else:
            out.append(leaf if _hashable(leaf) else repr(leaf))
    return tuple(out)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _padded(leaf: torch.Tensor, dim: int, size: int, pad: float | int) -> torch.Tensor:
    shape = list(leaf.shape)
    shape[dim] = size
    static = torch.empty(shape, dtype=leaf.dtype, device=leaf.device)
    _copy_padded(static, leaf, dim, leaf.shape[dim], pad)
    return static


def _copy_padded(static: torch.Tensor, value: torch.Tensor, dim: int, batch: int, pad: float | int) -> None:
    size = static.shape[dim]
    if static.data_ptr() != value.data_ptr():
        (static if batch == size else static.narrow(dim, 0, batch)).copy_(value)
    if batch < size:
        static.narrow(dim, batch, size - batch).fill_(pad)


def _resized(leaf: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`leaf` with `size` rows along `dim`: its first rows, repeated when it has fewer."""
    index = torch.arange(size, device=leaf.device) % leaf.shape[dim]
    return leaf.index_select(dim, index)


def _rows(out: Any, dim: int | None, batch: int, clone: bool) -> Any:
    if not isinstance(out, torch.Tensor):
        return out
    # Always a new view: the held-output check keeps weak references to what it hands
    # out, and the graph's own output tensor never dies.
    view = out.narrow(dim, 0, batch) if dim is not None else out.view(out.shape)
    return view.clone() if clone else view


def _state_slots(module: torch.nn.Module) -> list[tuple[dict, str]]:
    """(owning dict, name) of every parameter and buffer of `module`."""
    return [(owned, name) for m in module.modules() for owned in (m._parameters, m._buffers) for name in owned]


# How many parameters and buffers any module has registered: a reassignment
# (`module.weight = Parameter(...)`, `module.cache = tensor`) bumps it.
_registrations = [0]


def _count_registration(*_: Any) -> None:
    _registrations[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
torch.nn.modules.module.register_module_buffer_registration_hook(_count_registration)


def _flatten(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """tree_flatten((args, kwargs)), with a cheap structure key when every
    argument is a tensor (the common call), since TreeSpecs are slow to hash."""
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        return list(args), len(args)
    return tree_flatten((args, kwargs))


class WriteObserver(TorchDispatchMode):
    """Finds which of `tensors` an operation writes in place (through any view)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # observe the compiled step as it runs, not Dynamo's tracing

    def __init__(self, tensors: Sequence[torch.Tensor]):
        super().__init__()
        self.storages = [t.untyped_storage().data_ptr() for t in tensors]
        self.written = [False] * len(tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, argument in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            if argument.alias_info is not None and argument.alias_info.is_write \
                    and isinstance(value, torch.Tensor):
                address = value.untyped_storage().data_ptr()
                self.written = [w or address == s for w, s in zip(self.written, self.storages)]
        return func(*args, **kwargs)
