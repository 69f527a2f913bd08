"""What a user callable decides, as text for cache keys (`register_replacement`'s
search, replacement and `extra_check` functions): two processes share a fingerprint
only where the callable decides the same, so a changed `extra_check` misses the cache.
What cannot be captured raises Unkeyable: such a rewrite's graphs are not stored."""

from __future__ import annotations

import dis
import enum
import functools
import os
import sys
import sysconfig
import types
from typing import Any, Callable

import torch

from ..._compat.names import OpOverload, OpOverloadPacket


def fingerprint(value: Any) -> str:
    return _fingerprint(value, {}, 0)


class Unkeyable(Exception):
    """A pattern reads something no cache key can capture (`_fingerprint`): graphs
    are then not stored, since a wrong hit would apply a rewrite the pattern vetoes."""


_STDLIB = sysconfig.get_paths()["stdlib"]
_EXACT = (type(None), type(Ellipsis), bool, int, float, complex, str, bytes, range, slice,
          torch.dtype, torch.device, torch.layout, torch.memory_format)   # repr() is the value
_BUILTIN = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
            types.MethodWrapperType, types.ClassMethodDescriptorType)
_MAX_DEPTH = 8
_MISSING = object()


def _fingerprint(value: Any, seen: dict[int, int], depth: int) -> str:
    """`value` as text that two processes share only where the value decides the
    same: plain data by repr, what a `_versioned` module defines by name, functions
    by their code and what it reads, objects by class and `vars()`. Anything else
    raises Unkeyable: its repr may hold an address, which another process may reuse
    for another object. `seen` numbers the functions, classes and objects met so far,
    for cycles; each is alive during the walk, so no id in it is reused."""
    if isinstance(value, _EXACT):
        return repr(value)
    if depth > _MAX_DEPTH:
        raise Unkeyable(f"values nested more than {_MAX_DEPTH} deep")
    named = _versioned_name(value)
    if named is not None:
        return named

    def inner(item: Any) -> str:
        return _fingerprint(item, seen, depth + 1)

    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(map(inner, value))})"
    if isinstance(value, (set, frozenset)):  # sorted: a set's order changes with the hash seed
        return f"{type(value).__name__}({', '.join(sorted(map(inner, value)))})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{inner(k)}: {inner(v)}" for k, v in value.items()) + "}"
    if isinstance(value, enum.Enum):
        return f"enum {type(value).__module__}.{type(value).__qualname__}.{value.name}={inner(value.value)}"
    if isinstance(value, types.ModuleType):  # not _versioned: what a function reads of it is keyed in `_read`
        raise Unkeyable(f"module {value.__name__} other than as a function's global or import")
    if isinstance(value, torch.Tensor):
        raise Unkeyable("a tensor")
    if id(value) in seen:
        return f"<#{seen[id(value)]}>"
    seen[id(value)] = len(seen)
    return _callable_or_object(value, inner)


def _callable_or_object(value: Any, inner: Callable[[Any], str]) -> str:
    """What `_fingerprint` keys by its parts, each keyed by `inner`."""
    if isinstance(value, types.FunctionType):
        return _function(value, inner)
    if isinstance(value, functools.partial):
        return f"partial {inner(value.func)} {inner(value.args)} {inner(value.keywords)}"
    if isinstance(value, (types.MethodType, staticmethod, classmethod)):
        return f"{type(value).__name__} {inner(value.__func__)} of {inner(getattr(value, '__self__', None))}"
    if isinstance(value, property):
        return f"property {inner(value.fget)} {inner(value.fset)} {inner(value.fdel)}"
    if isinstance(value, _BUILTIN):  # C code: by name and what it is bound to
        owner = getattr(value, "__self__", None)
        owner = getattr(value, "__objclass__", None) if owner is None else owner
        return f"builtin {value.__qualname__} of {inner(owner)}"
    if isinstance(value, type):
        return _class(value, inner)
    if hasattr(value, "__dict__"):  # a callable object's __call__ is its class's
        return f"object {inner(type(value))} {inner(vars(value))}"
    raise Unkeyable(f"a {type(value).__module__}.{type(value).__qualname__} object")


