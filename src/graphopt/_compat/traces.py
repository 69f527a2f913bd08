"""Dynamo's stored traces (`torch._dynamo.aot_compile`), for `graphopt/traces.py`.

A trace is what Dynamo makes of one call of a step: the frame's rewritten bytecode,
its guards and the compiled graph it calls. `trace()` makes one without running the
step; `dumps()` / `loads()` carry it to another process, where `guards_pass()` and
`run()` use it without Dynamo tracing again. Guards Dynamo cannot store (object
identities) are handed to the caller's filter, which keeps its own record of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import sys
import types
from typing import Any, Callable, Iterator

import torch


def unsupported() -> str | None:
    """Why this torch cannot store traces, or None when it can."""
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction, CompileArtifacts  # noqa: F401
        from torch._dynamo.aot_compile_types import SerializableCallable  # noqa: F401
    except ImportError as error:
        return f"torch {torch.__version__} has no torch._dynamo.aot_compile ({error})"
    from torch._dynamo import convert_frame

    if not all(hasattr(convert_frame, name) for name in ("fullgraph_capture", "get_traced_fn", "_get_signature",
                                                         "preserve_global_state")):
        return f"torch {torch.__version__}'s Dynamo lacks fullgraph_capture"
    if not all(hasattr(AOTCompiledFunction, name) for name in ("serialize", "deserialize", "guard_check",
                                                                 "prepare_f_locals", "disable_guard_check")):
        return f"torch {torch.__version__}'s AOTCompiledFunction lacks the methods graphopt uses"
    return None


def unstorable_guard_types() -> frozenset[str]:
    """Guard types Dynamo cannot store: they compare object identities."""
    from torch._dynamo.guards import CheckFunctionManager

    return frozenset(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)


def traced_function(fn: Callable) -> tuple[Callable, Any] | None:
    """(the function Dynamo traces for `fn`, the object bound as its first argument
    or None): an nn.Module's forward with the module, a bound method with its self.
    None for a module whose call is more than its forward (a custom `__call__`, a
    forward that is not its own method), which only Dynamo's dispatch runs whole."""
    if isinstance(fn, torch.nn.Module):
        forward = fn.forward
        if type(fn).__call__ is not torch.nn.Module.__call__ or not inspect.ismethod(forward) or \
                forward.__self__ is not fn:
            return None
        return forward.__func__, fn
    if inspect.ismethod(fn):
        return fn.__func__, fn.__self__
    return fn, None


