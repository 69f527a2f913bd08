"""Dynamo's stored traces on torch's precompile API, for `graphopt/traces.py`.

A trace is what Dynamo makes of one call of a step: the frame's rewritten bytecode,
its guards and the compiled graph it calls. `trace()` makes one without running the
step (`torch.compile(fn, fullgraph=True, ...).aot_compile(...)`); `dumps()` / `loads()`
carry it to another process (`torch.compiler.load_compiled_function`), where
`guards_pass()` and `runnable()` use it without Dynamo tracing again. Guards Dynamo cannot
store (object identities) go to the caller's filter, which keeps its own record.

graphopt's own code, for what torch's does not do:
- the backend compiles under the caller's AOTAutograd settings, not those
  `aot_compile` sets for Inductor (with those, level 1 fails: "expected OutputCode");
- `dumps` gives bytes for the compile cache (`AOTCompiledFunction.serialize`, which
  `save_compiled_function` writes to a file), and before torch 2.15 pickles the
  functions a module does not name (a decorator's wrapped one) by their code;
- a loaded trace reads `fn`'s live closure, and its bytecode reads the module's
  globals as they are at each call (`_read_globals_live`): torch's read copies;
- a call checks the guards once (`guards_pass`), not again in `__call__`;
- `changed_source`: torch stores the inlined functions' source hashes, checks none.
- a trace is made with the gradients of the call's tensors set aside: torch stores
  a guarded tensor's `.grad` as a placeholder its loader rejects;
- a trace carries the builtins its bytecode reads, which torch 2.11 leaves out and
  then refuses the trace for;
torch's own behaviour kept: a kept guard it cannot store (a dict's version) fails
`aot_compile`, and Dynamo's dispatch traces the step again, once (docs/compile-cache.md,
"What is not stored"; no step in graphopt's tests has such a guard).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import importlib
import inspect
import io
import logging
import sys
import types
from typing import Any, Callable, Iterator

import torch


def unsupported() -> str | None:
    """Why this torch cannot store traces, or None when it can."""
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction
        from torch._dynamo.aot_compile_types import SerializableCallable  # noqa: F401
    except ImportError as error:
        return f"torch {torch.__version__} has no torch._dynamo.aot_compile ({error})"
    if not hasattr(torch.compiler, "load_compiled_function") or not all(
            hasattr(AOTCompiledFunction, name) for name in ("serialize", "disable_guard_check")):
        return f"torch {torch.__version__} lacks the precompile API graphopt uses"
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


def trace(fn: Callable, args: tuple, kwargs: dict, backend: Callable, keep_guards: Callable[[list], list[bool]]) -> Any:
    """Trace `fn(*args, **kwargs)` as one graph, without running it, with torch's
    `aot_compile`, the graph compiled by `backend` as torch.compile would (outside
    inference mode, the global state restored after). `keep_guards(entries)` says
    which guards the trace keeps (an entry: Dynamo's GuardFilterEntry, with `.name`,
    `.value`, `.guard_type`). Raises where the step is not one graph, or where a kept
    guard cannot be stored."""
    from torch._dynamo import convert_frame

    # aot_compile sets AOTAutograd's cache settings for Inductor around the backend
    # (strict_autograd_cache raises on graphopt's level-1 compile): the caller's apply.
    settings = {name: getattr(torch._functorch.config, name) for name in _AOT_COMPILE_SETTINGS
                if hasattr(torch._functorch.config, name)}

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        with torch._functorch.config.patch(settings):
            return convert_frame.preserve_global_state(backend)(gm, example_inputs)

    # Off by default before torch 2.13; a torch without the switch has the API on.
    switch = {"enable_aot_compile": True} if hasattr(torch._dynamo.config, "enable_aot_compile") else {}
    with torch._dynamo.config.patch(switch):
        compiled = torch.compile(fn, fullgraph=True, backend=compile_graph, options={"guard_filter_fn": keep_guards})
    with _quiet("torch._guards"), _gradients_set_aside(args, kwargs), _builtins_carried():
        traced = compiled.aot_compile((args, kwargs))
    # Modules the bytecode reads under names Dynamo made up for this process
    # (`___module_collections_<id>`): carried as modules, found again by name.
    env = traced._artifacts.runtime_env
    env.used_globals.update({ref: fn.__globals__[ref] for ref in env.external_refs
                             if isinstance(fn.__globals__.get(ref), types.ModuleType)})
    _read_globals_live(traced, fn.__globals__)
    return traced


@contextlib.contextmanager
def _builtins_carried() -> Iterator[None]:
    """The builtins a trace's bytecode reads carried with it, as torch 2.13 does: torch
    2.11 leaves them out, then refuses a trace that reads a name its globals lack
    (`type`, which kernels' function modules in transformers 5.25 read). Nothing is
    patched on a torch that carries them."""
    from torch._dynamo import convert_frame

    capture = getattr(convert_frame, "GraphCaptureOutput", None)
    base = getattr(capture, "get_runtime_env", None)
    # torch 2.13's get_runtime_env carries them itself (beside its _safe_builtins_dict).
    if base is None or hasattr(convert_frame, "_safe_builtins_dict"):
        yield
        return

    def get_runtime_env(self: Any) -> Any:
        env = base(self)
        env.used_globals.update({ref: getattr(builtins, ref) for ref in env.external_refs
                                 if ref not in env.used_globals and hasattr(builtins, ref)})
        return env

    capture.get_runtime_env = get_runtime_env
    try:
        yield
    finally:
        capture.get_runtime_env = base


@contextlib.contextmanager
def _gradients_set_aside(args: tuple, kwargs: dict) -> Iterator[None]:
    """The `.grad` of the call's tensors and its modules' parameters set to None
    while the trace is made: torch stores a guarded tensor's gradient as a value it
    cannot load back ("assigned grad expected to be a Tensor"). A step that reads
    a gradient guards on it, fails that guard when called, and so is traced again
    until it goes to Dynamo's dispatch: slow, never wrong."""
    grads = [(tensor, tensor.grad) for tensor in call_tensors(args, kwargs) if tensor.grad is not None]
    for tensor, _ in grads:
        tensor.grad = None
    try:
        yield
    finally:
        for tensor, grad in grads:
            tensor.grad = grad


def call_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a call passes, and the parameters of the modules it passes."""
    values = (*args, *kwargs.values())
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    for module in (value for value in values if isinstance(value, torch.nn.Module)):
        tensors.extend(module.parameters())
    return tensors


_AOT_COMPILE_SETTINGS = ("strict_autograd_cache", "bypass_autograd_cache_key", "bundled_autograd_cache",
                         "force_non_lazy_backward_lowering", "force_autograd_cache")


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


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
    with _quiet("torch._guards"):  # a guard that cannot be built reaches the caller as its exception
        if live_global_guards():  # torch's public loader does not take `guard_globals`
            traced = AOTCompiledFunction.deserialize(data, module_globals, guard_globals=module_globals)
        else:
            traced = torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=module_globals)
    traced.disable_guard_check()
    artifacts = traced._artifacts
    if not _through_wrapper(traced, fn):
        artifacts.runtime_env = dataclasses.replace(artifacts.runtime_env, closure=fn.__closure__)
    _read_globals_live(traced, module_globals)
    return traced


def _through_wrapper(traced: Any, fn: Callable) -> bool:
    """Whether torch traced `fn` through a wrapper of its own (`wrap_inline`, for a
    function in torch's files such as `nn.Sequential.forward`): the trace's frame is
    the wrapper's `(*args, **kwargs)`, its closure holds `fn` itself."""
    return traced._artifacts.original_code.co_qualname != fn.__code__.co_qualname


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


def frame_binder(traced: Any) -> Callable[[tuple, dict], dict[str, Any]]:
    """(args, kwargs) -> the locals a trace checks its guards on: what
    `AOTCompiledFunction.prepare_f_locals` builds (closure cells, then the bound
    arguments), without `inspect`'s binding for a plain positional call or the
    `(*args, **kwargs)` of torch's wrapper, which costs more than the guards."""
    signature = traced._artifacts.signature
    env = traced._artifacts.runtime_env
    cells = tuple(zip(env.bytecode.co_freevars, env.closure or ()))
    parameters = tuple(signature.parameters.values())
    names = tuple(p.name for p in parameters)
    plain = all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in parameters)
    starred = tuple(p.kind for p in parameters) == (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)

    def bind(args: tuple, kwargs: dict) -> dict[str, Any]:
        frame = {name: cell.cell_contents for name, cell in cells}
        if starred:
            frame[names[0]], frame[names[1]] = args, kwargs
        elif plain and not kwargs and len(args) == len(names):
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


def runnable(traced: Any) -> Callable:
    """The trace's bytecode as a function, to call where `guards_pass` passed (torch's
    own `__call__` would check them again)."""
    return traced.fn


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


FunctionsByCodePickler = _functions_by_code_pickler()
