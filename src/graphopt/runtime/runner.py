"""GraphRunner: the runtime of one compiled graph, as the backend hands it to Dynamo.

Dynamo runs its guards, then calls the runner with the graph's flat inputs. The
runner reads the batch symbol's value, asks the dispatcher how to run it, copies
the user inputs into static buffers padded to the capture size, runs the graph
at that capture point (its captured parts replay), and slices the outputs back to the
real batch:

    args -> batch -> Dispatch(mode, size) -> static args -> graph at (size, ...) -> outputs[:batch]

A batch of 0 rows, or one above the largest capture size, runs the compiled
graph directly (the dispatcher says so). With capture sizes "auto" the sizes are
the runner's capture plan (`capture_plan.py`): every call's batch is counted, and
every `capture_replan_interval` calls, before dispatch and never during a replay,
the sizes are planned again and the graphs of the sizes left out are released.

A replay's outputs live in the device graph's memory, which the next replay
overwrites. Outputs of the last replay that the caller still holds when the next
one starts (a weak reference each) are first given memory of their own with their
values (`Tensor.set_` on a copy), so a held output never changes under its holder.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch

from ..config import GraphOptimizationConfig
from ..report import FallbackKind, PlanRecord, Report
from .analysis.signature import BatchMismatch, Signature
from .capture import CapturedGraph, running_at
from .capture_plan import Planner, TrafficStore, is_traffic
from .dispatch import Dispatcher
from .pool import pools_with
from .static_inputs import StaticInputs

# Distinct values of a graph's non-batch symbols (a prompt length, a counter) that
# get device graphs; a symbol taking a new value every call would capture forever.
MAX_OTHER_VALUES = 8


class GraphRunner:
    """The state of one compiled graph's runtime, and its replayed call: route the
    batch, fill the static inputs, run the graph at its capture point, hand out the
    real rows. It does not capture or replay (CapturedGraph does), copy inputs
    (StaticInputs), choose sizes (the Dispatcher, the Planner with "auto") or keep the
    memory budget (pool.py)."""

    def __init__(self, graph: Callable, signature: Signature, captured: list[CapturedGraph],
                 config: GraphOptimizationConfig, report: Report, callers: set[int] | None = None,
                 graph_key: str | None = None, lock: threading.RLock | None = None):
        """`graph` runs the compiled graph; its `captured` parts replay when called at a capture point.
        `callers`: the threads that have called the step, shared by all its runners.
        `graph_key`: the graph's compile cache key, under which "auto" keeps its traffic."""
        self.graph = graph
        self.signature = signature
        self.captured = captured
        self.config = config
        self.report = report
        # Said once, by the first call that runs at a capture size (inputs a device graph cannot take never do).
        self.unsaid_exact_reason = signature.exact_reason if signature.has_batch else None
        report.batches[len(report.pieces) - 1] = _batch_description(signature)
        self.planner: Planner | None = None
        padding = signature.exact_reason is None
        if config.auto_capture_sizes and signature.has_batch:
            record = PlanRecord(len(report.pieces) - 1)
            report.plans.append(record)
            self.planner = Planner(config, record, TrafficStore(config.cache_dir, graph_key, report), padding,
                                   self._pool_bytes_at)
            record.histogram = self.planner.traffic.seen
            report.capture_sizes = report.planned_sizes()
        sizes = self.planner.sizes if self.planner is not None else config.cudagraph_capture_sizes
        if config.auto_capture_sizes and not signature.has_batch:
            sizes = [config.max_num_seqs]  # a graph without a batch has one capture point whatever the sizes
        self.dispatcher = Dispatcher(sizes, padding, planned=self.planner is not None)
        self.inputs = StaticInputs(signature, config.largest_capture_size(), config.clone_input)
        # A graph that is one captured piece is handed its capture point; a split graph's
        # pieces read it from running_at().
        self.split = not isinstance(graph, CapturedGraph)
        self.other_values: set[tuple] = set()
        # Graphs of one pool share memory: they must never replay at once, across runners
        # too (the CUDA graphs of one model share a pool: `lock` is its Backend's), and
        # with a user's pool one's replay overwrites the others' outputs (weak references).
        self.lock, self.handed_out = _pool_state(config.graph_pool, lock)
        # Outputs are cloned once two threads have called the step: shared by its runners,
        # because a runner one thread meets first may replay over what it handed another.
        self.callers = callers if callers is not None else set()
        self.pool_outputs: list[int] | None = None  # positions of the outputs in a device graph's memory
        self.inputs_checked = False  # Dynamo guards the input types: they are checked once
        self.unsupported: str | None = None  # why the inputs rule out device graphs

    def __call__(self, *args: Any) -> Any:
        """The replayed step: the capture size for this batch, the inputs copied
        into its static buffers, the graph run at that size, the real rows back."""
        route = self._route(args)
        if route is None:
            return self.graph(*args)
        batch, size, point, traffic = route
        with self.lock:
            self.callers.add(threading.get_ident())
            if self.handed_out:  # before the inputs' fill: an output may be a static input's view
                self._copy_out_held()
            static_args = self.inputs.fill(list(args), batch, size)
            if self.split:
                with running_at(point):
                    outputs = self.graph(*static_args)
            else:
                outputs = self.graph.run_at(point, static_args)
            if traffic:
                if batch is not None:
                    self.report.padded_rows += size - batch
                # A list, not a generator: this runs on every replay.
                replayed = [piece.replayed for piece in self.captured]
                self.report.steps_replayed += bool(replayed) and all(replayed)
            return self._hand_out(outputs, batch, size, args)

    def _route(self, args: tuple) -> tuple[int | None, int | None, tuple, bool] | None:
        """(batch, capture size, the capture point its graphs run at, whether the call is
        traffic), or None where the call runs the compiled graph directly: inputs
        a device graph cannot take, or a batch the dispatcher gives no graph (each
        logged once as a fallback). Traffic is counted and planned on here."""
        if not self.inputs_checked:
            self.unsupported, self.inputs_checked = _unsupported_input(args), True
        if self.unsupported is not None:
            self.report.fallback(FallbackKind.NO_DEVICE_GRAPH,
                                 f"use_cudagraph: {self.unsupported}, so the graph runs without device graphs")
            return None
        try:
            batch = self.signature.batch_of(args)
        except BatchMismatch as error:
            self.report.fallback(FallbackKind.NO_DEVICE_GRAPH,
                                 f"use_cudagraph: {error}; running without a device graph")
            return None
        traffic = is_traffic()
        if traffic:
            self.report.steps += 1
            if self.planner is not None and batch is not None:
                self._observe(batch)
        if self.unsaid_exact_reason is not None:
            self.report.fallback(FallbackKind.EXACT_SIZE,
                                 f"use_cudagraph: batches are not padded to capture sizes but captured at "
                                 f"their exact size, because {self.unsaid_exact_reason}")
            self.unsaid_exact_reason = None
        dispatch = self.dispatcher(batch)
        if dispatch.mode == "none":
            if dispatch.reason:
                self.report.fallback(FallbackKind.NO_DEVICE_GRAPH, f"use_cudagraph: {dispatch.reason} (the batch: "
                                     f"{self.signature.batch_names}; declare it with dynamic_dims)")
            return None
        other = self.signature.other_sizes(args) if self.signature.other_symints else ()
        if other not in self.other_values:
            if len(self.other_values) >= MAX_OTHER_VALUES:
                self.report.fallback(FallbackKind.NO_DEVICE_GRAPH,
                                     f"use_cudagraph: a size or number the graph reads ({self.signature.other_names}) "
                                     f"took more than {MAX_OTHER_VALUES} values; new ones run without a "
                                     "device graph, since each would need a capture of its own")
                return None
            self.other_values.add(other)
        return batch, dispatch.size, (dispatch.size or self.signature.static_batch, *other), traffic

    def _observe(self, batch: int) -> None:
        """Count the call's batch; at a re-plan, release what the plan let go and dispatch on its sizes."""
        planner = self.planner
        for piece in self.captured:
            for size in piece.share.refused_sizes:
                planner.refused(size)
        released = planner.observe(batch)
        if released is None:
            return
        with self.lock:
            for size in released:
                for piece in self.captured:
                    piece.release(size)
        self.dispatcher = Dispatcher(planner.sizes, self.dispatcher.padding, planned=True)
        self.report.capture_sizes = self.report.planned_sizes()

    def _pool_bytes_at(self, size: int) -> int:
        """What every graph pool would hold with this runner's graphs at `size` captured too."""
        return pools_with([piece.share for piece in self.captured], self.report, size)

    def _hand_out(self, outputs: Any, batch: int | None, size: int | None, args: tuple) -> Any:
        clone = self.config.clone_output or len(self.callers) > 1
        if batch is not None and batch != size:
            result = [_rows(out, dim, batch, clone) for out, dim in zip(outputs, self.signature.out_dims)]
        else:
            result = [_rows(out, None, batch, clone) for out in outputs]
        if self.signature.number_outputs:
            for i, number in self.signature.numbers_of(args).items():
                result[i] = number
        if not clone and any([piece.owns_outputs for piece in self.captured]):
            if self.pool_outputs is None:
                self.pool_outputs = _pool_outputs(result, args)
            self.handed_out.extend([weakref.ref(result[i]) for i in self.pool_outputs])
        return tuple(result) if isinstance(outputs, tuple) else result

    def _copy_out_held(self) -> None:
        """Give each output of the last replay that is still held memory of its own,
        holding its values, before this replay overwrites the graph's."""
        for ref in self.handed_out:
            held = ref()
            if held is None:
                continue
            # set_ keeps the holder's tensor object, only its memory moves. An output made
            # in inference mode can only be changed in it, and entering it is not free
            # (docs/design.md, "The replayed call"), so only when not in it already.
            if torch.is_inference_mode_enabled():
                held.set_(held.clone())
            else:
                with torch.inference_mode():
                    held.set_(held.clone())
            self.report.held_copies += 1
        self.handed_out.clear()