def trace(fn: Callable, args: tuple, kwargs: dict, backend: Callable,
          keep_guards: Callable[[list], list[bool]]) -> tuple[Any, str | None]:
    """Trace `fn(*args, **kwargs)` as one graph, without running it, and compile the
    graph with `backend` as torch.compile would. `keep_guards(entries)` says which
    guards the trace keeps (an entry: Dynamo's GuardFilterEntry, with `.name`,
    `.value`, `.guard_type`). Returns (the trace, why it cannot be stored or None): a trace
    whose guards cannot be stored still runs in this process, every guard checked.

    torch's own `aot_compile_fullgraph`, step by step, for two differences: the
    backend compiles under the caller's AOTAutograd settings (aot_compile's are for
    Inductor alone), and guards that cannot be stored cost the storing, not the trace.
    """
    from torch._dynamo import convert_frame
    from torch._dynamo.aot_compile import AOTCompiledFunction, CompileArtifacts
    from torch._dynamo.hooks import Hooks
    from torch._dynamo.package import SourceInfo
    from torch._dynamo.utils import dynamo_timed, get_metrics_context
    from torch._dynamo.variables.torch_function import torch_function_mode_stack_state_mgr

    hooks = Hooks(guard_filter_fn=keep_guards)
    with get_metrics_context(), dynamo_timed("fullgraph_capture"), torch_function_mode_stack_state_mgr:
        capture = convert_frame.fullgraph_capture(fn, args, kwargs)
        output = capture.graph_capture_output
        traced_fn, _ = convert_frame.get_traced_fn(fn)
        backend_input = capture.backend_input
        context = torch._guards.TracingContext(backend_input.fake_mode)
        context.tensor_to_context = backend_input.tensor_to_context
        # As Dynamo compiles: outside inference mode, the global state restored after.
        compile_graph = convert_frame.preserve_global_state(backend)
        with torch._guards.tracing(context):
            compiled = compile_graph(backend_input.graph_module, backend_input.example_inputs)
        with contextlib.ExitStack() as restored:
            if torch_function_mode_stack_state_mgr.stack:
                restored.enter_context(torch_function_mode_stack_state_mgr.temp_restore_stack())
            try:
                with _quiet("torch._guards"):  # a guard that cannot be stored is reported in `why`
                    check = output.build_guards(traced_fn.__code__, hooks=hooks, save=True, strict_error=True)
                why = None
            except Exception as error:  # noqa: BLE001 - a guard or value pickle refuses: kept, not stored
                check = output.build_guards(traced_fn.__code__, hooks=hooks, save=False)
                why = f"{type(error).__name__}: {error}"
        sources = SourceInfo(inlined_sources=set())
        for code in output.traced_code:
            sources.add_code(code)
        runtime = output.get_runtime_env()
        # Modules the bytecode reads under names Dynamo made up for this process
        # (`___module_collections_<id>`): carried as modules, found again by name.
        runtime.used_globals.update({ref: traced_fn.__globals__[ref] for ref in runtime.external_refs
                                     if isinstance(traced_fn.__globals__.get(ref), types.ModuleType)})
        artifacts = CompileArtifacts(
            signature=convert_frame._get_signature(traced_fn), guard_manager=check.guard_manager,
            guards_state=check.guards_state, backend_id=backend_input.backend_id, compiled_fn=compiled,
            original_code=traced_fn.__code__, runtime_env=runtime, source_info=sources,
            device_type=_device_type(backend_input.graph_module.graph), backend_name="graphopt")
        traced = AOTCompiledFunction(_artifacts=artifacts, _extra_globals=traced_fn.__globals__)
        _read_globals_live(traced, traced_fn.__globals__)
        return traced, why


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def _device_type(graph: torch.fx.Graph) -> str:
    from torch._dynamo import graph_utils

    if hasattr(graph_utils, "_graph_device_type"):
        return graph_utils._graph_device_type(graph)
    from torch._dynamo.package import _collapse_device_types

    return _collapse_device_types(graph_utils._graph_device_types(graph))


def compile_lock() -> Any:
    """The lock Dynamo holds while it compiles a frame (a reentrant lock)."""
    from torch._dynamo import convert_frame

    return convert_frame.compile_lock


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
    """Hooks on `module` or on every module: they run around the traced forward."""
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
                or module._backward_hooks or torch.nn.modules.module._has_any_global_hook())


def op_name(value: Any) -> str | None:
    """`namespace::op` for a torch op or op overload (`torch.ops.aten.add`), else None."""
    if isinstance(value, torch._ops.OpOverloadPacket):
        return value._qualified_op_name
    if isinstance(value, torch._ops.OpOverload):
        return value.name()
    return None


def dumps(traced: Any) -> bytes:
    from torch._dynamo import aot_compile

    with _functions_by_code(aot_compile):
        return aot_compile.AOTCompiledFunction.serialize(traced).serialized_data


@contextlib.contextmanager
def _functions_by_code(aot_compile: Any) -> Iterator[None]:
    """Before torch 2.15 a trace cannot hold a function its module does not name
    (the one a decorator wraps, such as transformers' forwards): pickle those by
    their code, as torch does for local functions."""
    if FunctionsByCodePickler is None:
        yield
        return
    base = aot_compile.AOTCompilePickler
    aot_compile.AOTCompilePickler = FunctionsByCodePickler
    try:
        yield
    finally:
        aot_compile.AOTCompilePickler = base


def _functions_by_code_pickler() -> type | None:
    from torch._dynamo import aot_compile

    if hasattr(aot_compile, "FunctionPicklerBase") or not hasattr(aot_compile, "AOTCompilePickler"):
        return None

    class FunctionsByCodePickler(aot_compile.AOTCompilePickler):
        def reducer_override(self, obj: Any) -> Any:
            if inspect.isfunction(obj) and _found_by_name(obj) is not obj:
                return type(self)._unpickle_nested_function, (obj.__code__, obj.__module__, obj.__qualname__,
                                                             obj.__defaults__, obj.__closure__)
            return super().reducer_override(obj)

    # The base pickles some objects as `type(self)._unpickle_...`: found again at module level.
    FunctionsByCodePickler.__qualname__ = FunctionsByCodePickler.__name__
    return FunctionsByCodePickler


