r"""Executor choice: a stateless graph runs on ONNX Runtime or OpenVINO where that is
faster than graphopt's own compiled graph (the `executors` config key).

    Dynamo graph -> graphopt's runtime for it (level 1 or 2)        -> timed  \
                 -> torch.onnx.export -> ONNX Runtime session        -> timed   \  the fastest of those
                                      -> OpenVINO CPU model, f32     -> timed   /  whose outputs equal eager's
                                      -> OpenVINO CPU model, bf16    -> timed  /   (bf16: within precision_tolerance)
                                         (compute_dtype="bfloat16" only)

Each engine runs at the precision the user allowed (engines.py): float32, and with
compute_dtype="bfloat16" also OpenVINO's bfloat16, judged as the compute_dtype pass is:
its error against eager's full-precision outputs, recorded in the report, held to
precision_tolerance.

What is exported is the Dynamo graph, not graphopt's optimized one: the optimized
graph holds graphopt's custom ops and oneDNN's packed weights (level 1), or is
Inductor's compiled code (level 2), none of which ONNX can express; the Dynamo graph
is plain torch, and each engine applies its own fusions to it. Its weights go in as
ONNX initializers (so the engine can pack them), hence `freeze_parameters=True` is
required, and `refresh()` exports them again.

Only a graph without state qualifies: no input written in place (a KV cache), no
random op, no collective, tensors only out. Anything that fails (the export, an
engine's session, outputs that differ from eager's) is a fallback, logged once: the
graph keeps graphopt's compiled graph.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from .._compat import dynamo, fake, mkldnn, ops
from .._compat.names import TorchDispatchMode
from ..config import GraphOptimizationConfig
from ..kernels.collective import is_collective_op
from ..passes import lowered_error
from ..report import FallbackKind, Report, first_line
from . import candidates, engines

# An engine must beat graphopt's median by this much: a tie is not worth leaving torch for.
MARGIN = 0.95
_ROUND_SECONDS, _ROUNDS = 0.02, 9
# Two finalists this close (after MARGIN) are timed again, alone, over more rounds: nine
# short rounds on a loaded machine can put either ahead by a few percent.
_CLOSE, _CLOSE_ROUNDS = 0.10, 25


def choose(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], runtime: Callable,
           config: GraphOptimizationConfig, report: Report, repackables: list) -> Callable:
    """`runtime` for a graph that cannot leave torch, else a Choice that picks at its first
    call (added to `repackables`: refresh() has it export the weights again)."""
    record: dict[str, Any] = {"graph": max(len(report.graphs) - 1, 0), "executor": "graphopt", "seconds": {}}
    report.executors.append(record)
    devices = {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}
    why = (f"it runs on {', '.join(sorted(devices - {'cpu'}))}; the engines run on the CPU here"
           if devices - {"cpu"} else _not_stateless(gm, example_inputs))
    if why is None:
        try:
            bound = _Bound(gm, example_inputs)
        except ValueError as error:
            why = str(error)
    if why is not None:
        record["reason"] = why
        return runtime
    record["reason"] = "not run yet: it is chosen at the first call"
    bfloat16 = config.compute_dtype == "bfloat16" and mkldnn.cpu_has_native_bf16()
    choice = Choice(bound, runtime, engines.candidates(config.executors, bfloat16), report, record,
                    config.precision_tolerance)
    repackables.append(choice)
    return choice


class Choice:
    """A stateless graph's runtime: at its first call (outside Dynamo's compile, which an
    export inside would disturb), the graph is exported once, each candidate (an engine at
    a precision) is judged against eager's outputs and timed against graphopt's runtime;
    the fastest runs every call after. `tolerance` (precision_tolerance) bounds the error
    of a candidate below float32."""

    def __init__(self, bound: _Bound, runtime: Callable, racers: Sequence[tuple[str, str]], report: Report,
                 record: dict[str, Any], tolerance: float | None):
        self.bound, self.runtime, self.racers, self.report, self.record = bound, runtime, racers, report, record
        self.tolerance = tolerance
        self.run: Callable = self._first
        self.engine: Executor | None = None
        self.inputs: list = []

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)

    def _first(self, *args: Any) -> Any:
        self.inputs = list(args)
        with torch.no_grad():
            expected = list(self.bound.gm(*self.inputs))
            racing: dict[str, Callable] = {"graphopt": self.runtime}
            model = _export(self.bound, self.inputs, self.report) if self.racers else None
            for engine, at in self.racers if model is not None else ():
                executor = _build(engine, at, self.bound, model, self.report)
                if executor is None:
                    continue
                agrees, error = _judged(executor, self.inputs, expected, self.tolerance, self.report)
                if error is not None:
                    self.record.setdefault("precision", {})[executor.name] = error
                if agrees:
                    racing[executor.name] = executor
            seconds = _timed(racing, self.inputs)
        best = min(seconds, key=lambda name: _handicapped(seconds, name))
        self.record.update(executor=best, seconds={k: round(v, 7) for k, v in seconds.items()},
                           reason="fastest of " + ", ".join(seconds) if len(seconds) > 1
                           else "no engine ran it (see the fallbacks)")
        self.run = racing[best]
        self.engine = racing[best] if best != "graphopt" else None
        return self.run(*args)

    def repack(self) -> None:
        """refresh(): the engine's initializers are copies of the weights, so export again."""
        if self.engine is not None:
            model = engines.export(self.bound, [self.inputs[i] for i in self.bound.live], self.bound.dynamic_shapes())
            self.engine.refresh(model)


