"""One graph (or one piece of one) compiled at a level, through the compile cache:

    load its entry -> hit: the stored code (level 1) or records (level 2)
                   -> miss: AOTAutograd -> passes -> level 1 lowering | level 2 Inductor -> store

`GraphCompiler.compile` returns what runs and the entry it loaded or stored (None
where nothing was stored), so no caller reads back what was just written.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx

from .. import cache
from .._compat import aot_autograd, autotune, dynamo, inductor, inductor_constants, shapes, trace_graph
from .._compat import cache as compat_cache
from ..config import GraphOptimizationConfig
from ..config_checks import WEIGHT_COPYING_INDUCTOR_OPTIONS
from ..passes.fusion.replacement import Unkeyable
from ..passes.manager import PassManager
from ..report import FallbackKind, GraphRecord, Report
from . import frozen_code
from .graph_cache import BackendCache, GraphSpec, NotStorable, bind, device_type
from .inductor_options import RECOMPILE_OPTIONS, inductor_options
from .lowering import lower_to_bindings
from .repack import Repackable


@dataclass
class Compiled:
    """What runs for one graph, and its compile cache entry (loaded or stored; None without one)."""

    fn: Callable
    entry: dict | None = None


# A compile makes millions of short-lived objects. With Python's default thresholds, the
# collections they set off took 1.2-1.6 s of the ~1B decoder's level-2 first call, walking
# the model's and torch's objects as well; 0.7 s with these (2026-12-06, docs/compile-cache.md).
COMPILE_GC_THRESHOLDS = (50_000, 20, 20)
_collector_lock = threading.Lock()
_open_compiles = 0
_thresholds_before: tuple[int, int, int] | None = None


@contextlib.contextmanager
def collected_less() -> Iterator[None]:
    """Within, the garbage collector runs less often (COMPILE_GC_THRESHOLDS) and leaves
    alone the objects made before (`gc.freeze`): around each graph's compile, and around
    Dynamo's trace where graphopt calls it (api/traces.py). The outermost sets both and
    puts them back, when it fails too."""
    global _open_compiles, _thresholds_before
    with _collector_lock:  # compiles on two threads share one collector
        _open_compiles += 1
        if _open_compiles == 1:
            _thresholds_before = gc.get_threshold()
            gc.freeze()
            gc.set_threshold(*COMPILE_GC_THRESHOLDS)
    try:
        yield
    finally:
        with _collector_lock:
            _open_compiles -= 1
            if _open_compiles == 0:
                gc.unfreeze()
                gc.set_threshold(*_thresholds_before)


class GraphCompiler:
    """Compiles graphs for one Backend: its config, report and cache, and the lists
    refresh() reads (the final graphs, the compiles holding Inductor's weight copies)."""

    def __init__(self, config: GraphOptimizationConfig, report: Report, cache_: BackendCache,
                 graph_modules: list[torch.fx.GraphModule], repackables: list):
        self.config, self.report, self.cache = config, report, cache_
        self.graph_modules, self.repackables = graph_modules, repackables

    def compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], level: int,
                key: str | None, fingerprint: str | Unkeyable) -> Compiled:
        """`gm` at `level`, its entry under `key` (None: the cache is bypassed, which is
        logged); `fingerprint`: the user patterns' (BackendCache.fingerprint)."""
        if level == 0:
            return Compiled(gm.forward)
        if key is None:
            self.cache.note_bypass(fingerprint)
        record = GraphRecord(index=len(self.report.graphs), level=level)
        self.report.graphs.append(record)
        real_inputs = _aot_args(gm, [shapes.concrete(x) for x in example_inputs])
        kinds = ["parameter"] * (len(real_inputs) - len(example_inputs)) + dynamo.input_kinds(gm)
        start = time.perf_counter()
        with collected_less():
            if level == 1:
                compiled = self._level1(gm, example_inputs, record, real_inputs, kinds, key)
            else:
                compiled = self._inductor(gm, example_inputs, record, real_inputs, kinds, key,
                                          self.cache.pass_uuid(2, fingerprint))
        record.compile_seconds = time.perf_counter() - start
        return compiled

    def _level1(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], record: GraphRecord,
                real_inputs: list, kinds: list[str], key: str | None) -> Compiled:
        """Level 1: AOTAutograd, the passes, lowering. Where AOTAutograd's runtime
        wrapper would only call the graph, the graph runs without it (a cache hit
        then skips AOTAutograd too); a cache hit skips the passes."""
        inference = not records_autograd(real_inputs)
        if not inference and key is not None:
            # AOTAutograd compiles the forward and, at the first backward, the backward
            # through the same compiler, and an entry holds one graph.
            self.report.fallback(FallbackKind.CACHE_OFF,
                                 "cache_dir: a graph that records autograd (grad mode on, inputs that require "
                                 "grad) is compiled without the compile cache")
            key = None
        stored = self.cache.load(key)
        graphs = self.cache.graphs(stored, real_inputs, kinds)  # frozen values folded from this process's weights
        if graphs is not None and stored["direct"] is not None:
            self._restore(stored, record, graphs[1])
            return Compiled(compat_cache.call_like_aot(graphs[0], stored["direct"]), stored)
        entry = stored if graphs is not None else None
        direct: list[Callable] = []

        def fw_compiler(aot_gm: torch.fx.GraphModule, _fake_inputs: list) -> Callable:
            nonlocal entry
            if graphs is not None:
                self._restore(stored, record, graphs[1])
                return aot_autograd.boxed(graphs[0])
            records = self._optimize(aot_gm, record, real_inputs, kinds, level=1)
            lowered = lower_to_bindings(aot_gm)
            graph_inputs = len(aot_gm.graph.find_nodes(op="placeholder"))
            dims = compat_cache.aot_wrapper_output_dims(graph_inputs, len(example_inputs), inference)
            entry = self.cache.store(key, {**records, "direct": dims}, aot_gm, lowered, real_inputs)
            if dims is not None:
                direct.append(compat_cache.call_like_aot(lowered, dims))
            return aot_autograd.boxed(lowered)

        compiled = aot_autograd.aot_inference(gm, example_inputs, fw_compiler)
        return Compiled(direct[0] if direct else compiled, entry)

    def _inductor(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], record: GraphRecord,
                  real_inputs: list, kinds: list[str], key: str | None, passes: str) -> Compiled:
        """Level 2. Inductor's own caches hold the compiled code; graphopt's holds the
        records of the passes, which a hit in Inductor's cache skips, and the GEMM
        choices, which it does not make. With frozen weights graphopt's entry holds the
        code too, without the weights (frozen_code.py), and Inductor's caches are not read."""
        frozen = key is not None and self.config.freeze_parameters
        entry = self.cache.load(key)
        weight_key = None
        if frozen:
            weight_key = functools.partial(self.cache.frozen_key, key, real_inputs,
                                           self.cache.covered_weights(gm, real_inputs, kinds))
            if entry is not None and "keyed_on_weights" in entry:
                key, weight_key = weight_key(), None
                entry = self.cache.load(key)
        optimized: list[tuple[torch.fx.GraphModule, dict]] = []

        def post_grad_pass(graph: torch.fx.Graph) -> None:
            records = self._optimize(graph.owning_module, record, real_inputs, kinds, 2)
            if frozen:  # before lowering, which drops the folded weights its GEMM template packs
                records["frozen"] = self.cache.frozen_entry(graph.owning_module, real_inputs)
                frozen_code.note_folded_storages(graph.owning_module)
            optimized.append((graph.owning_module, records))

        autotune.hide_inductor_storage_warning()
        autotune.hide_cuda_home_warning()
        # Parameters only: a buffer may be a KV cache, of which a step reads a part.
        weight_bytes = sum(x.nbytes for x, kind in zip(real_inputs, kinds)
                           if kind == "parameter" and isinstance(x, torch.Tensor))
        options = {**inductor_options(device_type(real_inputs), cached=key is not None,
                                      frozen=self.config.freeze_parameters, weight_bytes=weight_bytes),
                   **self.config.inductor_compile_config}
        compiled = self._load_frozen(entry, record, real_inputs, kinds) if frozen and entry is not None else None
        if compiled is None:
            entry = None if frozen else entry
            compiled, recorded = self._compile_inductor(gm, example_inputs, record, key, passes, options, entry,
                                                        post_grad_pass)
            if optimized:
                records = {**optimized[-1][1], "direct": None}
                records["record"]["gemms"] = dict(record.gemms)
                entry = (self.cache.store_frozen_code(key, weight_key, records, optimized[-1][0], compiled, recorded)
                         if frozen else
                         self.cache.store(key, records, optimized[-1][0], inputs=real_inputs))
            elif entry is not None:
                self._restore(entry, record)
        # Code from Inductor's cache holds its own copies of frozen weights, as do some options' code.
        renews = not optimized or any(options.get(k) for k in WEIGHT_COPYING_INDUCTOR_OPTIONS)
        if self.config.freeze_parameters and renews:
            inputs = list(example_inputs)
            modes = dynamo.modes_of_now()  # the first compile's, wherever refresh() is called from

            def again() -> Callable:
                with modes():
                    return inductor.inductor_compile(gm, inputs, post_grad_pass, passes,
                                                     {**options, **RECOMPILE_OPTIONS})
            compiled = Repackable(compiled, again, optimized, self.graph_modules, self.report,
                                  held=[inputs, real_inputs, *getattr(compiled, "held", [])])
            self.repackables.append(compiled)
        return Compiled(compiled, entry)

    def _compile_inductor(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], record: GraphRecord,
                          key: str | None, passes: str, options: dict, entry: dict | None,
                          post_grad_pass: Callable) -> tuple[Callable, Any]:
        """Run Inductor, reading its caches only where graphopt's `entry` has the records
        (a hit there skips the passes); with frozen weights, recording its constants."""
        frozen = key is not None and self.config.freeze_parameters
        # With the cache on, AOTAutograd's entry holds the compiled code itself, so that a
        # stored trace or a frozen entry can carry it (trace_graph.bundled_inductor).
        bundled = trace_graph.bundled_inductor_cache() if key is not None else contextlib.nullcontext()
        unread = inductor.caches_written_not_read() if key is not None and entry is None else contextlib.nullcontext()
        left_out = inductor_constants.constants_left_out() if frozen else contextlib.nullcontext()
        timings = autotune.timings_kept_per(cache.cpu_model() if key is not None else None)
        with bundled, autotune.gemm_choices() as gemms, timings, unread, left_out as recorded:
            compiled = inductor.inductor_compile(gm, example_inputs, post_grad_pass, passes, options)
        record.gemms = gemms
        return compiled, recorded

    def _load_frozen(self, entry: dict, record: GraphRecord, real_inputs: list, kinds: list[str]) -> Callable | None:
        """A frozen entry's code with its constants made from this process's weights, or
        None (reported) where they do not fit it."""
        loaded = self.cache.frozen_code(entry, real_inputs, kinds)
        if isinstance(loaded, str):
            self.report.fallback(FallbackKind.CACHE_NOT_LOADED, f"cache_dir: a stored frozen graph is compiled "
                                 f"again: {loaded}")
            return None
        self._restore(entry, record)
        return loaded

    def rebuild(self, spec: GraphSpec, inputs: list | None = None) -> Callable:
        """In a later process: the compiled graph of `spec` from the compile cache,
        reported as a cache hit; a frozen one with its values folded from the weights
        among `inputs` (the graph's inputs, None but the weights). Raises NotStorable
        when the cache no longer has the graph, when the passes that made it differ from
        this Backend's, or when the weights no longer fit it."""
        if spec.passes is None or spec.passes != self.cache.pass_uuid(spec.level, self.cache.fingerprint()):
            raise NotStorable("graphopt's settings or the registered replacements changed since it was stored")
        stored = self.cache.load(spec.key)
        if stored is None or (spec.level == 1 and stored["lowered"] is None):
            raise NotStorable(f"its graph ({spec.key[:12]}) is no longer in the compile cache")
        if "frozen" in stored:
            return self._rebuild_frozen(spec, stored, inputs or [])
        record = GraphRecord(index=len(self.report.graphs), level=spec.level)
        self.report.graphs.append(record)
        start = time.perf_counter()
        if spec.level == 1:
            compiled = compat_cache.call_like_aot(cache.load_graph(stored["lowered"]), stored["direct"])
        else:
            compiled = trace_graph.load_inductor(spec.inductor)
        self._restore(stored, record)
        record.compile_seconds = time.perf_counter() - start
        record.traced = False
        return compiled

    def _rebuild_frozen(self, spec: GraphSpec, stored: dict, inputs: list) -> Callable:
        """`rebuild` of a frozen graph: its values folded (and at level 2, packed) from `inputs`."""
        start = time.perf_counter()
        if spec.level == 1:
            graphs = bind(stored, inputs, spec.kinds)
            if isinstance(graphs, str):
                raise NotStorable(graphs)
            compiled: Callable = compat_cache.call_like_aot(graphs[0], stored["direct"])
        else:
            compiled = self.cache.frozen_code(stored, inputs, spec.kinds)
            if isinstance(compiled, str):
                raise NotStorable(compiled)
            self.repackables.append(compiled)
        record = GraphRecord(index=len(self.report.graphs), level=spec.level)
        self.report.graphs.append(record)
        self._restore(stored, record, graphs[1] if spec.level == 1 else None)
        record.compile_seconds = time.perf_counter() - start
        record.traced = False
        return compiled

    def _optimize(self, gm: torch.fx.GraphModule, record: GraphRecord, inputs: list, kinds: list[str],
                  level: int) -> dict:
        config = self.config if self.config.graph_opt_level == level else self.config.replace(graph_opt_level=level)
        records = PassManager(config, self.report).optimize(gm, record, inputs, kinds)
        self.graph_modules.append(gm)
        return records

    def _restore(self, stored: dict, record: GraphRecord, graph: torch.fx.GraphModule | None = None) -> None:
        """The stored records into `record`; `graph` (else the stored final graph) to what refresh() folds."""
        self.cache.restore(stored, record)
        graph = self.cache.final_graph(stored) if graph is None else graph
        if graph is not None:
            self.graph_modules.append(graph)


def records_autograd(values: Sequence[Any]) -> bool:
    """Grad mode is on and a tensor among `values` requires grad: a graph of them
    records autograd history, and at level 1 is compiled without the compile cache."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in values)


def _aot_args(gm: torch.fx.GraphModule, inputs: list) -> list:
    """AOTAutograd's inputs: the Dynamo graph's own parameters and buffers (none
    when Dynamo lifts them, as torch >= 2.5 does), then Dynamo's inputs."""
    return [*dict(gm.named_parameters(remove_duplicate=False)).values(),
            *dict(gm.named_buffers(remove_duplicate=False)).values(), *inputs]
