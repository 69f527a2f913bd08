"""Dynamo's stored traces (`torch._dynamo.aot_compile`), for `graphopt/traces.py`.

A trace is what Dynamo makes of one call of a step: the frame's rewritten bytecode,
its guards and the compiled graph it calls. `trace()` makes one without running the
step; `dumps()` / `loads()` carry it to another process, where `guards_pass()` and
`run()` use it without Dynamo tracing again. Guards Dynamo cannot store (object
identities) are handed to the caller's filter, which keeps its own record of them.
"""

from __future__ import annotations

import contextlib
import inspect
import pickle
import sys
from typing import Any, Callable, Iterator

import torch


def unsupported() -> str | None:
    """Why this torch cannot store traces, or None when it can."""
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction, aot_compile_fullgraph
        from torch._dynamo.aot_compile_types import SerializableCallable  # noqa: F401
    except ImportError as error:
        return f"torch {torch.__version__} has no torch._dynamo.aot_compile ({error})"
    if not {"model", "example_inputs", "hooks", "backend"} <= set(inspect.signature(aot_compile_fullgraph).parameters):
        return f"torch {torch.__version__}'s aot_compile_fullgraph takes other arguments"
    if not all(hasattr(AOTCompiledFunction, name) for name in ("serialize", "deserialize", "guard_check",
                                                                 "prepare_f_locals", "disable_guard_check")):
        return f"torch {torch.__version__}'s AOTCompiledFunction lacks the methods graphopt uses"
    return None


def unstorable_guard_types() -> frozenset[str]:
    """Guard types Dynamo cannot store: they compare object identities."""
    from torch._dynamo.guards import CheckFunctionManager

    return frozenset(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)


def traced_function(fn: Callable) -> tuple[Callable, Any]:
    """(the function Dynamo traces for `fn`, the object bound as its first argument
    or None): an nn.Module's forward with the module, a bound method with its self."""
    if isinstance(fn, torch.nn.Module):
        return type(fn).forward, fn
    if inspect.ismethod(fn):
        return fn.__func__, fn.__self__
    return fn, None


def trace(fn: Callable, args: tuple, kwargs: dict, backend: Callable,
          keep_guard: Callable[[Any], bool]) -> Any:
    """Trace `fn(*args, **kwargs)` as one graph, without running it. `backend`
    returns a `Stored` callable; `keep_guard(entry)` says which guards the trace keeps
    (entry: Dynamo's GuardFilterEntry, with `.name`, `.value`, `.guard_type`)."""
    from torch._dynamo.aot_compile import aot_compile_fullgraph
    from torch._dynamo.hooks import Hooks

    def guard_filter(entries: list) -> list[bool]:
        return [keep_guard(entry) for entry in entries]

    return aot_compile_fullgraph(fn, (args, kwargs), hooks=Hooks(guard_filter_fn=guard_filter), backend=backend)


def guard_name(entry: Any) -> str:
    """The guarded value's source as an expression over L (the frame's locals) and G
    (its globals): `G['torch'].cat`, `L['self'].config`."""
    return entry.orig_guard.name


def guard_type(entry: Any) -> set[str]:
    return {entry.guard_type, *entry.derived_guard_types}


def live_global_guards() -> bool:
    """Whether a loaded trace's guards read the module's globals themselves (torch
    2.15 on), rather than a copy taken at load."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    return "guard_globals" in inspect.signature(AOTCompiledFunction.deserialize).parameters


def has_forward_hooks(module: torch.nn.Module) -> bool:
    """Forward hooks on `module` or on every module: they run outside the traced forward."""
    return bool(module._forward_pre_hooks or module._forward_hooks
                or torch.nn.modules.module._has_any_global_hook())


def dumps(traced: Any) -> bytes:
    from torch._dynamo.aot_compile import AOTCompiledFunction

    return AOTCompiledFunction.serialize(traced).serialized_data


def loads(data: bytes, module_globals: dict[str, Any]) -> Any:
    """A trace from `dumps`, its guards built now (under the caller's grad and
    inference modes), checked by `guards_pass` rather than on every call. Global
    guards read `module_globals` live where this torch can (2.15 and later)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    live_scope = {"guard_globals": module_globals} if live_global_guards() else {}
    traced = AOTCompiledFunction.deserialize(data, module_globals, **live_scope)
    traced.disable_guard_check()
    return traced


