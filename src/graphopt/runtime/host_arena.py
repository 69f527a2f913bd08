"""A host graph's memory: which allocations its capture made, when they live, and
where they go in its `HostPool`'s arena.

At `capture_end` every allocation made during capture (intermediates and outputs;
never tensors that existed before, such as static inputs, parameters or a KV cache)
moves into the arena with `Tensor.set_`, a base and its views together, so the tape
and the caller's references see the new memory. A graph that reads another graph's
outputs from the same arena (the next piece of a split graph) is placed after them.
Offsets are planned by lifetime (from the op that creates an allocation to the last op
that touches it; outputs live to the end) with the planner the passes use
(`graphopt.arena.plan_offsets`), 64-byte aligned. Graphs of one pool share one arena
sized to the largest need, so replaying one overwrites the others' outputs, as in a
CUDA graph pool. Outputs keep their captured values.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._compat.names import tensor_leaves
from ..arena import plan_offsets

if TYPE_CHECKING:
    from .host_graph import HostGraph

_ALIGN = 64


class HostPool:
    """Arena memory shared by host graphs: the CPU analogue of a CUDA graph pool.
    Graphs sharing a pool share one arena whose size is the largest need, not the sum."""

    def __init__(self) -> None:
        self.storage = torch.UntypedStorage(0)
        self.graphs: weakref.WeakSet[HostGraph] = weakref.WeakSet()  # the graphs placed in the arena

    @property
    def nbytes(self) -> int:
        """Current arena size in bytes."""
        return self.storage.nbytes()

    def fit(self) -> None:
        """Size the arena to the largest need of the graphs that use it. Growing
        resizes the storage in place: every tensor on it follows. Shrinking (after a
        reset) moves the graphs' own tensors to a smaller storage; any other tensor on
        the old one (a caller's view, an output of the reset graph) keeps that memory
        alive, frozen, rather than pointing past the end of the new one."""
        need = max((g.nbytes for g in self.graphs), default=0)
        if need > self.nbytes:
            self.storage.resize_(need)
        elif need < self.nbytes:
            old, self.storage = self.storage, torch.UntypedStorage(need)
            _bytes(self.storage, 0, need).copy_(_bytes(old, 0, need))
            with torch.inference_mode():
                for graph in self.graphs:
                    for t in graph.placed:
                        t.set_(self.storage, t.storage_offset(), t.size(), t.stride())


@dataclass
class Allocation:
    storage: torch.UntypedStorage
    first: int  # index of the op that created it
    last: int  # index of the last op that touches it (through any view)
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)  # every tensor object on it, by id
    escapes: bool = False  # read after the graph: lives to the end, keeps its captured values
    offset: int = 0


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of a tensor's memory: its storage's address. Every tensor the capture
    sees is kept alive until capture_end, so no address is reused meanwhile. None for
    tensors without memory of their own (empty, meta, not strided)."""
    if t.layout != torch.strided:
        return None
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() > 0 and storage.data_ptr() != 0 else None


def analyse(records: list, escaping: list[torch.Tensor] | None) -> tuple[list[Allocation], list[list[bool]]]:
    """The CPU allocations the recorded ops created, with their lifetimes, and for
    each op which of its tensor outputs are new memory (False: a view of an input,
    or memory that existed before). Storages first seen as an input existed before
    the capture, or are constants made outside the dispatcher: they never move."""
    made: dict[int, Allocation] = {}
    seen: set[int | None] = set()
    fresh: list[list[bool]] = []

    def touch(t: torch.Tensor, key: int | None, i: int) -> None:
        if key in made:
            made[key].last = i
            made[key].tensors[id(t)] = t

    for i, (_, args, kwargs, result) in enumerate(records):
        for t in tensor_leaves((args, kwargs)):
            key = storage_key(t)
            seen.add(key)
            touch(t, key, i)
        new_here: set[int] = set()
        flags = []
        for t in tensor_leaves(result):
            key = storage_key(t)
            is_new = key is not None and (key not in seen or key in new_here)
            if is_new and key not in new_here:
                new_here.add(key)
                if t.device.type == "cpu":
                    made[key] = Allocation(t.untyped_storage(), i, i)
            flags.append(is_new)
            touch(t, key, i)
        seen |= new_here
        fresh.append(flags)
    for key in made if escaping is None else map(storage_key, escaping):
        if key in made:
            made[key].last, made[key].escapes = len(records), True
    return list(made.values()), fresh


def extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor spans: [start, end)."""
    start, span = t.storage_offset(), 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start * t.element_size(), (start + span * (t.numel() > 0)) * t.element_size()


def arena_bytes_read(records: list, arena: torch.UntypedStorage) -> int:
    """Where the pool's arena stops holding what this graph reads: the end of the
    furthest byte of any input that lives on the arena (the output of another
    graph of the pool that this one consumes, e.g. the piece before it)."""
    arena_ref, end = StorageWeakRef(arena), 0
    for _, args, kwargs, _ in records:
        for t in tensor_leaves((args, kwargs)):
            if t.layout == torch.strided and StorageWeakRef(t.untyped_storage()) == arena_ref and t.numel():
                end = max(end, extent(t)[1])
    return -(-end // _ALIGN) * _ALIGN


def place(allocations: list[Allocation], base: int) -> int:
    """Offsets by lifetime and size, planned as the graph passes plan theirs
    (`arena.plan_offsets`), from `base` on, so nothing this graph reads from
    the arena is overwritten while it runs. Returns the arena bytes needed."""
    plan = plan_offsets([(a.first, a.last, a.storage.nbytes()) for a in allocations], _ALIGN)
    for a, offset in zip(allocations, plan.offsets):
        a.offset = base + offset
    return base + plan.nbytes


def move(allocations: list[Allocation], arena: torch.UntypedStorage) -> list[torch.Tensor]:
    """Point every tensor of each allocation at its place in the arena, keeping its
    offset within the allocation; escaping allocations (which never overlap) take
    their captured values along. Returns the tensors moved."""
    moved = []
    for a in allocations:
        if a.escapes:
            _bytes(arena, a.offset, a.storage.nbytes()).copy_(_bytes(a.storage, 0, a.storage.nbytes()))
        for t in a.tensors.values():
            t.set_(arena, a.offset // t.element_size() + t.storage_offset(), t.size(), t.stride())
            moved.append(t)
    return moved


def _bytes(storage: torch.UntypedStorage, offset: int, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, offset, (nbytes,), (1,))
