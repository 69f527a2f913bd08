"""Executor choice: a stateless graph runs on ONNX Runtime or OpenVINO where that is
faster than graphopt's own compiled graph (the `executors` config key).

    Dynamo graph -> graphopt's runtime for it (level 1 or 2)      -> timed  \
                 -> torch.onnx.export -> an ONNX Runtime session  -> timed  -> the fastest whose
                                      -> an OpenVINO CPU model    -> timed  /  outputs equal eager's

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

import contextlib
import io
import logging
import os
import tempfile
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from .._compat import dynamo, fake, ops
from .._compat.names import TorchDispatchMode
from ..config import GraphOptimizationConfig
from ..kernels.collective import is_collective_op
from ..report import FallbackKind, Report, first_line
from . import candidates

# An engine must beat graphopt's median by this much: a tie is not worth leaving torch for.
MARGIN = 0.95
_ROUND_SECONDS, _ROUNDS = 0.02, 9


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
    choice = Choice(bound, runtime, config.executors, report, record)
    repackables.append(choice)
    return choice


class Choice:
    """A stateless graph's runtime: at its first call (outside Dynamo's compile, which an
    export inside would disturb), each engine's export is checked against eager's outputs
    and timed against graphopt's runtime; the fastest runs every call after."""

    def __init__(self, bound: _Bound, runtime: Callable, engines: Sequence[str], report: Report,
                 record: dict[str, Any]):
        self.bound, self.runtime, self.engines, self.report, self.record = bound, runtime, engines, report, record
        self.run: Callable = self._first
        self.engine: Executor | None = None

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)

    def _first(self, *args: Any) -> Any:
        inputs = list(args)
        with torch.no_grad():
            expected = list(self.bound.gm(*inputs))
            racing: dict[str, Callable] = {"graphopt": self.runtime}
            for engine in self.engines:
                executor = _build(engine, self.bound, inputs, self.report)
                if executor is not None and _agrees(engine, executor, inputs, expected, self.report):
                    racing[engine] = executor
            seconds = candidates.median_seconds(racing, inputs, _ROUNDS, _ROUND_SECONDS)
        best = min(seconds, key=lambda name: seconds[name] / (1 if name == "graphopt" else MARGIN))
        self.record.update(executor=best, seconds={k: round(v, 7) for k, v in seconds.items()},
                           reason="fastest of " + ", ".join(seconds) if len(seconds) > 1
                           else "no engine ran it (see the fallbacks)")
        self.run = racing[best]
        self.engine = racing[best] if best != "graphopt" else None
        return self.run(*args)

    def repack(self) -> None:
        """refresh(): the engine's initializers are copies of the weights, so export again."""
        if self.engine is not None:
            self.engine.refresh()


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
    """One engine's run of a Dynamo graph: Dynamo calls it with the graph's arguments."""

    def __init__(self, engine: str, bound: _Bound, inputs: list):
        self.engine, self.bound, self.inputs = engine, bound, inputs
        self.run: Callable[[list], list] = _session(engine, bound, inputs)

    def __call__(self, *args: Any) -> list[torch.Tensor]:
        return self.run([args[i].detach().numpy() for i in self.bound.live])

    def refresh(self) -> None:
        self.run = _session(self.engine, self.bound, self.inputs)


def _build(engine: str, bound: _Bound, inputs: list, report: Report) -> Executor | None:
    try:
        return Executor(engine, bound, inputs)
    except ImportError as error:
        report.fallback(FallbackKind.EXECUTOR,
                        f"executors: {engine} is not installed ({error.name}; pip install 'graphopt[{engine}]'); "
                        "graphs run on graphopt's compiled code")
    except Exception as error:  # noqa: BLE001 - an export that fails leaves graphopt's graph in place
        report.fallback(FallbackKind.EXECUTOR, f"executors: a graph could not run on {engine} ({type(error).__name__}: "
                        f"{first_line(error)[:300]}); "
                        "it runs on graphopt's compiled code")
    return None


def _session(engine: str, bound: _Bound, inputs: list) -> Callable[[list], list]:
    live = tuple(inputs[i] for i in bound.live)
    import onnx  # noqa: F401  (the exporter needs onnx and onnxscript)
    import onnxscript  # noqa: F401

    with quiet_export(), fake.outside_fake_mode(), torch.no_grad():
        program = torch.onnx.export(bound, live, dynamo=True, dynamic_shapes=bound.dynamic_shapes())
    model = program.model_proto.SerializeToString()
    threads = torch.get_num_threads()  # the threads torch would use: a fair race
    return _onnxruntime(model, threads) if engine == "onnxruntime" else openvino_runner(model, threads)


def _onnxruntime(model: bytes, threads: int) -> Callable[[list], list]:
    session = onnxruntime_session(model, threads)
    names = [i.name for i in session.get_inputs()]
    return lambda arrays: [torch.from_numpy(o) for o in session.run(None, dict(zip(names, arrays)))]


def onnxruntime_session(model: bytes, threads: int, options: Any = None) -> Any:
    """An ONNX Runtime CPU session of an ONNX model at ORT_ENABLE_ALL on `threads` threads
    (on top of `options`, a SessionOptions, when given)."""
    import onnxruntime

    options = options or onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    # ORT's idle threads spin by default, which takes the cores from torch's own ops
    # (and from whichever contender runs next in a benchmark's round).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def openvino_runner(model: bytes, threads: int) -> Callable[[list], list]:
    """An ONNX model compiled by OpenVINO's CPU plugin, in float32, on `threads` threads:
    numpy arrays in, torch tensors out."""
    import openvino

    core = openvino.Core()
    with tempfile.TemporaryDirectory() as folder:  # OpenVINO reads an ONNX model from a file
        path = os.path.join(folder, "graph.onnx")
        with open(path, "wb") as f:
            f.write(model)
        compiled = core.compile_model(core.read_model(path), "CPU", {"INFERENCE_NUM_THREADS": str(threads),
                                                                 # its default on CPUs with bf16 units is bf16
                                                                 "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    # The request's output buffers are its own, overwritten by the next run: copied out.
    return lambda arrays: [torch.from_numpy(o.copy()) for o in request.infer(arrays).values()]


def _agrees(engine: str, executor: Executor, inputs: list, expected: list, report: Report) -> bool:
    """Whether the engine's outputs equal eager's within config.py's tolerances."""
    try:
        got = executor(*inputs)
    except Exception as error:  # noqa: BLE001
        report.fallback(FallbackKind.EXECUTOR,
                        f"executors: {engine} failed to run a graph ({type(error).__name__}); it runs on "
                        "graphopt's compiled code")
        return False
    unequal = candidates.first_unequal(got, expected)
    if unequal is not None:
        report.fallback(FallbackKind.EXECUTOR,
                        f"executors: {engine}'s output {unequal} of a graph differs from eager's beyond config.py's "
                        "tolerances; it runs on graphopt's compiled code")
        return False
    return len(got) == len(expected)


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """The exporter prints its progress and logs warnings that concern no user."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript", "onnx_ir")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
