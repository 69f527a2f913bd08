"""Names for the objects a stored trace's identity guards compare, that a later
process finds again and compares:

    a module                  -> "module torch"
    a function                -> "function <module>.<qualname> <digest of its code>"
    a class                   -> "class torch.nn.modules.linear.Linear"
    a class made in a function (kernels' `Func`, one per function it wraps)
                              -> "class <module>.<factory>.<locals>.Func <digest of its
                                  methods' code and what their closures hold>"
    an object its module names and that pickles by that name (kernels' function
    module `apply_rotary_pos_emb`)
                              -> "global <module>.<name> <its class's identity>"
"""

from __future__ import annotations

import enum
import hashlib
import sys
import types
from typing import Any

import torch

from .._compat import traces as dynamo_traces


def recognised(value: Any) -> str | None:
    """identity(), or for a plain constant (a string, a number, a tuple of them) its repr."""
    return identity(value) or (constant_identity(value) if is_constant(value) else None)


def is_constant(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(is_constant(item) for item in value)
    return value is None or isinstance(value, (bool, int, float, str, bytes))


def constant_identity(value: Any) -> str:
    return f"constant {type(value).__name__} {value!r}"


def identity(value: Any) -> str | None:
    """A name for an object that a later process can find again and compare: a
    module by name, a class, enum member, torch op or builtin by qualified name, a
    function or code object by its code, None and the bools as themselves. None for
    objects that have no such name."""
    if value is None or value is Ellipsis or isinstance(value, bool):
        return f"constant {value!r}"
    if isinstance(value, enum.Enum):
        return f"enum {qualified(type(value))}.{value.name}"
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if (op := dynamo_traces.op_name(value)) is not None:
        return f"op {op}"
    if isinstance(value, types.CodeType):
        return f"code {_code_digest(value)}"
    if isinstance(value, types.FunctionType):
        return f"function {qualified(value)} {_code_digest(value.__code__)}"
    if isinstance(value, type):
        return _local_class(value) if "<locals>" in value.__qualname__ else f"class {qualified(value)}"
    if isinstance(value, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                          types.MethodWrapperType, types.ClassMethodDescriptorType)):
        owner = getattr(value, "__self__", None)
        owner = owner.__name__ if isinstance(owner, types.ModuleType) else qualified(type(owner))
        return f"builtin {getattr(value, '__module__', None) or owner}.{value.__qualname__}"
    return _named_global(value)


def _named_global(value: Any) -> str | None:
    """An object that pickles as a global of its module (its `__reduce__` returns the
    name, as kernels' function modules do), while its module holds it under that name."""
    if type(value).__reduce__ is object.__reduce__ or isinstance(value, torch.Tensor):
        return None
    try:
        name, module = value.__reduce__(), value.__module__
        named = isinstance(name, str) and getattr(sys.modules.get(module), name, None) is value
    except Exception:  # noqa: BLE001 - an object that does not say its name has none
        return None
    kind = identity(type(value)) if named else None
    return f"global {module}.{name} {kind}" if kind else None


def _local_class(cls: type) -> str | None:
    """A class made inside a function (kernels' `Func`, one per function it wraps, in
    transformers' attention) is found by no name in a later process: recognised by
    its qualified name and what its own methods are, their code and the objects their
    closures hold; None where one of those has no identity()."""
    parts = [identity(base) for base in cls.__bases__]
    for name, member in sorted(vars(cls).items()):
        if isinstance(member, types.FunctionType):
            cells = [_cell(cell, cls) for cell in member.__closure__ or ()]
            parts += [f"{name} {_code_digest(member.__code__)}", *cells]
    if None in parts:
        return None
    return f"class {qualified(cls)} {hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}"


def _cell(cell: types.CellType, cls: type) -> str | None:
    try:
        contents = cell.cell_contents
    except ValueError:  # a name the function binds later
        return "empty cell"
    return "the class" if contents is cls else identity(contents)  # `__class__`, for super()


def _code_digest(code: types.CodeType) -> str:
    """What a code object does, where it was written: equal for a copy torch rebuilt
    from a stored trace (marshal's bytes are not)."""
    digest = hashlib.sha256()
    for part in (code.co_filename, code.co_name, str(code.co_firstlineno), *code.co_names, *code.co_varnames):
        digest.update(part.encode() + b"\0")
    digest.update(code.co_code)
    for const in code.co_consts:
        digest.update((_code_digest(const) if isinstance(const, types.CodeType) else repr(const)).encode() + b"\0")
    return digest.hexdigest()[:16]


def qualified(value: Any) -> str:
    return f"{getattr(value, '__module__', None) or '?'}.{getattr(value, '__qualname__', type(value).__name__)}"
