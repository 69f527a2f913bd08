"""Backend: the torch.compile backend that owns graphopt's whole pipeline.

For each graph Dynamo hands it, one way through (vLLM's VllmBackend):

    key once -> [device graphs: fake run -> split at splitting ops]
             -> each piece: load | AOTAutograd -> passes -> lowering / Inductor -> store  (compile_graph.py)
             -> device graphs around the pieces (device_graphs.wrap) -> back to Dynamo

Level 1 runs the rewritten functional ATen graph as FX code. Level 2 hands the
Dynamo graph to Inductor with graphopt's pipeline installed as Inductor's post-grad
custom pass. With device graphs on, what goes back to Dynamo is the runtime
wrapping the compiled graph, so Dynamo's guards run before every replay.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx

from .._compat import dynamo, guard_sources, inductor, trace_graph
from .._compat import recompile as compat_recompile
from .._compat.names import RECOMPILE_LIMIT
from ..config import AUTO_LEVEL, GraphOptimizationConfig, with_mode
from ..passes.base import is_collective
from ..passes.fusion.replacement import Unkeyable
from ..passes.manager import check_pass_names
from ..report import FallbackKind, Report
from . import executors, frozen_code, frozen_watch, recompiles, tiers
from .compile_graph import Compiled, GraphCompiler, records_autograd
from .graph_cache import WEIGHT_KINDS, BackendCache, GraphSpec, NotStorable, device_type
from .repack import Repackable

# Graphs each Backend may add to Dynamo's per-function recompile limit: batch size 1
# (specialised), the dynamic graph, and recompiles after guarded changes.
RECOMPILE_BUDGET = 8


class Backend:
    """A torch.compile backend bound to one config: `torch.compile(model, backend=Backend(cfg))`.

    `dynamic_dims` ({argument: dim}) says which dim of which `forward` argument is
    the batch (default: dim 0 of the first tensor argument with a symbolic one);
    `pad_values` ({argument: value}) what padded rows of that argument hold.
    `report()` describes every graph it compiled and every device graph it ran.
    """

    def __init__(self, config: GraphOptimizationConfig | None = None, *,
                 dynamic_dims: Mapping[str, int] | None = None,
                 pad_values: Mapping[str, float | int] | None = None, mode: str | None = None):
        self.given, self.mode = config or GraphOptimizationConfig(), mode
        self.dynamic_dims = dynamic_dims
        self.pad_values = dict(pad_values or {})
        self.graph_modules: list[torch.fx.GraphModule] = []
        self.repackables: list[Repackable] = []
        self.frozen_watches: list[frozen_watch.FrozenWatch] = []  # with freeze_parameters: one per graph
        self.callers: set[int] = set()  # threads that called a GraphRunner of this Backend
        self.graph_pools: dict[str, Any] = {}  # device -> the graph pool its runners' CUDA graphs share
        self.replay_lock = threading.RLock()  # so they never replay at once (runtime/runner.py)
        # Set once Dynamo hands over a graph with a symbolic size: from then on a new
        # batch size finds that graph, so callers can stop marking dynamic dims.
        self.compiled_dynamic = False
        # Set by optimize(), which gives torch.compile the `guards` key's filter: a
        # Backend handed to torch.compile by the user cannot choose Dynamo's guards.
        self.guards_filtered = False
        self._levels: dict[str, int] = {}
        self._configure(mode)
        compat_recompile.allow_recompiles(RECOMPILE_BUDGET)
        # Given back when the Backend goes: no lasting change to the process's Dynamo limit.
        weakref.finalize(self, compat_recompile.give_back_recompiles, RECOMPILE_BUDGET)
        compat_recompile.on_recompile_limit(self._gave_up)

    def _configure(self, mode: str | None) -> None:
        self.config, kept = with_mode(self.given, mode)
        self.mode = mode
        check_pass_names(self.config.disabled_passes)
        self._report = Report(self.config.graph_opt_level)
        # With "auto", the sizes the runners' plans choose (runtime/capture_plan.py).
        self._report.capture_sizes = [] if self.config.auto_capture_sizes else list(self.config.cudagraph_capture_sizes)
        self._report.notes += kept
        self.cache = BackendCache(self.config, self._report)
        self.compiler = GraphCompiler(self.config, self._report, self.cache, self.graph_modules, self.repackables)
        # Shortens a cold start at level 2 (docs/compile-cache.md). Not under "auto": its
        # level 2 compiles in a child, and the checks' thread would slow level 1's compile.
        if self.config.graph_opt_level == 2 and not torch.cuda.is_available():
            inductor.check_cpu_isas_early()
        if self.config.freeze_parameters:
            frozen_watch.count_assignments()

    def report(self) -> Report:
        return self._report

    def refresh(self) -> int:
        """After an in-place weight update: compile again the graphs that hold Inductor's
        copies of the weights, and recompute every folded constant; returns how many."""
        from ..passes.constant_fold import refresh_folded_constants

        for repackable in self.repackables:
            repackable.repack()
        for watch in self.frozen_watches:  # so this refresh is not repeated at the next call
            watch.snapshot()
        return sum(refresh_folded_constants(gm) for gm in self.graph_modules)

    def capture_calls(self) -> contextlib.AbstractContextManager:
        """Calls made to capture (capture_all()): not traffic, so not counted nor planned on."""
        from ..runtime.capture_plan import not_traffic

        return not_traffic()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                 options: Mapping[str, Any] | None = None) -> Callable:
        """Dynamo's call; torch.compile adds its `mode` and `options` when given."""
        if options:
            raise TypeError("torch.compile(backend=graphopt.Backend(config), options=...): a Backend takes its "
                            "keys from its config; put them there, or use backend='graphopt' with options")
        if mode not in (None, self.mode):
            if self.graph_modules or self._report.graphs:
                raise ValueError(f"this Backend already compiled graphs with mode={self.mode!r}; use a new "
                                 f"Backend for mode={mode!r}")
            self._configure(mode)
        return self.compile(gm, example_inputs)[0]

    def __deepcopy__(self, memo: dict) -> Backend:
        """The same Backend: engines copy their compile settings (transformers' CompileConfig),
        and the copy must compile into the report the user holds."""
        return self

    def __reduce__(self) -> tuple:
        """Pickled, a Backend is its settings: unpickled, a new Backend with an empty report."""
        return _rebuilt, (self.given, self.dynamic_dims, self.pad_values, self.mode)

    def compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[Callable, GraphSpec | str]:
        """What Dynamo runs for `gm`, and how a later process builds it again from
        the compile cache (a GraphSpec), or why it cannot."""
        if self.config.guards != "all" and not self.guards_filtered:
            self._report.fallback(FallbackKind.GUARDS,
                                  f"guards={self.config.guards!r}: under torch.compile(backend=...) Dynamo checks "
                                  "every guard; use graphopt.optimize(), or give torch.compile options="
                                  "{'guard_filter_fn': torch.compiler.keep_tensor_guards_unsafe}")
        self.compiled_dynamic |= any(isinstance(x, torch.SymInt) for x in example_inputs)
        if compat_recompile.is_recompile():
            self._report.recompiles += 1
            recompiles.on_recompile(self.config.on_recompile, self._report)
        level, fingerprint = self._level(device_type(example_inputs)), self.cache.fingerprint()
        if level == AUTO_LEVEL:
            runtime, spec = self._compile_auto(gm, example_inputs, fingerprint)
        else:
            runtime, spec = self._runtime_at(gm, example_inputs, level, fingerprint)
        if self.config.executors and level:  # an engine may run it instead
            runtime = executors.choose(gm, example_inputs, runtime, self.config, self._report, self.repackables)
            if isinstance(spec, GraphSpec):  # a graph built from a stored trace would skip the choice
                spec = "executors: an engine is exported and timed from the graph Dynamo hands over"
        inference = not records_autograd(example_inputs)
        return frozen_watch.watched(runtime, gm, example_inputs, self, level, inference), spec

    def _runtime_at(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], level: int,
                    fingerprint: str | Unkeyable) -> tuple[Callable, GraphSpec | str]:
        """The runtime of `gm` at `level`: keyed once, run on fake values where device
        graphs are on (split around the ops they cannot replay), each piece compiled,
        then wrapped in device graphs. With the spec a later process builds it from."""
        mode = self._cudagraph_mode(level, device_type(example_inputs))
        bypass = "level 0 compiles nothing" if level == 0 else self.cache.bypass(fingerprint)
        key = self.cache.key(gm, list(example_inputs), level, fingerprint) if bypass is None else None
        layout, options = None, None
        if mode != "none":
            from . import device_graphs  # the runtime is imported once a graph has device graphs

            options = self._runtime_options()
            layout = device_graphs.analyse(gm, example_inputs, mode, options)
        if layout is not None and layout.unsafe:
            return (self._pieces(gm, example_inputs, level, key, fingerprint, layout, options),
                    "it is split into pieces around ops a device graph cannot replay")
        compiled = self.compiler.compile(gm, example_inputs, level, key, fingerprint)
        spec = bypass or self._spec(gm, key, level, fingerprint, compiled)
        if layout is None:
            return compiled.fn, spec
        if isinstance(spec, GraphSpec):
            spec.signature = layout.signature
        return device_graphs.whole(compiled.fn, layout.signature, key, options), spec

    def _pieces(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], level: int, key: str | None,
                fingerprint: str | Unkeyable, layout: Any, options: Any) -> Callable:
        """`gm` split at the nodes a device graph cannot replay: each piece keyed and
        compiled on the values it gets (the graph's own inputs real, the rest fake), the
        safe ones captured; pieces reading a number an earlier piece computes run as compiled."""
        from ..runtime.analysis import piecewise
        from . import device_graphs

        split_gm, unsafe = piecewise.split(gm, layout.unsafe)
        real = dict(zip([n.name for n in gm.graph.nodes if n.op == "placeholder"], example_inputs))
        pool, captured = device_graphs.pool(options), []
        for name, piece, fakes in piecewise.pieces_on_fakes(split_gm, example_inputs):
            inputs = [n.name for n in piece.graph.nodes if n.op == "placeholder"]
            # A number an earlier piece computes (`.item()`) changes every call: a capture would freeze it.
            numbers = [n for n, fake in zip(inputs, fakes) if not isinstance(fake, torch.Tensor) and n not in real]
            if numbers and name not in unsafe:
                unsafe[name] = f"it reads {numbers[0]}, a number computed at run time by an earlier piece"
            record = self._report.piece(layout.graph_index, unsafe.get(name))
            if name in unsafe:
                continue
            examples = [real.get(n, fake) for n, fake in zip(inputs, fakes)]
            piece_key = self.cache.key(piece, examples, level, fingerprint)
            compiled = self.compiler.compile(piece, examples, level, piece_key, fingerprint).fn
            # The graph's own inputs sit at fixed addresses; intermediates from eager pieces are copied in.
            captured.append(device_graphs.captured(compiled, record, options, pool, [n in real for n in inputs]))
            split_gm.__dict__[name] = captured[-1]  # found before the submodule of that name
        return device_graphs.wrap(split_gm, captured, layout.signature, key, options)

    def _spec(self, gm: torch.fx.GraphModule, key: str, level: int, fingerprint: str | Unkeyable,
              compiled: Compiled) -> GraphSpec | str:
        """How a later process builds `compiled` again from the compile cache (its
        stored trace's graph), or why it cannot: the trace then serves this process only."""
        if compiled.entry is None:
            return "its graph could not be stored in the compile cache"
        if level == 1 and compiled.entry["direct"] is None:
            return "AOTAutograd's runtime wrapper does more than call its graph"
        weights = self._frozen_weights(gm, compiled.entry) if self.config.freeze_parameters else None
        if isinstance(weights, str):
            return weights
        return GraphSpec(key, level, passes=self.cache.pass_uuid(level, fingerprint),
                         compiled=compiled.fn if level == 2 and weights is None else None, weights=weights,
                         kinds=dynamo.input_kinds(gm) if weights is not None else None)

    @staticmethod
    def _frozen_weights(gm: torch.fx.GraphModule, entry: dict) -> dict[int, str] | str:
        """A frozen graph's weight inputs by Dynamo's source, which a later process reads
        from its call's frame to fold and pack its own weights (`rebuild`); or why its
        trace cannot be stored."""
        if entry.get("weight_free") is False:
            return "its compiled code holds a constant made from the weights by value"
        if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
            return "its graph holds weights of its own rather than taking them as inputs"
        kinds, sources = dynamo.input_kinds(gm), dynamo.input_sources(gm)
        weights = {i: source for i, (kind, source) in enumerate(zip(kinds, sources)) if kind in WEIGHT_KINDS}
        unread = next((source for source in weights.values() if guard_sources.reader(source) is None), None)
        if unread is not None:
            return f"graphopt does not read the source of its weight {unread!r}"
        return weights

    def _runtime_options(self) -> Any:
        from .device_graphs import RuntimeOptions

        return RuntimeOptions(self.config, self._report, self.dynamic_dims, self.pad_values, self.graph_pools,
                              self.callers, self.replay_lock)

    def _compile_auto(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                      fingerprint: str | Unkeyable) -> tuple[Callable, GraphSpec | str]:
        """graph_opt_level="auto": the level the compile cache chose for `gm` before (with
        its spec: a stored trace can name it), else both levels, chosen between at the
        first call (tiers.py)."""
        key = self.cache.key(gm, list(example_inputs), AUTO_LEVEL, fingerprint)
        if key is None:
            self.cache.note_bypass(fingerprint)
        record: dict[str, Any] = {"graph": len(self._report.graphs), **self.cache.load_choice(key)}
        self._report.level_choices.append(record)
        if "level" in record:
            return self._runtime_at(gm, example_inputs, record["level"], fingerprint)
        if any(is_collective(node) for node in gm.graph.nodes):
            why = ("its graph has collectives: each rank would time its levels for a different number of "
                   "calls, and the ranks' collectives would no longer match")
            self._report.fallback(FallbackKind.LEVEL, f"graph_opt_level='auto': graph {record['graph']}: {why}; "
                                  "level 1 serves it (set graph_opt_level=2 for Inductor)")
            record.update(level=1, seconds={}, reason=why)
            return self._runtime_at(gm, example_inputs, 1, fingerprint)
        stateful = tiers.stateful_inputs(dynamo.input_kinds(gm), example_inputs)
        background = tiers.background_compile(self.config.level_choice, device_type(example_inputs), self.cache.off)
        in_compile = dynamo.later_in_this_compile()

        def compile_at(level: int, inputs: Sequence[Any] | None = None) -> Callable:
            with in_compile():
                return self._runtime_at(gm, example_inputs if inputs is None else inputs, level, fingerprint)[0]

        runtime = tiers.choose(compile_at, gm,
                               stateful, record, self._report, functools.partial(self.cache.store_choice, key),
                               background, tiers.precision_bound(self.config, gm), self._released)
        return runtime, tiers.UNCHOSEN

    def _released(self, runtime: Callable) -> None:
        """A level that will not serve: refresh() no longer compiles it again."""
        self.repackables[:] = [r for r in self.repackables if r is not runtime]

    def compile_for_trace(self, gm: torch.fx.GraphModule,
                          example_inputs: Sequence[Any]) -> trace_graph.TraceGraph:
        """The backend of a stored trace (traces.py): `gm` compiled as `__call__`
        compiles it, as a `TraceGraph` that also says how a later process builds it again
        (or, in `why`, why it cannot: the trace then serves this process only)."""
        runtime, spec = self.compile(gm, example_inputs)
        if isinstance(spec, str):
            return trace_graph.TraceGraph(None, runtime, why=spec, chosen=spec is not tiers.UNCHOSEN)
        if spec.level == 2 and spec.weights is None:  # a frozen graph's code is in its entry
            spec.inductor = trace_graph.bundled_inductor(spec.compiled)
            if spec.inductor is None:
                return trace_graph.TraceGraph(None, runtime,
                                              why="AOTAutograd's cache kept no serializable entry of its code")
        return trace_graph.TraceGraph(spec, runtime)

    def rebuild(self, spec: GraphSpec, frame: dict | None = None, module_globals: dict | None = None) -> Callable:
        """In a later process: the callable `__call__` returned for the graph of
        `spec`, from the compile cache, reported as a cache hit. A frozen graph folds
        this process's weights, read from the trace's `frame` (its call's locals) and
        `module_globals`. Raises NotStorable when the cache no longer has the graph,
        when the passes that made it differ from this Backend's (another extra_check,
        say), or when the weights no longer fit it."""
        inputs = None
        if spec.weights is not None:
            if frame is None:
                raise NotStorable("a frozen graph is built from the weights of the call it serves")
            inputs = [None] * len(spec.kinds or [])
            for i, source in spec.weights.items():
                inputs[i] = guard_sources.read(guard_sources.reader(source), frame, module_globals or {})
        compiled = self.compiler.rebuild(spec, inputs)
        loaded = compiled if isinstance(compiled, frozen_code.LoadedCode) else None
        if spec.signature:
            from . import device_graphs

            compiled = device_graphs.whole(compiled, spec.signature, spec.key, self._runtime_options())
        if inputs is None:
            return compiled
        watch = frozen_watch.watch_inputs(compiled, self, inputs, spec.weights, loaded)
        self.frozen_watches.append(watch)
        return watch

    def _level(self, device: str) -> int | str:
        """The level that runs on `device`: level 2 (and "auto") needs a C++ compiler on the CPU."""
        if device not in self._levels:
            level = self.config.graph_opt_level
            if level in (2, AUTO_LEVEL) and device == "cpu" and not inductor.inductor_available():
                self._report.fallback(FallbackKind.LEVEL,
                                      f"graph_opt_level={level!r}: Inductor found no C++ compiler for CPU code; "
                                      "running level 1 (install gcc or clang to compile)")
                level = 1
            self._levels[device] = level
        return self._levels[device]

    def _cudagraph_mode(self, level: int, device: str) -> str:
        config = self.config
        if not config.use_cudagraph or config.cudagraph_mode == "none":
            return "none"
        if level == 2 and device == "cpu":
            if config.graph_opt_level != AUTO_LEVEL:  # with "auto", the level choice's row says what runs
                self._report.fallback(FallbackKind.NO_DEVICE_GRAPH,
                                      "use_cudagraph with graph_opt_level=2 on CPU: Inductor's C++ kernels "
                                      "bypass the dispatcher and cannot be recorded on a host graph; the "
                                      "compiled kernels run directly")
            return "none"
        return config.cudagraph_mode or "auto"

    def _gave_up(self, message: str) -> None:
        if self._report.graphs or self._report.pieces:
            self._report.fallback(FallbackKind.EAGER, f"Dynamo gave up compiling and runs a frame eagerly: {message}; "
                                  f"raise {RECOMPILE_LIMIT}")


def _rebuilt(config: GraphOptimizationConfig, dynamic_dims: Any, pad_values: Any, mode: str | None) -> Backend:
    return Backend(config, dynamic_dims=dynamic_dims, pad_values=pad_values, mode=mode)
