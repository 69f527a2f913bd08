"""Stored traces: an optimized step's Dynamo traces, run by graphopt and kept in the
compile cache, so that a later process runs the step without tracing it again.

    call -> a trace whose guards pass for these inputs? -> run it
            else: mark dynamic dims, trace the call as one graph (without running
            it; `_compat.traces.trace`), the Backend compiles the graph -> store the
            trace (bytecode, guards, a spec of its graph) -> run it
    later process: the same, its traces read from the compile cache; each one's
            graph is built again from the cache (Backend.rebuild) when it first runs

A trace keeps every guard Dynamo can store. The others compare object identities
(`torch.cat`, a global function, a closure): a trace checks them itself on every
call, against the objects it was traced with, or, in a later process, against
objects it found under the same names and recognised (`api/identity.py`: a module
by name, a function by its code). So are the guards on constants read through such
an object (a wrapped function's `__name__`), which Dynamo could store but not
check in a later process, and the type guards on an instance of a class made
inside a function (kernels' function modules, in transformers' attention), which
Dynamo stores by a name such a class lacks. Their sources are read by a walker
over their syntax (`_compat.guard_sources`), never evaluated; a source it does not
read leaves the guard to Dynamo. A trace is also refused when a function it inlined
has changed its source. Steps Dynamo cannot trace as one graph (graph breaks),
with a guard torch cannot store (a dict's version: torch's trace fails, so
Dynamo's dispatch traces the step again, once), with module forward hooks, or
whose trace an earlier process could not store, run under `torch.compile`'s own
dispatch; so do all steps with `cache_traces=False`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import cache
from .._compat import guard_sources, trace_graph
from .._compat import recompile as compat_recompile
from .._compat import traces as dynamo_traces
from ..backend.backend import Backend
from ..backend.compile_graph import collected_less, records_autograd
from ..backend.frozen_code import StaleCode
from ..report import FallbackKind
from .identity import constant_identity, identity, is_constant, qualified, recognised

MISS = object()       # what `StoredTraces.__call__` returns for a call Dynamo must run

# Identity guards a trace can check itself: `value is traced_value`.
IDENTITY_GUARDS = frozenset({"ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH", "CLOSURE_MATCH",
                             "NN_MODULE", "BUILTIN_MATCH"})


@dataclass
class _Trace:
    """One trace of the step."""

    data: bytes | None                 # serialized, None where a later process could not use it
    identities: dict[str, str]         # taken-over guard's source -> recognised() of what it found
    inference_mode: bool               # traced in it: its guards are built in it too
    traced: Any = field(default=None, repr=False)
    objects: dict[str, Any] | None = field(default=None, repr=False)  # taken-over guard's source -> the object
    check: Callable | None = field(default=None, repr=False)          # L -> whether the identities hold
    bound: bool = False                # its graph is built (Backend.rebuild)
    refused: str | None = None
    records_autograd: bool = False     # traced in grad mode with inputs that require grad
    run: Callable | None = field(default=None, repr=False)  # its bytecode, once loaded or traced

    @property
    def ready(self) -> bool:
        return self.traced is not None and self.check is not None and self.bound

    def to_entry(self) -> dict:
        return {"data": self.data, "identities": self.identities, "inference_mode": self.inference_mode}


class StoredTraces:
    """The traces of one optimized step `fn`, compiled by `backend`. `mark(args,
    kwargs)` marks the batch dims of a call's inputs dynamic before it is traced."""

    def __init__(self, fn: Callable, backend: Backend, identity_of_step: str, mark: Callable):
        traced = dynamo_traces.traced_function(fn)
        self.function, self.bound_to = traced or (type(fn).forward, None)
        self.module = fn if isinstance(fn, torch.nn.Module) else None
        self.backend = backend
        self.mark = mark
        self.cache = cache.CompileCache(backend.config.cache_dir, backend.report())
        self.key = cache.cache_key("stored traces", identity_of_step, qualified(self.function))
        self.globals = self.function.__globals__  # a decorator's wrapper: its own module's, not __module__'s
        self.frame: Callable | None = None  # every trace's guards read the same locals: bound like the first's
        self.traces: list[_Trace] | None = None     # read from the cache on the first call
        self.untraceable: str | None = dynamo_traces.unsupported() or (
            None if traced else "its module's call is more than its forward method")

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        """The step's result, from a trace that fits the call or from a new one; MISS
        where Dynamo's own dispatch must run the call."""
        if self.module is not None and dynamo_traces.has_forward_hooks(self.module):
            return MISS
        full = args if self.bound_to is None else (self.bound_to, *args)
        trace = self._fitting(full, kwargs, ready_only=True) or self._found_or_traced(args, full, kwargs)
        if trace is None:
            return MISS
        try:
            return trace.run(*full, **kwargs)
        except StaleCode as stale:  # refresh() let its graph's code go: nothing of the call ran
            trace = self._found_or_traced(args, full, kwargs, stale=(trace, str(stale)))
            return MISS if trace is None else trace.run(*full, **kwargs)

    def _found_or_traced(self, args: tuple, full: tuple, kwargs: dict,
                         stale: tuple[_Trace, str] | None = None) -> _Trace | None:
        """A trace that fits the call, loaded or new; `stale`: (a trace whose code was
        let go, why), refused first."""
        # Loading, building and tracing under Dynamo's compile lock: one thread at a
        # time, as Dynamo compiles frames; a thread that waited finds what the one
        # before it traced.
        with dynamo_traces.compile_lock():
            if self.traces is None:
                self._read()
            if stale is not None and stale[0].refused is None:
                self._refuse(*stale)
                stale[0].traced = stale[0].run = None
            return self._fitting(full, kwargs, ready_only=False) or self._trace(args, full, kwargs)

    def _read(self) -> None:
        entry = self.cache.load(self.key) or {"traces": [], "unstorable": None}
        self.traces = [_Trace(**stored) for stored in entry["traces"]]
        if entry["unstorable"] is not None and self.untraceable is None:
            # Tracing again would cost more than Dynamo's dispatch and store nothing.
            self._give_up(f"an earlier process could not store its trace: {entry['unstorable']}")

    def _fitting(self, full: tuple, kwargs: dict, ready_only: bool) -> _Trace | None:
        """The first trace that fits the call; with `ready_only`, among those already
        loaded, checked and built (what a call may use without the compile lock)."""
        frame: dict | None = None   # the traced function's locals for this call: the same for every trace
        for trace in self.traces or ():
            if trace.refused is not None or (ready_only and not trace.ready):
                continue
            if trace.traced is None and not self._load(trace):
                continue
            self.frame = self.frame or dynamo_traces.frame_binder(trace.traced)
            frame = frame or self.frame(full, kwargs)
            if self._fits(trace, frame):
                return trace
        return None

    def _fits(self, trace: _Trace, frame: dict) -> bool:
        """Its guards pass, the objects under its identity guards are the ones it
        was traced with, and its graph is built."""
        if not dynamo_traces.guards_pass(trace.traced, frame):
            return False
        if trace.check is None:
            trace.objects = self._found(trace, frame)
            if trace.objects is None:
                return False
            trace.check = _identity_check(trace.objects)
        if not trace.check(frame, self.globals):
            return False
        if not trace.bound:
            graph = dynamo_traces.trace_graph_of(trace.traced)
            try:
                graph.bind(self.backend.rebuild(graph.spec, frame, self.globals))
            except Exception as error:  # noqa: BLE001 - a graph that cannot be built costs a new trace
                self._refuse(trace, _why(error))
                return False
            trace.bound = True
            self.backend.report().traces_used += 1
        return True

    def _load(self, trace: _Trace) -> bool:
        try:
            with torch.inference_mode(trace.inference_mode):
                traced = dynamo_traces.loads(trace.data, self.function)
        except Exception as error:  # noqa: BLE001 - an entry this torch cannot load is traced again
            self._refuse(trace, _why(error))
            return False
        changed = dynamo_traces.changed_source(traced)
        if changed is not None:
            self._refuse(trace, f"the source of {changed} changed since it was traced")
            return False
        trace.traced, trace.run = traced, dynamo_traces.runnable(traced)
        return True

    def _found(self, trace: _Trace, frame: dict) -> dict[str, Any] | None:
        """The objects under a loaded trace's taken-over guards in this process, when
        each is what was traced (`recognised()`); else the trace is refused."""
        objects = {}
        for name, expected in trace.identities.items():
            reader = guard_sources.reader(name)
            if reader is None:
                self._refuse(trace, f"its guard on {name} is not one graphopt reads")
                return None
            try:
                objects[name] = guard_sources.read(reader, frame, self.globals)
            except Exception:  # noqa: BLE001 - a source that no longer reads names nothing
                objects[name] = None
            if recognised(objects[name]) != expected:
                self._refuse(trace, f"{name} is not the object it was traced with "
                                    f"({recognised(objects[name]) or 'not found'}, was {expected})")
                return None
        return objects

    def _trace(self, args: tuple, full: tuple, kwargs: dict) -> _Trace | None:
        """Trace the call (`full`: `args` after the module it is bound to), compile
        its graph, store the trace; None (logged) where the step cannot be traced as
        one graph."""
        report = self.backend.report()
        if self.untraceable is None and sum(t.bound for t in self.traces) >= compat_recompile.recompile_limit():
            self._give_up(f"it has {compat_recompile.recompile_limit()} traces, Dynamo's recompile_limit")
        if self.untraceable is not None:
            return None
        self.mark(args, kwargs)  # other dims become dynamic as Dynamo's automatic dynamic shapes decide
        objects: dict[str, Any] = {}
        problems: list[str] = []
        guarded: list[bool] = []   # Dynamo reached the guards: the step is one graph

        def keep(entries: list) -> list[bool]:
            guarded.append(True)
            return _keep_guards(entries, objects, problems)

        try:
            with collected_less():
                traced = dynamo_traces.trace(self.function, full, kwargs, self.backend.compile_for_trace, keep)
        except Exception as error:  # noqa: BLE001 - a graph break, a guard torch cannot store: Dynamo runs it
            if guarded:
                self._unstorable(_why(error))
            self._give_up(_why(error))
            return None
        # As Dynamo counts: a new graph for a step that already ran one in this process.
        report.recompiles += any(t.bound for t in self.traces)
        trace = _Trace(None, {}, torch.is_inference_mode_enabled(), traced, objects, _identity_check(objects),
                       bound=True, records_autograd=records_autograd(dynamo_traces.call_tensors(full, kwargs)),
                       run=dynamo_traces.runnable(traced))
        self.traces.append(trace)
        self._store(trace, problems[0] if problems else None)
        return trace

    def _store(self, trace: _Trace, unstorable: str | None) -> None:
        identities = {name: recognised(value) for name, value in trace.objects.items()}
        unnamed = [name for name, found in identities.items() if found is None]
        try:
            if unstorable or unnamed:
                raise trace_graph.NotSerializable(unstorable or f"{unnamed[0]} is an object a later process cannot "
                                             "recognise")
            data = dynamo_traces.dumps(trace.traced)
            dynamo_traces.loads(data, self.function)  # what does not load here would not load in a later process
            trace.data, trace.identities = data, identities
        except trace_graph.NotChosenYet:
            note = ("graph_opt_level='auto': a step's trace is stored by the first process that starts with its "
                    "graphs' levels chosen (the next one), and used from the process after")
            if note not in self.backend.report().notes:
                self.backend.report().notes.append(note)
            return
        except Exception as error:  # noqa: BLE001 - unpicklable state costs later processes a trace, not this one
            self.backend.report().fallback(FallbackKind.TRACE_NOT_STORED,
                                           f"cache_dir: a trace of {qualified(self.function)} is used in this "
                                           f"process only: it cannot be stored ({_why(error)})")
            if not trace.records_autograd:  # the same step under no_grad stores: not the step's lasting state
                self._unstorable(_why(error))
            return
        kept = [t.to_entry() for t in self.traces if t.data is not None and t.refused is None]
        self.cache.store(self.key, {"traces": kept[-compat_recompile.recompile_limit():], "unstorable": None})
        self.backend.report().traces_stored += 1

    def _unstorable(self, reason: str) -> None:
        if self.backend.config.graph_opt_level == 1 and not any(t.data is not None for t in self.traces):
            # What refuses one trace (a guard, an object) refuses the step's next ones,
            # so later processes let Dynamo dispatch. Not at level 2: Inductor's cache
            # keys a graph from Dynamo's dispatch apart from the same graph traced here
            # (their GraphModules' metadata differ), so the switch would compile again.
            self.cache.store(self.key, {"traces": [], "unstorable": reason})

    def _give_up(self, reason: str) -> None:
        self.untraceable = reason
        self.backend.report().fallback(FallbackKind.TRACE_NOT_USED,
                                       f"cache_dir: {qualified(self.function)} runs under torch.compile's own "
                                       f"dispatch from now on, without stored traces ({reason})")

    def _refuse(self, trace: _Trace, reason: str) -> None:
        trace.refused = reason
        self.backend.report().fallback(FallbackKind.TRACE_NOT_USED,
                                       f"cache_dir: a stored trace of {qualified(self.function)} is not used "
                                       f"({reason}); the step is traced again")