def _timed(racing: dict[str, Callable], inputs: list) -> dict[str, float]:
    """Each candidate's median seconds per call; the two fastest again, over more rounds,
    where they are within _CLOSE of each other."""
    seconds = candidates.median_seconds(racing, inputs, _ROUNDS, _ROUND_SECONDS)
    first, second = (sorted(seconds, key=lambda name: _handicapped(seconds, name)) + [None])[:2]
    if second is not None and _handicapped(seconds, second) < _handicapped(seconds, first) * (1 + _CLOSE):
        seconds.update(candidates.median_seconds({name: racing[name] for name in (first, second)}, inputs,
                                                 _CLOSE_ROUNDS, _ROUND_SECONDS))
    return seconds


def _handicapped(seconds: dict[str, float], name: str) -> float:
    """A candidate's median as the race compares it: an engine's by MARGIN."""
    return seconds[name] / (1 if name == "graphopt" else MARGIN)


def _not_stateless(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str | None:
    """Why `gm` cannot leave torch (the first reason), or None."""
    fake_mode, fakes = fake.backend_fakes(example_inputs)
    if fake_mode is None:
        return "it was not compiled by torch.compile (no fake mode to inspect it in)"
    watcher = _StateWatcher(fakes)
    try:
        with fake.fake_tracing(fake_mode), watcher:
            outputs = gm(*fakes)
    except Exception as error:  # noqa: BLE001 - unknown state: it stays with graphopt
        return f"it could not be run on fake tensors to look for state ({type(error).__name__})"
    if watcher.why is not None:
        return watcher.why
    if not all(isinstance(out, torch.Tensor) for out in outputs):
        return "it returns a value that is not a tensor"
    return None


class _StateWatcher(TorchDispatchMode):
    """The first op that makes a graph stateful: a write to an input, a random op, a collective."""

    def __init__(self, inputs: list[Any]):
        super().__init__()
        self.inputs = [(i, StorageWeakRef(x.untyped_storage())) for i, x in enumerate(inputs)
                       if isinstance(x, torch.Tensor)]
        self.why: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.why is None:
            if is_collective_op(func):
                self.why = f"it calls the collective {func.overloadpacket}"
            elif torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs):
                self.why = f"it draws random numbers ({func.overloadpacket})"
            for value in ops.written_arguments(func, args, kwargs):
                if isinstance(value, torch.Tensor) and self.why is None:
                    storage = StorageWeakRef(value.untyped_storage())
                    written = [i for i, s in self.inputs if s == storage]
                    if written:
                        self.why = (f"it writes its input {written[0]} in place ({func.overloadpacket}): "
                                    "an engine's graph keeps no state between runs")
        return func(*args, **kwargs)


