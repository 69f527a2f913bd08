"""Backend: the torch.compile backend that owns graphopt's whole pipeline.

For each graph Dynamo hands it:

    Dynamo graph -> [split at splitting ops] -> AOTAutograd -> passes -> level 1 FX code | level 2 Inductor
                 -> GraphRunner (device graphs, one per capture size) -> back to Dynamo

Level 1 runs the rewritten functional ATen graph as FX code. Level 2 hands the
Dynamo graph to Inductor with graphopt's pipeline installed as Inductor's post-grad
custom pass. With device graphs on, what goes back to Dynamo is the runtime
wrapping the compiled graph (`backend_runtime.py`), so Dynamo's guards run before
every replay.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx

from . import _compat, cache, executors, frozen_watch, recompiles, tiers
from ._compat import autotune, trace_graph
from ._compat import cache as compat_cache
from ._compat import recompile as compat_recompile
from ._compat.names import RECOMPILE_LIMIT
from .backend_cache import BackendCache, GraphSpec, NotStorable, device_type
from .config import AUTO_LEVEL, GraphOptimizationConfig, with_mode
from .config_checks import WEIGHT_COPYING_INDUCTOR_OPTIONS
from .inductor_options import RECOMPILE_OPTIONS, inductor_options
from .lowering import lower_to_bindings
from .passes.manager import PassManager, check_pass_names
from .repack import Repackable
from .report import FallbackKind, GraphRecord, Report

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
        weakref.finalize(self, compat_recompile.allow_recompiles, -RECOMPILE_BUDGET)
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
        if self.config.graph_opt_level in (2, AUTO_LEVEL) and not torch.cuda.is_available():
            _compat.check_cpu_isas_early()  # docs/compile-cache.md: 4 s off a cold start

    def report(self) -> Report:
        return self._report

    def refresh(self) -> int:
        """After an in-place weight update: compile again the graphs that hold Inductor's
        copies of the weights, and recompute every folded constant; returns how many."""
        from .passes.constant_fold import refresh_folded_constants

        for repackable in self.repackables:
            repackable.repack()
        for watch in self.frozen_watches:  # so this refresh is not repeated at the next call
            watch.snapshot()
        return sum(refresh_folded_constants(gm) for gm in self.graph_modules)

    def capture_calls(self) -> contextlib.AbstractContextManager:
        """Calls made to capture (capture_all()): not traffic, so not counted nor planned on."""
        from .runtime.capture_plan import not_traffic

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
        runtime, spec = self._compile_runtime(gm, example_inputs)
        if self.config.executors and self._level(device_type(example_inputs)):  # an engine may run it instead
            runtime = executors.choose(gm, example_inputs, runtime, self.config, self._report, self.repackables)
        level, inference = self._level(device_type(example_inputs)), not records_autograd(example_inputs)
        return frozen_watch.watched(runtime, gm, example_inputs, self, level, inference), spec

    def _compile_runtime(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[Callable, Any]:
        self.compiled_dynamic |= any(isinstance(x, torch.SymInt) for x in example_inputs)
        if compat_recompile.is_recompile():
            self._report.recompiles += 1
            recompiles.on_recompile(self.config.on_recompile, self._report)
        level = self._level(device_type(example_inputs))
        if level == AUTO_LEVEL:
            return self._compile_auto(gm, example_inputs), "graph_opt_level='auto' chooses its level at its first call"
        return self._runtime_at(gm, example_inputs, level)

    def _runtime_at(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], level: int) -> tuple[Callable, Any]:
        """The runtime of `gm` at `level`: the compiled graph, in device graphs where configured."""
        mode = self._cudagraph_mode(level, device_type(example_inputs))
        bypass = "level 0 compiles nothing" if level == 0 else self.cache.bypass()
        # The key of the whole graph, for its spec; a bypassed cache is logged per compile, below.
        key = self.cache.key(gm, list(example_inputs), level) if bypass is None else None
        spec: GraphSpec | str = GraphSpec(key, level, passes=self.cache.pass_uuid(level)) if key is not None else bypass
        if mode == "none":
            return self._compile(gm, example_inputs, level, key), spec
        from . import backend_runtime  # the runtime is imported once a graph has device graphs

        return backend_runtime.wrap(self, gm, example_inputs, mode, functools.partial(self._compile, level=level),
                                    key, spec)

    def _compile_auto(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        """graph_opt_level="auto": the level the compile cache chose for `gm` before, else
        both levels, chosen between at the first call (tiers.py)."""
        key = self.cache.key(gm, list(example_inputs), AUTO_LEVEL)
        record: dict[str, Any] = {"graph": len(self._report.graphs), **self.cache.load_choice(key)}
        self._report.level_choices.append(record)
        if "level" in record:
            return self._runtime_at(gm, example_inputs, record["level"])[0]
        stateful = tiers.stateful_inputs(_compat.input_kinds(gm), example_inputs)
        background = tiers.background_compile(device_type(example_inputs), self.config, self.cache.off)
        return tiers.choose(lambda level: self._runtime_at(gm, example_inputs, level)[0], gm, stateful, record,
                            self._report, functools.partial(self.cache.store_choice, key), background)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], level: int,
                 key: str | None = None) -> Callable:
        """Compile one Dynamo graph (or piece of one) at `level`, through the compile
        cache (`key`: its key, when the caller has it already)."""
        if level == 0:
            return gm.forward
        record = GraphRecord(index=len(self._report.graphs))
        self._report.graphs.append(record)
        real_inputs = _aot_args(gm, [_compat.concrete(x) for x in example_inputs])
        kinds = ["parameter"] * (len(real_inputs) - len(example_inputs)) + _compat.input_kinds(gm)
        key = key or self.cache.key(gm, list(example_inputs), level)
        start = time.perf_counter()
        if level == 1:
            compiled = self._compile_level1(gm, example_inputs, record, real_inputs, kinds, key)
        else:
            compiled = self._compile_inductor(gm, example_inputs, record, real_inputs, kinds, key)
        record.compile_seconds = time.perf_counter() - start
        return compiled

    def _compile_level1(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], record: GraphRecord,
                        real_inputs: list, kinds: list[str], key: str | None) -> Callable:
        """Level 1: AOTAutograd, the passes, lowering. Where AOTAutograd's runtime
        wrapper would only call the graph, the graph runs without it (a cache hit
        then skips AOTAutograd too); a cache hit skips the passes."""
        inference = not records_autograd(real_inputs)
        if not inference and key is not None:
            # AOTAutograd compiles the forward and, at the first backward, the backward
            # through the same compiler, and an entry holds one graph.
            self._report.fallback(FallbackKind.CACHE_OFF,
                                  "cache_dir: a graph that records autograd (grad mode on, inputs that require "
                                  "grad) is compiled without the compile cache")
            key = None
        stored = self.cache.load(key)
        graphs = self.cache.graphs(stored, real_inputs, kinds)  # frozen values folded from this process's weights
        if graphs is not None and stored["direct"] is not None:
            self._restore(stored, record, graphs[1])
            return compat_cache.call_like_aot(graphs[0], stored["direct"])

        direct: list[Callable] = []

        def fw_compiler(aot_gm: torch.fx.GraphModule, _fake_inputs: list) -> Callable:
            if graphs is not None:
                self._restore(stored, record, graphs[1])
                return _compat.boxed(graphs[0])
            records = self._optimize(aot_gm, record, real_inputs, kinds, level=1)
            lowered = lower_to_bindings(aot_gm)
            graph_inputs = len(aot_gm.graph.find_nodes(op="placeholder"))
            dims = compat_cache.aot_wrapper_output_dims(graph_inputs, len(example_inputs), inference)
            self.cache.store(key, {**records, "direct": dims}, aot_gm, lowered, real_inputs)
            if dims is not None:
                direct.append(compat_cache.call_like_aot(lowered, dims))
            return _compat.boxed(lowered)

        compiled = _compat.aot_inference(gm, example_inputs, fw_compiler)
        return direct[0] if direct else compiled

    def _compile_inductor(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], record: GraphRecord,
                          real_inputs: list, kinds: list[str], key: str | None) -> Callable:
        """Level 2. Inductor's own caches hold the compiled code; graphopt's holds the
        records of the passes, which a hit in Inductor's cache skips, and the GEMM
        choices, which it does not make. With frozen weights both are keyed on their values."""
        passes, covered = self.cache.pass_uuid(2), None
        if key is not None and self.config.freeze_parameters:
            key, passes, covered = self.cache.frozen_keys(key, gm, real_inputs, kinds)
        stored = self.cache.load(key)
        optimized: list[tuple[torch.fx.GraphModule, dict]] = []

        def post_grad_pass(graph: torch.fx.Graph) -> None:
            optimized.append((graph.owning_module, self._optimize(graph.owning_module, record, real_inputs, kinds, 2)))

        autotune.hide_inductor_storage_warning()
        autotune.hide_cuda_home_warning()
        options = {**inductor_options(device_type(real_inputs), cached=key is not None,
                                      frozen=self.config.freeze_parameters),
                   **self.config.inductor_compile_config}
        # With the cache on, AOTAutograd's entry holds the compiled code itself, so a
        # stored trace can carry it (traces.py); a frozen graph's trace is not stored, and
        # its code is found by Inductor's FX graph cache, which keys on the graph AOTAutograd
        # made (AOTAutograd's own key differs between processes for a full-graph capture).
        bundled = key is not None and not self.config.freeze_parameters
        with trace_graph.bundled_inductor_cache() if bundled else contextlib.nullcontext(), \
                autotune.gemm_choices() as gemms:
            compiled = _compat.inductor_compile(gm, example_inputs, post_grad_pass, passes, options)
            if key is not None and not optimized and stored is None:
                # Inductor's cache had the code but graphopt's records are gone: compile once more for them.
                options["force_disable_caches"] = True
                compiled = _compat.inductor_compile(gm, example_inputs, post_grad_pass, passes, options)
        record.gemms = gemms
        if optimized:
            records = optimized[-1][1]
            records["record"]["gemms"] = dict(gemms)
            self.cache.store(key, {**records, "direct": None}, optimized[-1][0], inputs=real_inputs, covered=covered)
        elif stored is not None:
            self._restore(stored, record)
        # Code from Inductor's cache holds its own copies of frozen weights, as do some options' code.
        renews = not optimized or any(options.get(k) for k in WEIGHT_COPYING_INDUCTOR_OPTIONS)
        if self.config.freeze_parameters and renews:
            inputs = list(example_inputs)
            again = functools.partial(_compat.inductor_compile, gm, inputs, post_grad_pass, passes,
                                      {**options, **RECOMPILE_OPTIONS})
            compiled = Repackable(compiled, again, optimized, self.graph_modules, self._report,
                                  held=[inputs, real_inputs])
            self.repackables.append(compiled)
        return compiled

    def compile_for_trace(self, gm: torch.fx.GraphModule,
                          example_inputs: Sequence[Any]) -> trace_graph.TraceGraph:
        """The backend of a stored trace (traces.py): `gm` compiled as `__call__`
        compiles it, as a `TraceGraph` that also says how a later process builds it again
        (or, in `why`, why it cannot: the trace then serves this process only)."""
        runtime, spec = self.compile(gm, example_inputs)
        if isinstance(spec, str):
            return trace_graph.TraceGraph(None, runtime, why=spec)
        entry = self.cache.load(spec.key)
        why = None
        if self.config.freeze_parameters:
            why = "freeze_parameters binds the weights of the process that compiles a graph"
        elif entry is None:
            why = "its graph could not be stored in the compile cache"
        elif spec.level == 1 and entry["direct"] is None:
            why = "AOTAutograd's runtime wrapper does more than call its graph"
        elif spec.level == 2:
            inner = runtime.captured[0].fn if hasattr(runtime, "captured") else runtime  # inside a GraphRunner
            spec.inductor = trace_graph.bundled_inductor(inner)
            why = None if spec.inductor is not None else "AOTAutograd's cache kept no serializable entry of its code"
        return trace_graph.TraceGraph(None if why else spec, runtime, why=why)

    def rebuild(self, spec: GraphSpec) -> Callable:
        """In a later process: the callable `__call__` returned for the graph of
        `spec`, from the compile cache, reported as a cache hit. Raises NotStorable
        when the cache no longer has the graph, or when the passes that made it
        differ from this Backend's (another extra_check, say)."""
        if spec.passes is None or spec.passes != self.cache.pass_uuid(spec.level):
            raise NotStorable("graphopt's settings or the registered replacements changed since it was stored")
        stored = self.cache.load(spec.key)
        if stored is None or (spec.level == 1 and stored["lowered"] is None):
            raise NotStorable(f"its graph ({spec.key[:12]}) is no longer in the compile cache")
        if "frozen" in stored:
            raise NotStorable("its graph binds the weights of the process that compiles it")
        record = GraphRecord(index=len(self._report.graphs))
        self._report.graphs.append(record)
        start = time.perf_counter()
        if spec.level == 1:
            compiled = compat_cache.call_like_aot(cache.load_graph(stored["lowered"]), stored["direct"])
        else:
            compiled = trace_graph.load_inductor(spec.inductor)
        self._restore(stored, record)
        record.compile_seconds = time.perf_counter() - start
        record.traced = False
        if not spec.signature:
            return compiled
        from . import backend_runtime

        return backend_runtime.runner_of(self, compiled, spec.signature, spec.key)

    def _optimize(self, gm: torch.fx.GraphModule, record: GraphRecord, inputs: list, kinds: list[str],
                  level: int) -> dict:
        config = self.config if self.config.graph_opt_level == level else self.config.replace(graph_opt_level=level)
        records = PassManager(config, self._report).optimize(gm, record, inputs, kinds)
        self.graph_modules.append(gm)
        return records

    def _restore(self, stored: dict, record: GraphRecord, graph: torch.fx.GraphModule | None = None) -> None:
        """The stored records into `record`; `graph` (else the stored final graph) to what refresh() folds."""
        self.cache.restore(stored, record)
        graph = self.cache.final_graph(stored) if graph is None else graph
        if graph is not None:
            self.graph_modules.append(graph)

    def _level(self, device: str) -> int | str:
        """The level that runs on `device`: level 2 (and "auto") needs a C++ compiler on the CPU."""
        if device not in self._levels:
            level = self.config.graph_opt_level
            if level in (2, AUTO_LEVEL) and device == "cpu" and not _compat.inductor_available():
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


def records_autograd(values: Sequence[Any]) -> bool:
    """Grad mode is on and a tensor among `values` requires grad: a graph of them
    records autograd history, and at level 1 is compiled without the compile cache."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in values)


def _rebuilt(config: GraphOptimizationConfig, dynamic_dims: Any, pad_values: Any, mode: str | None) -> Backend:
    return Backend(config, dynamic_dims=dynamic_dims, pad_values=pad_values, mode=mode)


def _aot_args(gm: torch.fx.GraphModule, inputs: list) -> list:
    """AOTAutograd's inputs: the Dynamo graph's own parameters and buffers (none
    when Dynamo lifts them, as torch >= 2.5 does), then Dynamo's inputs."""
    return [*dict(gm.named_parameters(remove_duplicate=False)).values(),
            *dict(gm.named_buffers(remove_duplicate=False)).values(), *inputs]

