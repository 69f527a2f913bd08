"""How a host graph replays each recorded op so that it writes where it wrote at capture.

One `Entry` per op that needs replaying (views and metadata changes need none):

- an op with an `out=` overload is replayed through it;
- in-place ops (`add_`, `index_put_`, `copy_`) run as they are;
- a non-aliasing `to`, `_to_copy`, `clone`, `reshape`, `contiguous` or `flatten` is
  a `copy_` into its output;
- a collective (`_c10d_functional.all_reduce`, ...) is issued, waited for and
  copied into its output, in one entry (`_Communicate`, see there);
- any other op is computed, then copied into its output: the only replays that
  allocate, counted in `HostGraph.copy_replays`.

An entry says both how the native tape (`native_tape.py`) calls it, an ATen overload
with its arguments, and how a Python replay does. The Python form uses torch's Python
binding (`torch.mm` for `aten.mm.out`, cheaper than the boxed call) when that provably
dispatches the same overload; that check is only made when the tape runs from Python.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .._compat import names
from .._compat.names import tensor_leaves, tree_map
from ..bindings import exact_binding
from ..kernels.collective import is_collective_op

# Factory arguments an out= overload takes from its `out` tensor instead.
_OPTIONS = frozenset({"dtype", "layout", "device", "pin_memory"})
# Ops whose non-aliasing result is `self`'s values in another dtype, device, layout or shape.
_COPIES = frozenset({"to", "_to_copy", "clone", "reshape", "contiguous", "flatten"})
# Ops that change a tensor object's metadata; their effect persists, replaying them would repeat it.
_METADATA = frozenset({"set_", "resize_", "resize_as_"})
_OUT_NAMESPACES, _INPLACE_NAMESPACES = names.OUT_NAMESPACES, names.INPLACE_NAMESPACES


@dataclass
class Entry:
    """One replayed op: `op(*args, **kwargs)` for the native tape (None: only Python can
    replay it), `python` = (callable, args, kwargs) for a Python replay. With `targets`,
    the op has no out= form: each return is copied into its target (None: not kept)."""

    python: tuple[Callable, tuple, dict]
    op: Any = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    targets: list[torch.Tensor | None] | None = None


def plan_entry(op: Any, args: tuple, kwargs: dict, result: Any, fresh: list[bool],
               placed: list[torch.Tensor], bindings: bool) -> Entry | None:
    """How to replay one recorded op (`fresh`: which of its tensor outputs are new
    memory); None when nothing needs replaying. A view the entry creates on the
    arena is appended to `placed`. `bindings`: look for Python bindings."""
    if torch.Tag.inplace_view in op.tags or op.overloadpacket.__name__ in _METADATA:
        return None
    outputs = tensor_leaves(result)
    if is_collective_op(op):
        return Entry((_Communicate(op, args, kwargs, _kept(outputs, fresh)), (), {}))
    if op._schema.is_mutable:
        fast = _binding(op, args, kwargs, kwargs, _INPLACE_NAMESPACES) if bindings else None
        return Entry((fast or op, args, kwargs), op, args, kwargs)
    if not any(fresh):
        return None
    if op.overloadpacket.__name__ in _COPIES and len(outputs) == 1:
        target = outputs[0] if outputs[0].shape == args[0].shape else outputs[0].view(args[0].shape)
        if target is not outputs[0]:
            placed.append(target)  # a new view on the arena: the pool must move it with the rest
        return Entry((target.copy_, (args[0],), {}), torch.ops.aten.copy_.default, (target, args[0]))
    found = _out_overload(op)
    if found is not None and all(fresh):
        out_op, out_names, dropped = found
        kept = {k: v for k, v in kwargs.items() if k not in dropped}
        values = list(result) if isinstance(result, tuple) else [result]
        op_kwargs = {**kept, **dict(zip(out_names, values))}
        call_kwargs = {**kept, "out": values[0] if len(values) == 1 else tuple(values)}
        fast = _binding(out_op, args, call_kwargs, op_kwargs, _OUT_NAMESPACES) if bindings else None
        return Entry((fast, args, call_kwargs) if fast else (out_op, args, op_kwargs), out_op, args, op_kwargs)
    recompute = _Recompute(op, args, kwargs, _kept(outputs, fresh))
    returns_tensors = all(str(r.type) == "Tensor" for r in op._schema.returns)
    return Entry((recompute, (), {}), op if returns_tensors else None, args, kwargs,
                 recompute.targets if returns_tensors else None)


def _kept(outputs: list[torch.Tensor], fresh: list[bool]) -> list[torch.Tensor | None]:
    return [t if new else None for t, new in zip(outputs, fresh)]


class _Recompute:
    """Replay of an op without an out= form: compute, then copy into the outputs captured."""

    def __init__(self, op: Any, args: tuple, kwargs: dict, targets: list[torch.Tensor | None]):
        self.op, self.args, self.kwargs, self.targets = op, args, kwargs, targets

    def __call__(self) -> None:
        for target, value in zip(self.targets, tensor_leaves(self.op(*self.args, **self.kwargs))):
            if target is not None:
                target.copy_(value)


class _Communicate(_Recompute):
    """Replay of a collective: issue it, wait for it, copy the result into the outputs captured.
    A functional collective fills its result later, at `wait_tensor`, whose result is not new
    memory and so has no entry: replayed as `_Recompute`, the copy read the result before it
    arrived. Waiting here gives up overlap of communication and compute, and never reuses a
    buffer still being communicated."""

    def __call__(self) -> None:
        for target, value in zip(self.targets, tensor_leaves(self.op(*self.args, **self.kwargs))):
            torch.ops._c10d_functional.wait_tensor(value)
            if target is not None:
                target.copy_(value)


def is_copy_replay(entry: Entry) -> bool:
    """An entry that computes into new memory, then copies: a replay that allocates."""
    return isinstance(entry.python[0], _Recompute)


@functools.cache
def _out_overload(op: Any) -> tuple[Any, tuple[str, ...], frozenset[str]] | None:
    """The out= overload computing `op`: same arguments (less factory options such as
    dtype, which the out tensor carries), one `out` argument per return.
    Returns (overload, out argument names, dropped argument names)."""
    arguments = op._schema.arguments
    for name in op.overloadpacket.overloads():
        candidate = getattr(op.overloadpacket, name)
        outs = [a.name for a in candidate._schema.arguments if a.is_out]
        rest = [a for a in candidate._schema.arguments if not a.is_out]
        if not outs or len(outs) != len(op._schema.returns):
            continue
        kept = {a.name for a in rest}
        dropped = [a for a in arguments if a.name not in kept]
        if any(a.name not in _OPTIONS or not a.kwarg_only for a in dropped):
            continue
        signature = [(a.name, str(a.type), a.kwarg_only) for a in arguments if a.name in kept]
        if signature == [(a.name, str(a.type), a.kwarg_only) for a in rest]:
            return candidate, tuple(outs), frozenset(a.name for a in dropped)
    return None


def _binding(op: Any, args: tuple, call_kwargs: dict, op_kwargs: dict, namespaces: tuple) -> Callable | None:
    """torch's Python binding of `op` (e.g. `torch.mm` for `aten.mm.out`) when it
    dispatches exactly `op` with these arguments, checked on meta tensors."""
    metas: dict[int, torch.Tensor] = {}

    def meta(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in metas:
            metas[id(x)] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return metas[id(x)]

    args, call_kwargs, op_kwargs = tree_map(meta, (args, call_kwargs, op_kwargs))
    return exact_binding(op, args, call_kwargs, op_kwargs, namespaces)
