"""One copy per model of each value computed from frozen weights, shared by every graph.

    graph A: _folded_3 = cat([wq, wk, wv]) -> int4 pack    \\  the same recipe over the same
    graph B: _folded_7 = cat([wq, wk, wv]) -> int4 pack    /  tensors: B's buffer is A's tensor

A model compiles to several graphs (a prefill graph per prompt-length regime, a decode
graph, each at level 1 and level 2 while "auto" decides), and each folded, packed and
quantized its own copy of every weight: Gemma-3 270M, whose float32 weights are 1 GiB,
reached 8.8 GiB with frozen weights. A value is shared when its refresh recipe (the FX
graph from the frozen parameters to it) has the same ops in the same order and reads the
same tensors at the same versions; the recipe is what refresh() recomputes it from, so a
shared value is recomputed in place for every graph that holds it.

Held weakly: a value lives as long as a graph holds it. An entry also holds the tensors
its recipe read weakly and is used only while each is the very tensor it was made from,
so a freed parameter whose id a new one reuses never matches. A pass that overwrites a
folded value in place asks `withdraw` first.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx

from .._compat import fake
from .base import attribute

# recipe key -> its entry
_VALUES: dict[tuple, _Entry] = {}


@dataclass
class _Entry:
    reads: tuple[weakref.ref, ...]  # the tensors the recipe read
    value: weakref.ref
    handed: bool = False  # to a graph other than the one that made it


def key(recipe: torch.fx.GraphModule, frozen: dict[str, torch.Tensor]) -> tuple[tuple, list[torch.Tensor]] | None:
    """(the key of the value `recipe` computes from `frozen` (placeholder name -> tensor),
    the tensors it reads), or None where it cannot be shared: it reads a tensor without
    a version counter (an inference tensor, which may change unseen)."""
    index: dict[torch.fx.Node, int] = {}
    reads: list[torch.Tensor] = []
    ops: list[tuple] = []
    for node in recipe.graph.nodes:
        index[node] = len(index)
        if node.op in ("placeholder", "get_attr"):
            tensor = frozen[node.target] if node.op == "placeholder" else attribute(recipe, node.target)
            if not isinstance(tensor, torch.Tensor) or tensor.is_inference():
                return None
            reads.append(tensor)
            ops.append((node.op, id(tensor), tensor._version))
        else:
            args = torch.fx.map_arg((node.args, node.kwargs), lambda n: _Ref(index[n]))
            ops.append((node.op, str(node.target), repr(args)))
    return tuple(ops), reads


def find(found: tuple[tuple, list[torch.Tensor]] | None) -> torch.Tensor | None:
    """The live value shared under `found` (key()'s), or None."""
    entry = None if found is None else _VALUES.get(found[0])
    if entry is None or len(entry.reads) != len(found[1]) \
            or any(ref() is not t for ref, t in zip(entry.reads, found[1])):
        return None
    value = entry.value()
    entry.handed = entry.handed or value is not None
    return value


def share(found: tuple[tuple, list[torch.Tensor]] | None, value: Any) -> None:
    """Offer `value`, computed from key()'s `found`, to later graphs."""
    if found is None or not isinstance(value, torch.Tensor):
        return
    for dead in [k for k, entry in _VALUES.items() if entry.value() is None]:
        del _VALUES[dead]
    _VALUES[found[0]] = _Entry(tuple(weakref.ref(t) for t in found[1]), weakref.ref(value))


def computed(recipe: torch.fx.GraphModule | None, frozen: dict[str, torch.Tensor],
             compute: Callable[[], Any]) -> Any:
    """The value `recipe` computes from `frozen`: another graph's where one is shared,
    else `compute()`'s, then offered to later graphs. No recipe (a value no frozen
    parameter changes): `compute()`'s, not shared."""
    found = None if recipe is None else key(recipe, frozen)
    value = find(found)
    if value is None:
        value = compute()
        share(found, value)
    return value


def withdraw(value: torch.Tensor) -> bool:
    """Whether the graph that made `value` may overwrite it (store_transposed_weights
    transposes a weight in its own memory): no other graph was handed it. It is then no
    longer offered."""
    for k, entry in list(_VALUES.items()):
        if entry.value() is value:
            if entry.handed:
                return False
            del _VALUES[k]
    return True


def offered() -> list[weakref.ref]:
    """The values offered now, to tell a graph's own from those it took (`held_bytes`)."""
    return [entry.value for entry in _VALUES.values()]


def held_bytes(gm: torch.fx.GraphModule, before: list[weakref.ref]) -> dict[str, int]:
    """The bytes of the values `gm` holds as buffers (folded, packed, converted or quantized
    weights), each storage once: "new", computed for it, and "shared", taken from the
    values offered `before` its passes ran (`offered()`'s)."""
    earlier = {id(value) for ref in before if (value := ref()) is not None}
    storages: dict[int, tuple[int, bool]] = {}
    for _, buffer in gm.named_buffers():
        if buffer.device.type == "meta" or fake.is_fake(buffer):  # no memory of its own
            continue
        if buffer.layout == torch.strided:
            storage = buffer.untyped_storage()
            where, nbytes = storage.data_ptr(), storage.nbytes()
        else:  # oneDNN's packed weights are opaque: no storage to read
            where, nbytes = id(buffer), buffer.numel() * buffer.element_size()
        shared = id(buffer) in earlier or storages.get(where, (0, False))[1]
        storages[where] = (nbytes, shared)
    held = {"new": 0, "shared": 0}
    for nbytes, shared in storages.values():
        held["shared" if shared else "new"] += nbytes
    return held


class _Ref:
    """A node of a recipe, by its position, in the key's text."""

    def __init__(self, position: int):
        self.position = position

    def __repr__(self) -> str:
        return f"%{self.position}"