def _draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a seeded op draws: attention and dropout ops with p=0 (or not training) do not."""
    values = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
              for i, a in enumerate(func._schema.arguments)}
    return not (values.get("dropout_p", values.get("p")) == 0 or values.get("train") is False)


class _Bound(torch.nn.Module):
    """The Dynamo graph with its weights held (the export makes them initializers) and
    its size arguments read from the tensors that carry them: the exported model takes
    only the live tensors."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]):
        super().__init__()
        self.gm = gm
        kinds = dynamo.input_kinds(gm)
        placeholders = gm.graph.find_nodes(op="placeholder")
        self.plan: list[tuple] = []
        self.live: list[int] = []
        for i, (value, kind) in enumerate(zip(example_inputs, kinds)):
            if isinstance(value, torch.Tensor) and kind != "input":
                # detach(): the same storage, as a buffer (a Parameter confuses the export's unlifting)
                self.register_buffer(f"w{i}", value.detach(), persistent=False)
                self.plan.append(("weight", f"w{i}"))
            elif isinstance(value, torch.Tensor):
                self.plan.append(("live", len(self.live)))
                self.live.append(i)
            elif isinstance(value, torch.SymInt):
                self.plan.append(("size", *_carrier(value, placeholders, example_inputs)))
            else:
                self.plan.append(("constant", value))
        self.eval()  # what the export records: an inference graph

    def forward(self, *live: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args = []
        for how, *what in self.plan:
            if how == "weight":
                args.append(getattr(self, what[0]))
            elif how == "live":
                args.append(live[what[0]])
            elif how == "size":
                args.append(live[self.live.index(what[0])].shape[what[1]])
            else:
                args.append(what[0])
        return tuple(self.gm(*args))

    def dynamic_shapes(self) -> tuple:
        """For the export: each live tensor's symbolic dims, as one entry for `*live`."""
        from torch.export import Dim

        values = [n.meta.get("example_value") for n in self.gm.graph.find_nodes(op="placeholder")]
        return (tuple({d: Dim.DYNAMIC for d, s in enumerate(values[i].shape) if isinstance(s, torch.SymInt)}
                     if isinstance(values[i], torch.Tensor) else None for i in self.live),)  # forward's *live


def _carrier(size: torch.SymInt, placeholders: list, example_inputs: Sequence[Any]) -> tuple[int, int]:
    """(input, dim) of a tensor input whose size is `size`."""
    for i, node in enumerate(placeholders):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and isinstance(example_inputs[i], torch.Tensor):
            for d, s in enumerate(value.shape):
                if isinstance(s, torch.SymInt) and str(s.node.expr) == str(size.node.expr):
                    return i, d
    raise ValueError(f"its size argument {size} is no dim of a tensor input")


class Executor:
    """One engine's run of a Dynamo graph at one precision: Dynamo calls it with the graph's arguments."""

    def __init__(self, engine: str, precision: str, bound: _Bound, model: bytes):
        self.engine, self.precision, self.bound = engine, precision, bound
        self.name = engines.name(engine, precision)
        self.run: Callable[[list], list] = engines.runner(engine, precision, model)

    def __call__(self, *args: Any) -> list[torch.Tensor]:
        return self.run([args[i].detach().numpy() for i in self.bound.live])

    def refresh(self, model: bytes) -> None:
        self.run = engines.runner(self.engine, self.precision, model)


def _export(bound: _Bound, inputs: list, report: Report) -> bytes | None:
    """The graph as an ONNX model for every engine, or None, with the fallback that says why."""
    try:
        return engines.export(bound, [inputs[i] for i in bound.live], bound.dynamic_shapes())
    except ImportError as error:
        report.fallback(FallbackKind.EXECUTOR,
                        f"executors: the ONNX exporter's {error.name} is not installed (pip install onnx onnxscript); "
                        "graphs run on graphopt's compiled code")
    except Exception as error:  # noqa: BLE001 - an export that fails leaves graphopt's graph in place
        report.fallback(FallbackKind.EXECUTOR, f"executors: a graph could not be exported to ONNX "
                        f"({type(error).__name__}: {first_line(error)[:300]}); it runs on graphopt's compiled code")
    return None


def _build(engine: str, precision: str, bound: _Bound, model: bytes, report: Report) -> Executor | None:
    try:
        return Executor(engine, precision, bound, model)
    except ImportError as error:
        report.fallback(FallbackKind.EXECUTOR,
                        f"executors: {engine} is not installed ({error.name}; pip install {engine}); "
                        "graphs run on graphopt's compiled code")
    except Exception as error:  # noqa: BLE001 - an engine that refuses the model leaves graphopt's graph in place
        report.fallback(FallbackKind.EXECUTOR, f"executors: a graph could not run on {engines.name(engine, precision)} "
                        f"({type(error).__name__}: {first_line(error)[:300]}); it runs on graphopt's compiled code")
    return None


def _judged(executor: Executor, inputs: list, expected: list, tolerance: float | None,
            report: Report) -> tuple[bool, dict[str, Any] | None]:
    """Whether the engine may run the graph: in float32, its outputs equal eager's within
    config.py's tolerances; lower, its error against eager's (full precision, as the
    compute_dtype pass measures its own) is within `tolerance`, precision_tolerance. With
    that error, for the report (None in float32)."""
    try:
        got = executor(*inputs)
    except Exception as error:  # noqa: BLE001
        report.fallback(FallbackKind.EXECUTOR, f"executors: {executor.name} failed to run a graph "
                        f"({type(error).__name__}); it runs on graphopt's compiled code")
        return False, None
    pairs = [(g, e) for g, e in zip(got, expected) if isinstance(e, torch.Tensor)]
    if len(got) != len(expected) or any((g.shape, g.dtype) != (e.shape, e.dtype) for g, e in pairs):
        report.fallback(FallbackKind.EXECUTOR, f"executors: {executor.name}'s outputs of a graph are not eager's in "
                        "number, shape or dtype; it runs on graphopt's compiled code")
        return False, None
    if executor.precision == "f32":
        unequal = candidates.first_unequal(got, expected)
        if unequal is not None:
            report.fallback(FallbackKind.EXECUTOR,
                            f"executors: {executor.name}'s output {unequal} of a graph "
                            f"{candidates.how_unequal(got[unequal], expected[unequal])}; "
                            "it runs on graphopt's compiled code")
        return unequal is None, None
    error = lowered_error.error_record(engines.DTYPES[executor.precision], [e for _, e in pairs],
                                   [g for g, _ in pairs], tolerance)
    if error["fell_back"]:
        report.fallback(FallbackKind.EXECUTOR, f"executors: {executor.name}'s error against full precision, max abs "
                        f"{error['max_abs_error']:.3g}, is {error['relative_error']:.3g} of an output's largest "
                        "magnitude, over "
                        f"precision_tolerance={tolerance:g}; it is not a candidate for this graph")
    return not error["fell_back"], error