def _keep_guards(entries: list, objects: dict[str, Any], problems: list[str]) -> list[bool]:
    """Which guards Dynamo keeps. graphopt takes over the identity guards, and the
    guards on constants read through an object it took over (a decorator's wrapped
    function's `__name__` or defaults: Dynamo cannot store that function, so could
    not check them in a later process); their sources and values go to `objects`.
    Guards Dynamo cannot store (a dict's version, an identity whose source graphopt
    does not read) fail torch's trace: Dynamo's dispatch runs the step. Guards it
    could not check in a later process (`problems`) keep the trace from being
    stored, not from running here."""
    keep = [_keep_guard(entry, objects, problems) for entry in entries]
    taken = tuple(objects)
    for i, entry in enumerate(entries):
        name = dynamo_traces.guard_name(entry)
        readable = guard_sources.reader(name) is not None
        if keep[i] and readable and entry.has_value and is_constant(entry.value) and name.startswith(
                tuple(f"{source}{after}" for source in taken for after in ".[")):
            objects[name] = entry.value
            keep[i] = False
    return keep


def _keep_guard(entry: Any, objects: dict[str, Any], problems: list[str]) -> bool:
    name, guard_types = dynamo_traces.guard_name(entry), dynamo_traces.guard_type(entry)
    unstorable = guard_types & dynamo_traces.unstorable_guard_types()
    reader = guard_sources.reader(name)
    if guard_types == {"TYPE_MATCH"} and entry.has_value and reader is not None and \
            type(entry.value).__qualname__ != type(entry.value).__name__:
        # Dynamo stores a type by its top-level name, which a class made inside a
        # function (or another class) lacks; identity() names it either way.
        objects[f"type({name})"] = type(entry.value)
        return False
    if not unstorable or unstorable - IDENTITY_GUARDS or not entry.has_value or reader is None:
        # An identity guard graphopt cannot read stays Dynamo's, which cannot store it: no trace then.
        module_global = reader is not None and reader[0] == guard_sources.GLOBALS and not reader[2]
        if module_global and not dynamo_traces.live_global_guards() and identity(entry.value) is None:
            problems.append(f"its guards read the module global {reader[1]}, which torch {torch.__version__} "
                            "would check in a later process against a copy taken when the trace is loaded")
        return True
    objects[name] = entry.value
    return False


def _identity_check(objects: dict[str, Any]) -> Callable:
    """One function (L: the frame's locals, G: its globals) -> whether every source
    in `objects` still holds the same object (a constant: an equal one). Like
    Dynamo's guards, it reads G live; a source that no longer reads does not hold."""
    def expected(value: Any) -> tuple[Any, bool]:  # a string or number: an equal one will do
        return (constant_identity(value), True) if is_constant(value) and identity(value) is None else (value, False)

    guards = tuple((*guard_sources.reader(name), *expected(value)) for name, value in objects.items())

    def check(frame: dict, module_globals: dict) -> bool:
        roots = guard_sources.roots(frame, module_globals)
        try:
            for root, key, steps, expected, constant in guards:
                value = roots[root][key]
                for step in steps:
                    value = step(value)
                if (constant_identity(value) != expected) if constant else (value is not expected):
                    return False
        except Exception:  # noqa: BLE001 - a source that no longer reads does not hold
            return False
        return True

    return check


def _why(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"