def _found_by_name(fn: Callable) -> Any:
    try:
        return functools.reduce(getattr, fn.__qualname__.split("."), importlib.import_module(fn.__module__))
    except (ImportError, AttributeError):
        return None


def loads(data: bytes, fn: Callable) -> Any:
    """A trace of `fn` from `dumps`, its guards built now (under the caller's grad
    and inference modes), checked by `guards_pass` rather than on every call. It
    reads `fn`'s closure, not the copy stored with it (a decorator's wrapped
    function, rebuilt from its code, is not the one the guards saw); its global
    guards read `fn`'s globals live where this torch can (2.15 and later)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    module_globals = fn.__globals__
    live_scope = {"guard_globals": module_globals} if live_global_guards() else {}
    with _quiet("torch._guards"):  # a guard that cannot be built reaches the caller as its exception
        traced = AOTCompiledFunction.deserialize(data, module_globals, **live_scope)
    traced.disable_guard_check()
    artifacts = traced._artifacts
    artifacts.runtime_env = dataclasses.replace(artifacts.runtime_env, closure=fn.__closure__)
    _read_globals_live(traced, module_globals)
    return traced


class _LiveGlobals(dict):
    """The globals of a trace's bytecode: its own names (the compiled graph, Dynamo's
    module aliases), then the module's globals as they are at each read, as the
    traced function reads them. torch builds them as a copy of the module's."""

    def __init__(self, own: dict[str, Any], module_globals: dict[str, Any]):
        super().__init__(own)
        self.module_globals = module_globals

    def __missing__(self, name: str) -> Any:
        return self.module_globals[name]


def _read_globals_live(traced: Any, module_globals: dict[str, Any]) -> None:
    env = traced._artifacts.runtime_env
    own = {**{alias: importlib.import_module(name) for alias, name in env.import_sources.items()},
           **{name: value for name, value in env.used_globals.items() if name not in module_globals},
           traced._artifacts.backend_id: traced._artifacts.compiled_fn,
           "__builtins__": module_globals.get("__builtins__", __builtins__)}
    fn = types.FunctionType(env.bytecode, _LiveGlobals(own, module_globals), closure=env.closure,
                            argdefs=env.argdefs)
    fn.__kwdefaults__ = env.kwdefaults
    traced.fn = fn


def trace_graph_of(traced: Any) -> Any:
    """The `TraceGraph` the trace's bytecode calls."""
    return traced._artifacts.compiled_fn


def frame_binder(fn: Callable) -> Callable[[tuple, dict], dict[str, Any]]:
    """(args, kwargs) -> the locals a trace of `fn` checks its guards on: what
    `AOTCompiledFunction.prepare_f_locals` builds (closure cells, then the bound
    arguments), without `inspect`'s binding for a plain positional call, which
    costs more than the guards themselves."""
    signature = inspect.signature(fn, follow_wrapped=False)  # as Dynamo's _get_signature
    names = tuple(signature.parameters)
    plain = all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in signature.parameters.values())
    cells = tuple(zip(fn.__code__.co_freevars, fn.__closure__ or ()))

    def bind(args: tuple, kwargs: dict) -> dict[str, Any]:
        frame = {name: cell.cell_contents for name, cell in cells}
        if plain and not kwargs and len(args) == len(names):
            frame.update(zip(names, args))
        else:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            frame.update(bound.arguments)
        return frame

    return bind


def guards_pass(traced: Any, frame: dict[str, Any]) -> bool:
    """Whether the trace's stored guards pass for a call (`frame`: `frame_locals`)."""
    return bool(traced._artifacts.guard_manager.check(frame))


def run(traced: Any, args: tuple, kwargs: dict) -> Any:
    """The trace's bytecode on a call whose guards `guards_pass` passed (torch's own
    `__call__` would check them again)."""
    return traced.fn(*args, **kwargs)


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


def guard_helpers() -> dict[str, Any]:
    """The helpers Dynamo's guard sources call (`___odict_getitem`, ...), by name."""
    from torch._dynamo.guards import _get_closure_vars

    return _get_closure_vars()


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


FunctionsByCodePickler = _functions_by_code_pickler()
