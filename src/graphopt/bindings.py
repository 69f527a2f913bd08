"""torch's fast Python bindings for ATen overloads, used only where provably the same call.

Calling `torch.ops.aten.mm.default(a, b)` goes through the boxed operator path, several
times slower than `torch.mm(a, b)`, the binding eager code uses (docs/design.md, "The
replayed call").
Level 1's FX code and the host graph's replay tape call hundreds of small ops per step,
so both use the binding, but only when calling it dispatches exactly one op, that
overload, with exactly the same arguments. That is checked once per argument
structure, on fake or meta tensors.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch

from ._compat.names import OpOverload, TorchDispatchMode

# (overload, argument structures, namespaces) -> binding or None
_decisions: dict[tuple, Callable | None] = {}


def exact_binding(op: OpOverload, args: tuple, call_kwargs: dict, op_kwargs: dict,
                  namespaces: tuple, mode: ContextManager | None = None) -> Callable | None:
    """A binding `b` of `op` from `namespaces` such that `b(*args, **call_kwargs)`
    dispatches exactly `op(*args, **op_kwargs)`, or None. `args` are fake or meta
    tensors (run under `mode`, e.g. their FakeTensorMode); nothing real runs."""
    key = (op, structure(args), structure(call_kwargs), namespaces)
    if key not in _decisions:
        name = op._schema.name.split("::")[-1]
        candidates = [getattr(ns, name) for ns in namespaces if hasattr(ns, name)]
        _decisions[key] = next((b for b in candidates
                                if _calls_exactly(b, op, args, call_kwargs, op_kwargs, mode)), None)
    return _decisions[key]


class _Dispatches(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _calls_exactly(binding: Callable, op: Any, args: tuple, call_kwargs: dict, op_kwargs: dict,
                   mode: ContextManager | None) -> bool:
    dispatches = _Dispatches()
    try:
        with mode if mode is not None else contextlib.nullcontext(), dispatches:
            binding(*args, **call_kwargs)
    except Exception:  # noqa: BLE001 - a binding that cannot take these arguments is simply not used
        return False
    # FakeTensor asks for metadata (prim.device) while it checks a view: not a computation.
    calls = [call for call in dispatches.calls if call[0].namespace != "prim"]
    return len(calls) == 1 and calls[0][0] is op and _same(calls[0][1:], (args, op_kwargs))


def _same(a: Any, b: Any) -> bool:
    """Equal arguments: the same tensor objects, equal values of the same type."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr  # `==` on SymInts would add a guard
    return type(a) is type(b) and a == b


def structure(value: Any) -> Any:
    """What decides a binding's overload and argument mapping: argument kinds, not
    values (except dtypes and the like, which can pick overloads)."""
    if isinstance(value, torch.Tensor):
        return "T"
    if isinstance(value, (list, tuple)):
        return tuple(structure(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, structure(v)) for k, v in value.items())
    return value if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)) \
        else type(value).__name__