def _batch_description(signature: Signature) -> str:
    if not signature.has_batch:
        return f"no batch dim (batch size {signature.static_batch})" if signature.static_batch else "no batch dim"
    how = "padded up to capture sizes" if signature.exact_reason is None else "captured at each batch's exact size"
    return f"batch = {signature.batch_names or 'a SymInt input'}, {how}"


def _unsupported_input(args: tuple) -> str | None:
    """Why a device graph cannot take these inputs, or None: a tensor subclass (a
    DTensor of torch's tensor-parallel API) or an object such as a DeviceMesh
    cannot be put in a static buffer, nor recorded op by op as plain tensors."""
    for i, value in enumerate(args):
        if isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter):
            return f"input {i} is a {type(value).__name__}, a tensor subclass"
        if not isinstance(value, (torch.Tensor, int, float, bool, torch.SymInt, type(None))):
            return f"input {i} is a {type(value).__name__}, not a tensor or a number"
    return None


def _pool_outputs(result: list, args: tuple) -> list[int]:
    """The positions of the tensor outputs in a device graph's memory: not those on an
    argument's memory (a returned input or cache, which stays the caller's own). The
    same for every call of one graph, so found once."""
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return [i for i, out in enumerate(result)
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in inputs]


def _rows(out: Any, dim: int | None, batch: int | None, clone: bool) -> Any:
    if not isinstance(out, torch.Tensor):
        return out
    # Always a new view: the held-output check keeps weak references to what it
    # hands out, and the graph's own output tensor never dies.
    if dim is None:
        view = out.view_as(out)
    elif dim == 0:
        view = out[:batch]  # narrow(0, 0, batch)'s view, cheaper to make: this runs on every padded replay
    else:
        view = out.narrow(dim, 0, batch)
    return view.clone() if clone else view


_pool_states: dict[int, tuple[threading.RLock, list[weakref.ref]]] = {}
_pool_states_guard = threading.Lock()


def _pool_state(pool: Any, lock: threading.RLock | None) -> tuple[threading.RLock, list[weakref.ref]]:
    """A lock and the outputs handed out from the pool's memory: one pair per user pool
    (shared by every runner given it); else `lock` (or a private one) and a private list."""
    if pool is None:
        return lock or threading.RLock(), []
    with _pool_states_guard:
        return _pool_states.setdefault(id(pool), (threading.RLock(), []))
