"""Stored traces: what Dynamo made of a step, kept in the compile cache, so that a
later process runs the step without tracing it again.

    first process:   call -> Dynamo traces, guards, Backend compiles -> run
                     then, once per new graph: trace once more without running
                     (`_compat.traces.trace`) and store the trace: its bytecode and
                     guards, and a spec from which the Backend builds the graph again
    later process:   call -> a stored trace whose guards pass? -> run it (no tracing)
                     else the first process's path, which stores what it compiles

Dynamo cannot store guards on object identity (`torch.cat is torch.cat`, a global
function's code). A stored trace keeps its own record of what they guarded (module,
function, class, code) and is used only where the same objects are found again; it
is also refused when a function it inlined has changed its source. What a stored
trace cannot see is a function rebound after its first use in the later process;
`cache_traces=False` keeps every step under Dynamo's own guards.
"""

from __future__ import annotations

import hashlib
import marshal
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import cache
from ._compat import traces as compat
from .backend import Backend, NotStorable

MISS = object()       # what `StoredTraces.run` returns when no stored trace fits the call
MAX_TRACES = 16       # per step; the oldest go first


@dataclass
class _Trace:
    """One stored trace of a step, as read from the compile cache."""

    data: bytes                                  # the serialized trace
    identities: dict[str, str]                   # dropped guard's source -> what it found there
    inference_mode: bool                         # the mode it was traced in (its guards are built in it)
    traced: Any = None                           # loaded on first use
    refused: str | None = None                   # why it cannot be used in this process
    checked_identities: bool = False
    used: bool = field(default=False, repr=False)
    # Stored by this process, where Dynamo's own guards, which keep identities, serve the graph.
    here: bool = field(default=False, repr=False)

    def stored(self) -> dict:
        return {"data": self.data, "identities": self.identities, "inference_mode": self.inference_mode}


class StoredTraces:
    """The stored traces of one optimized step (`fn`, compiled by `backend`)."""

    def __init__(self, fn: Callable, backend: Backend, identity: str):
        self.function, self.bound = compat.traced_function(fn)
        self.backend = backend
        self.module = fn if isinstance(fn, torch.nn.Module) else None
        self.cache = cache.CompileCache(backend.config.cache_dir, backend.report())
        self.key = cache.cache_key("stored traces", identity, _qualified(self.function))
        self.traces: list[_Trace] | None = None    # read on the first call

    def run(self, args: tuple, kwargs: dict) -> Any:
        """The step's result from the first stored trace that fits this call, or MISS."""
        if self.traces is None:
            stored = self.cache.load(self.key) or []
            self.traces = [_Trace(**entry) for entry in stored]
        if not self.traces or self._hooked():
            return MISS
        args = args if self.bound is None else (self.bound, *args)
        for trace in self.traces:
            if trace.refused is None and not trace.here and self._fits(trace, args, kwargs):
                if not trace.used:
                    trace.used = True
                    self.backend.report().traces_used += 1
                return compat.run(trace.traced, args, kwargs)
        return MISS

    def store(self, args: tuple, kwargs: dict) -> None:
        """Trace the call that just compiled a new graph once more, without running
        it, and add the trace to the step's entry. What cannot be stored is logged."""
        report = self.backend.report()
        reason = compat.unsupported() or (self._hooked() and "the module has forward hooks, which a stored "
                                          "trace would skip")
        if not reason:
            identities: dict[str, str] = {}
            args = args if self.bound is None else (self.bound, *args)
            try:
                traced = compat.trace(self.function, args, kwargs, self.backend.stored,
                                      lambda entry: _keep_guard(entry, identities))
                data = compat.dumps(traced)
            except Exception as error:  # noqa: BLE001 - a graph break, an unpicklable value: the trace is not stored
                reason = _why(error)
            else:
                self.traces = self.traces or []
                self.traces.append(_Trace(data, identities, torch.is_inference_mode_enabled(), here=True))
                self.traces = self.traces[-MAX_TRACES:]
                self.cache.store(self.key, [t.stored() for t in self.traces if t.refused is None])
                report.traces_stored += 1
                return
        report.fallback(f"cache_dir: a Dynamo trace of {_qualified(self.function)} could not be stored ({reason}); "
                        "a later process traces it again (its compiled graphs still come from the cache)")

    def _fits(self, trace: _Trace, args: tuple, kwargs: dict) -> bool:
        """Whether the stored trace runs this call: loaded, its recorded identities
        found again (checked once), its guards passing (every call)."""
        if trace.traced is None:
            trace.traced = self._load(trace)
            if trace.traced is None:
                return False
        if not trace.checked_identities:
            trace.checked_identities = True
            trace.refused = self._changed_identity(trace, args, kwargs)
            if trace.refused is not None:
                self._refuse(trace, trace.refused)
                return False
        return compat.guards_pass(trace.traced, args, kwargs)

    def _load(self, trace: _Trace) -> Any:
        """The trace, its graph rebuilt by the Backend from the compile cache, or None."""
        try:
            with torch.inference_mode(trace.inference_mode):
                traced = compat.loads(trace.data, sys.modules[self.function.__module__].__dict__)
            changed = compat.changed_source(traced)
            if changed is not None:
                raise NotStorable(f"the source of {changed} changed since it was traced")
            stored = compat.stored_callable(traced)
            stored.bind(self.backend.rebuild(stored.spec))
        except Exception as error:  # noqa: BLE001 - any unusable entry costs a trace, never a wrong result
            self._refuse(trace, _why(error))
            return None
        return traced

    def _changed_identity(self, trace: _Trace, args: tuple, kwargs: dict) -> str | None:
        frame = compat.frame_locals(trace.traced, args, kwargs)
        scope = _Globals(sys.modules[self.function.__module__].__dict__)
        for name, expected in trace.identities.items():
            try:
                found = identity(compat.guard_value(name, frame, scope))
            except Exception:  # noqa: BLE001 - a source that no longer evaluates is a changed one
                found = None
            if found != expected:
                return f"{name} is not the object it was traced with ({found or 'not found'}, was {expected})"
        return None

    def _refuse(self, trace: _Trace, reason: str) -> None:
        trace.refused = reason
        self.backend.report().fallback(f"cache_dir: a stored Dynamo trace of {_qualified(self.function)} is not "
                                       f"used ({reason}); the step is traced again")

    def _hooked(self) -> bool:
        """Module hooks run outside the traced forward: a stored trace would skip them."""
        return self.module is not None and compat.has_forward_hooks(self.module)