def _versioned_name(value: Any) -> str | None:
    """A function, class or op of a `_versioned` module, by name: its code is its version's."""
    if isinstance(value, (OpOverload, OpOverloadPacket)):  # torch.ops.aten.silu(.default): the op's name
        return f"op {value}"
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}" if _versioned(value.__name__) else None
    if not isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return None
    module = getattr(value, "__module__", None) or ""
    return f"{module}.{value.__qualname__}" if _versioned(module) else None


def _versioned(module: str) -> bool:
    """Whether every cache key names the version of `module`: torch, graphopt, or
    Python's own (built in or a file of its library, not a namesake elsewhere)."""
    if module.split(".")[0] in ("torch", "graphopt") or module in sys.builtin_module_names:
        return True
    file = getattr(sys.modules.get(module), "__file__", None) or "/"
    relative = os.path.relpath(file, _STDLIB)
    return not relative.startswith("..") and relative.split(os.sep)[0] not in ("site-packages", "dist-packages")


def _function(fn: types.FunctionType, inner: Callable[[Any], str]) -> str:
    """A Python function: its code and what decides with it that the code does not
    hold: captured cells, default arguments, and the globals and modules it names
    (a helper's code, a flag's value, `settings.FLAG`)."""
    names = _names(fn.__code__)
    cells = ", ".join(_cell(cell, names, inner) for cell in fn.__closure__ or ())
    found = {name: fn.__globals__.get(name, sys.modules.get(name, _MISSING)) for name in sorted(_loads(fn.__code__))}
    reads = ", ".join(f"{name}={_read(value, names, inner)}" for name, value in found.items() if value is not _MISSING)
    return (f"function {fn.__module__}.{fn.__qualname__} {_code_parts(fn.__code__, inner)!r} cells ({cells}) "
            f"defaults {inner(fn.__defaults__)} {inner(fn.__kwdefaults__)} reads ({reads})")


def _read(value: Any, names: set[str], inner: Callable[[Any], str], within: tuple[str, ...] = ()) -> str:
    """What a function reads through a global, a cell or an `import`: a module that
    is not `_versioned`, by what it holds under the names the function uses."""
    if not isinstance(value, types.ModuleType) or _versioned(value.__name__):
        return inner(value)
    if value.__name__ in within:
        return f"module {value.__name__}"
    attributes, within = vars(value), (*within, value.__name__)
    return f"module {value.__name__} (" + ", ".join(
        f"{name}={_read(attributes[name], names, inner, within)}" for name in sorted(names) if name in attributes) + ")"


def _names(code: types.CodeType) -> set[str]:
    """The global, module and attribute names `code` and the functions nested in it use."""
    return set(code.co_names).union(*(_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def _loads(code: types.CodeType) -> set[str]:
    """The globals `code` and the functions nested in it load, and the modules they import."""
    loads = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME", "IMPORT_NAME")}
    return loads.union(*(_loads(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def _code_parts(code: types.CodeType, inner: Callable[[Any], str]) -> tuple:
    consts = tuple(_code_parts(c, inner) if isinstance(c, types.CodeType) else inner(c) for c in code.co_consts)
    return (code.co_code, consts, code.co_names, code.co_flags, getattr(code, "co_exceptiontable", b""))


def _cell(cell: Any, names: set[str], inner: Callable[[Any], str]) -> str:
    try:
        contents = cell.cell_contents
    except ValueError:  # not assigned yet: a function that refers to itself, being defined
        return "<empty>"
    return _read(contents, names, inner)


def _class(cls: type, inner: Callable[[Any], str]) -> str:
    """A class by name and what its own code sets along its bases: methods and class
    attributes. Dunder entries but `__call__` are left out: Python and decorators
    (dataclass) write them, and they rarely decide a match."""
    parts = []
    for klass in cls.__mro__:
        name = _versioned_name(klass)
        parts += [name] if name is not None else [f"{key}={inner(value)}" for key, value in vars(klass).items()
                                                  if key == "__call__" or not key.startswith("__")]
    return f"class {cls.__module__}.{cls.__qualname__} ({', '.join(parts)})"