def stored_callable(traced: Any) -> Any:
    """The `Stored` object the trace's bytecode calls."""
    return traced._artifacts.compiled_fn


def frame_locals(traced: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    return traced.prepare_f_locals(*args, **kwargs)


def guards_pass(traced: Any, args: tuple, kwargs: dict) -> bool:
    return bool(traced.guard_check(*args, **kwargs))


def run(traced: Any, args: tuple, kwargs: dict) -> Any:
    return traced(*args, **kwargs)


def changed_source(traced: Any) -> str | None:
    """The first function the trace inlined whose source lines changed since, or None."""
    from torch._dynamo.package import _hash_sourcelines

    for source in traced._artifacts.source_info.inlined_sources:
        module = sys.modules.get(source.module)
        try:
            if module is None or _hash_sourcelines(module, source.firstlineno, source.lastlineno) != source.checksum:
                return f"{source.module} lines {source.firstlineno}-{source.lastlineno}"
        except (OSError, TypeError):
            return f"{source.module} (its source cannot be read)"
    return None


def guard_value(name: str, f_locals: dict[str, Any], f_globals: Any) -> Any:
    """Evaluate a guard's source expression (`guard_name`) in a frame."""
    from torch._dynamo.guards import _get_closure_vars

    return eval(name, {**_get_closure_vars(), "L": f_locals, "G": f_globals})  # noqa: S307 - Dynamo's own names


def minted_global(name: str) -> Any:
    """A global Dynamo adds to the traced function's module: an imported module
    (`__import_torch_dot_nn`) or the builtins dict (`__builtins_dict___0`)."""
    import builtins
    import importlib

    if name.startswith("__import_"):
        return importlib.import_module(name[len("__import_"):].replace("_dot_", "."))
    if name.startswith("__builtins_dict__"):
        return builtins.__dict__
    raise KeyError(name)


def bundled_inductor(compiled: Any) -> bytes | None:
    """Inductor's compiled graph (from `inductor_compile` with the cache on) as bytes,
    or None when AOTAutograd's cache did not keep a serializable entry for it."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    if getattr(compiled, "serialize", None) is None:
        return None
    return BundledAOTAutogradSerializableCallable.serialize_compile_artifacts(
        BundledAOTAutogradSerializableCallable(compiled))


def load_inductor(data: bytes) -> Callable:
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    with torch._inductor.config.patch(enable_autograd_for_aot=True):
        return BundledAOTAutogradSerializableCallable.deserialize_compile_artifacts(data)


@contextlib.contextmanager
def bundled_inductor_cache() -> Iterator[None]:
    """AOTAutograd's cache entries hold Inductor's compiled graph itself, so that a
    compile can be serialized with `bundled_inductor`."""
    with torch._functorch.config.patch(bundled_autograd_cache=True):
        yield


def _stored_base() -> type:
    from torch._dynamo.aot_compile_types import SerializableCallable

    return SerializableCallable


class Stored(_stored_base() if unsupported() is None else object):  # type: ignore[misc]
    """What a stored trace's bytecode calls in place of the compiled graph: `spec`
    (picklable) says how to build that graph again; `bind()` gives it the callable."""

    def __init__(self, spec: Any, target: Callable | None = None):
        self.spec = spec
        self.target = target

    def bind(self, target: Callable) -> None:
        self.target = target

    def __call__(self, *args: Any) -> Any:
        return self.target(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: Stored) -> bytes:
        return pickle.dumps(fn.spec)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> Stored:
        return cls(pickle.loads(data))