def identity(value: Any) -> str | None:
    """A process-independent name for an object a guard compared by identity: a
    module by name, a class or builtin by qualified name, a function or code object
    by its code. None for objects that have no such name."""
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, types.CodeType):
        return f"code {_code_digest(value)}"
    if isinstance(value, types.FunctionType):
        return f"function {_qualified(value)} {_code_digest(value.__code__)}"
    if isinstance(value, type):
        return f"class {_qualified(value)}"
    if isinstance(value, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                          types.MethodWrapperType, types.ClassMethodDescriptorType)):
        owner = getattr(value, "__self__", None)
        owner = owner.__name__ if isinstance(owner, types.ModuleType) else _qualified(type(owner))
        return f"builtin {getattr(value, '__module__', None) or owner}.{value.__qualname__}"
    return None


def _keep_guard(entry: Any, identities: dict[str, str]) -> bool:
    """Keep the guards Dynamo can store; record what the others guard by identity."""
    name = compat.guard_name(entry)
    if not compat.guard_type(entry) & compat.unstorable_guard_types():
        bound = _GLOBAL_BINDING.fullmatch(name)
        if bound and not compat.live_global_guards() and not _is_minted(bound[1]) and identity(entry.value) is None:
            raise NotStorable(f"its guards read the module global {bound[1]}, which a stored trace on torch "
                              f"{torch.__version__} would check against a copy taken when it is loaded")
        return True
    found = identity(entry.value) if entry.has_value else None
    if found is None:
        raise NotStorable(f"a guard compares {name} by identity, which cannot be stored")
    identities[name] = found
    return False


_GLOBAL_BINDING = re.compile(r"G\['([^']+)'\]")


def _is_minted(name: str) -> bool:
    try:
        compat.minted_global(name)
    except KeyError:
        return False
    return True


class _Globals(dict):
    """The traced function's module globals, with the names Dynamo adds to them."""

    def __missing__(self, name: str) -> Any:
        return compat.minted_global(name)


def _code_digest(code: types.CodeType) -> str:
    return hashlib.sha256(marshal.dumps(code)).hexdigest()[:16]


def _qualified(value: Any) -> str:
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"


def _why(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"
