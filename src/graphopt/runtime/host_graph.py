"""The CPU's device graph: a recorded ATen tape, replayed on the same buffers.

Between `capture_begin()` and `capture_end()` the function runs normally, and every
ATen op it issues in this thread is recorded (a `TorchDispatchMode` below a raising
`CaptureGuard`, so what a CUDA capture would refuse is refused here too). `replay()`
runs the tape again on the same tensor objects, each op writing where it wrote at
capture, so outputs land in the same buffers every time, as with a CUDA graph.
How each op is replayed (through its `out=` overload, in place, as a copy) is
`tape.py`'s; the tape runs from C++ (`native_tape.py`, one dispatcher call per op)
or, where that extension cannot be built, from Python.

Replays run under `torch.inference_mode()`: a host graph records no autograd history.

Memory. At `capture_end` every allocation made during capture (intermediates and
outputs; never tensors that existed before, such as static inputs, parameters or a
KV cache) moves into its `HostPool`'s arena with `Tensor.set_`, a base and its views
together, so the tape and the caller's references see the new memory. A graph
that reads another graph's outputs from the same arena (the next piece of a split
graph) is placed after them. Offsets are planned by lifetime (from the op that creates an allocation to the last op that
touches it; `outputs` live to the end) with the planner the passes use
(`graphopt.arena.plan_offsets`: greedy by size), 64-byte aligned. Graphs of
one pool share one arena sized to the largest need, so replaying one overwrites the
others' outputs, as in a CUDA graph pool. Outputs keep their captured values.

Decisions:
- Random ops are replayed and draw fresh numbers from their generator at every
  replay, as eager does (and as a CUDA graph does with the default generator).
- Python values computed during capture are baked into the tape: shapes, and any
  number derived in Python. That is why reading a tensor's value into Python
  (`.item()`, `bool(t)`) is a `CaptureError`.
- Tensors created during capture that the caller keeps must be among `outputs`;
  any other may be overwritten by a later op of the same replay.
- The tape holds tensor objects, not addresses: `rebind(old, new)` `set_`s every
  tensor the capture saw on input `old`'s memory (`old`, and the views the step
  made of it) to the same place in `new`'s, a tensor of the same size, stride and
  dtype (a KV cache made anew for each `generate()`). So `old` must be a private
  alias of the caller's tensor, which is then never touched again (`capture.py`).

Not thread-safe: capture in one thread (the recorder is thread-local), and never
replay one graph, or two graphs of one pool, from two threads at once.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .. import _compat
from .._compat.names import TorchDispatchMode, tensor_leaves
from ..arena import plan_offsets
from . import native_tape
from .analysis.safety import CaptureGuard
from .device_graph import PoolBudgetExceeded
from .tape import is_copy_replay, plan_entry

_ALIGN = 64


class HostPool:
    """Arena memory shared by host graphs: the CPU analogue of a CUDA graph pool.
    Graphs sharing a pool share one arena whose size is the largest need, not the sum."""

    def __init__(self) -> None:
        self._storage = torch.UntypedStorage(0)
        self._graphs: weakref.WeakSet[HostGraph] = weakref.WeakSet()

    @property
    def nbytes(self) -> int:
        """Current arena size in bytes."""
        return self._storage.nbytes()

    def _fit(self) -> None:
        """Size the arena to the largest need of the graphs that use it. Growing
        resizes the storage in place: every tensor on it follows. Shrinking (after a
        reset) moves the graphs' own tensors to a smaller storage; any other tensor on
        the old one (a caller's view, an output of the reset graph) keeps that memory
        alive, frozen, rather than pointing past the end of the new one."""
        need = max((g.nbytes for g in self._graphs), default=0)
        if need > self.nbytes:
            self._storage.resize_(need)
        elif need < self.nbytes:
            old, self._storage = self._storage, torch.UntypedStorage(need)
            _bytes(self._storage, 0, need).copy_(_bytes(old, 0, need))
            with torch.inference_mode():
                for graph in self._graphs:
                    for t in graph._placed:
                        t.set_(self._storage, t.storage_offset(), t.size(), t.stride())


class HostGraph:
    """One captured, replayable step on the CPU (see the module docstring)."""

    executes_during_capture = True  # recording runs the step
    rebinds = True  # the tape holds tensor objects, which `rebind` can point elsewhere

    def __init__(self, pool: HostPool | None = None, native: bool | None = None):
        """`native`: replay from C++ (default `native_tape.ENABLED`: yes unless
        `GRAPHOPT_NATIVE_TAPE=0`); False replays from Python."""
        if pool is not None and not isinstance(pool, HostPool):
            raise TypeError(f"HostGraph(pool=...) takes a HostPool, got {type(pool).__name__}")
        self.pool = pool if pool is not None else HostPool()
        self.native = native_tape.ENABLED if native is None else native
        self._tape: Any = None  # a native_tape Tape, or a tuple of (callable, args, kwargs)
        self._placed: list[torch.Tensor] = []  # every tensor object this graph moved into the arena
        self._nbytes = self._copy_replays = self._python_entries = 0
        self.python_replay_reason: str | None = None  # why a native replay was asked for and not given
        self._modes: tuple[_Recorder, CaptureGuard] | None = None
        self._inputs: dict[int, list[torch.Tensor] | None] = {}  # `_inputs()`, for rebind

    @property
    def nbytes(self) -> int:
        """Arena bytes this graph's intermediates and outputs need (0 before capture)."""
        return self._nbytes

    @property
    def copy_replays(self) -> int:
        """Ops replayed as compute + copy_ (no out= form): the replays that allocate."""
        return self._copy_replays

    @property
    def python_entries(self) -> int:
        """Tape entries replayed through Python: all of them without the native tape,
        else only what C++ cannot call (collectives, arguments it cannot hold)."""
        return self._python_entries

    @property
    def replays_natively(self) -> bool:
        """Whether the tape runs from C++ (no Python per op, apart from `python_entries`)."""
        return self._tape is not None and not isinstance(self._tape, tuple)

    def capture_begin(self) -> None:
        """Start recording this thread's ATen ops, under a raising `CaptureGuard`."""
        if self._modes is not None:
            raise RuntimeError("HostGraph.capture_begin(): this graph is already capturing; call capture_end() first")
        self.reset()
        recorder, guard = _Recorder(), CaptureGuard()
        # The guard is entered last, so it sees each op first: one it refuses never reaches the recorder.
        recorder.__enter__()
        guard.__enter__()
        self._modes = (recorder, guard)

    def capture_end(self, outputs: Sequence[torch.Tensor] | None = None, max_growth: int | None = None) -> None:
        """Stop recording, move what the capture allocated into the pool's arena,
        and build the replay tape. `outputs` (any nesting of tensors) are what the
        caller reads after replay; None means any intermediate may escape, so none
        shares memory with another (correct, but a bigger arena). An arena that
        would grow by more than `max_growth` raises PoolBudgetExceeded before it grows."""
        recorder = self._stop("capture_end")
        escaping = None if outputs is None else tensor_leaves(outputs)
        try:
            with torch.inference_mode():
                allocations, fresh = _analyse(recorder.records, escaping)
                self._inputs = _inputs(recorder.records)
                self._nbytes = _place(allocations, _arena_bytes_read(recorder.records, self.pool._storage))
                if max_growth is not None and self._nbytes - self.pool.nbytes > max_growth:
                    raise PoolBudgetExceeded(self._nbytes - self.pool.nbytes, max_growth)
                self.pool._graphs.add(self)
                self.pool._fit()
                self._placed = _move(allocations, self.pool._storage)
                self.python_replay_reason = native_tape.unavailable() if self.native else None
                native = self.native and self.python_replay_reason is None
                entries = [plan_entry(*record, new, self._placed, bindings=not native)
                           for record, new in zip(recorder.records, fresh)]
                entries = [entry for entry in entries if entry is not None]
                if native:
                    self._tape, self._python_entries = native_tape.build(entries)
                else:
                    self._tape, self._python_entries = tuple(entry.python for entry in entries), len(entries)
        except BaseException:
            self.reset()  # never leave a half-built graph holding a share of the pool
            raise
        self._copy_replays = sum(map(is_copy_replay, entries))

    def replay(self) -> None:
        """Run the captured ops again, writing into the tensors they wrote at capture."""
        if self._tape is None:
            raise RuntimeError("HostGraph.replay(): " + (
                "capture is still in progress; call capture_end() first" if self._modes is not None else
                "nothing is captured (never captured, or reset() since); capture it again before replaying"))
        if not isinstance(self._tape, tuple):
            return self._tape.replay()
        with torch.inference_mode():
            for fn, args, kwargs in self._tape:
                fn(*args, **kwargs)

    @property
    def replayer(self) -> Callable[[], None]:
        """`replay` for a caller that replays every step: a native tape's own, without this method around it."""
        return self._tape.replay if self.replays_natively else self.replay

    def rebind(self, old: torch.Tensor, new: torch.Tensor) -> str | None:
        """Read and write `new` wherever the tape reads and writes `old`, an input
        of the capture that only this graph holds (the module docstring says why).
        Returns None when done, else why the graph cannot (and nothing changed)."""
        if (new.shape, new.stride(), new.dtype, new.device, new.layout) != \
                (old.shape, old.stride(), old.dtype, old.device, old.layout):
            return "its size, stride or dtype differs from the captured one's"
        if StorageWeakRef(new.untyped_storage()) == StorageWeakRef(self.pool._storage):
            # A capture places its intermediates after what it reads from the arena; a rebind cannot.
            return "it lives in the graph pool's memory, where the graph's intermediates go"
        tensors = self._inputs.get(id(old), [old])
        if tensors is None:
            return "another tensor from before the capture shares the captured one's memory"
        low, high = _extent(old)
        shift = (new.storage_offset() - old.storage_offset()) * old.element_size()
        if any(not low <= start <= end <= high or shift % t.element_size()
               for t, (start, end) in zip(tensors, map(_extent, tensors))):
            return "the graph reads memory of the captured one's storage outside it"
        storage = new.untyped_storage()
        with torch.inference_mode():
            for t in tensors:
                t.set_(storage, t.storage_offset() + shift // t.element_size(), t.size(), t.stride())
        return None

    def reset(self) -> None:
        """Free what the graph holds: its tape, its references to tensors, and its
        share of the pool (the arena shrinks to the largest remaining need). Aborts a
        capture in progress, e.g. after the captured code raised."""
        if self._modes is not None:
            self._stop("reset")
        self._tape, self._placed, self._nbytes, self._copy_replays, self._python_entries = None, [], 0, 0, 0
        self._inputs = {}
        if self in self.pool._graphs:
            self.pool._graphs.discard(self)
            self.pool._fit()

    abort = reset  # ends a capture whose step raised

    def _stop(self, caller: str) -> _Recorder:
        if self._modes is None:
            raise RuntimeError(f"HostGraph.{caller}(): no capture in progress; call capture_begin() first")
        recorder, guard = self._modes
        if _compat.current_dispatch_mode() is not guard:
            raise RuntimeError(f"HostGraph.{caller}() must run in the thread that called capture_begin(), "
                               "after every dispatch mode entered since has exited")
        self._modes = None
        guard.__exit__(None, None, None)
        recorder.__exit__(None, None, None)
        return recorder

    def __repr__(self) -> str:
        if self._tape is None:
            return f"HostGraph(not captured, nbytes={self.nbytes})"
        where = "native" if self.replays_natively else "Python"
        return (f"HostGraph({len(self._tape)} ops, {where} replay, {self.python_entries} through Python, "
                f"nbytes={self.nbytes}, copy_replays={self.copy_replays})")


class _Recorder(TorchDispatchMode):
    """Runs each op and records (op, args, kwargs, result)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[Any, tuple, dict, Any]] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # record a compiled step's ops, not Dynamo's tracing (see CaptureGuard)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self.records.append((func, args, kwargs, result))
        return result


# -- memory: which allocations the capture made, when they live, where they go --------------

@dataclass
class _Allocation:
    storage: torch.UntypedStorage
    first: int  # index of the op that created it
    last: int  # index of the last op that touches it (through any view)
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)  # every tensor object on it, by id
    escapes: bool = False  # read after the graph: lives to the end, keeps its captured values
    offset: int = 0


def _storage_key(t: torch.Tensor) -> int | None:
    """Identity of a tensor's memory: its storage's address. Every tensor the capture
    sees is kept alive until capture_end, so no address is reused meanwhile. None for
    tensors without memory of their own (empty, meta, not strided)."""
    if t.layout != torch.strided:
        return None
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() > 0 and storage.data_ptr() != 0 else None


def _analyse(records: list, escaping: list[torch.Tensor] | None) -> tuple[list[_Allocation], list[list[bool]]]:
    """The CPU allocations the recorded ops created, with their lifetimes, and for
    each op which of its tensor outputs are new memory (False: a view of an input,
    or memory that existed before). Storages first seen as an input existed before
    the capture, or are constants made outside the dispatcher: they never move."""
    made: dict[int, _Allocation] = {}
    seen: set[int | None] = set()
    fresh: list[list[bool]] = []

    def touch(t: torch.Tensor, key: int | None, i: int) -> None:
        if key in made:
            made[key].last = i
            made[key].tensors[id(t)] = t

    for i, (_, args, kwargs, result) in enumerate(records):
        for t in tensor_leaves((args, kwargs)):
            key = _storage_key(t)
            seen.add(key)
            touch(t, key, i)
        new_here: set[int] = set()
        flags = []
        for t in tensor_leaves(result):
            key = _storage_key(t)
            is_new = key is not None and (key not in seen or key in new_here)
            if is_new and key not in new_here:
                new_here.add(key)
                if t.device.type == "cpu":
                    made[key] = _Allocation(t.untyped_storage(), i, i)
            flags.append(is_new)
            touch(t, key, i)
        seen |= new_here
        fresh.append(flags)
    for key in made if escaping is None else map(_storage_key, escaping):
        if key in made:
            made[key].last, made[key].escapes = len(records), True
    return list(made.values()), fresh


def _inputs(records: list) -> dict[int, list[torch.Tensor] | None]:
    """For each tensor that existed before the capture (first seen as an argument),
    every tensor object the capture saw on its memory: itself and the views the
    step made of it. None for tensors from before that share memory with another
    (two views of one cache passed as two arguments): neither can move alone."""
    on: dict[int, dict[int, torch.Tensor]] = {}  # storage key -> tensors on it, by id
    before: dict[int, list[int]] = {}
    made: set[int] = set()
    for _, args, kwargs, result in records:
        for t in tensor_leaves((args, kwargs)):
            key = _storage_key(t)
            if key is not None and key not in made and id(t) not in on.setdefault(key, {}):
                on[key][id(t)] = t
                before.setdefault(key, []).append(id(t))
        for t in tensor_leaves(result):
            key = _storage_key(t)
            if key in on:
                on[key].setdefault(id(t), t)
            elif key is not None:
                made.add(key)
    return {tid: list(on[key].values()) if len(ids) == 1 else None for key, ids in before.items() for tid in ids}


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor spans: [start, end)."""
    start, span = t.storage_offset(), 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start * t.element_size(), (start + span * (t.numel() > 0)) * t.element_size()


def _arena_bytes_read(records: list, arena: torch.UntypedStorage) -> int:
    """Where the pool's arena stops holding what this graph reads: the end of the
    furthest byte of any input that lives on the arena (the output of another
    graph of the pool that this one consumes, e.g. the piece before it)."""
    arena_ref, end = StorageWeakRef(arena), 0
    for _, args, kwargs, _ in records:
        for t in tensor_leaves((args, kwargs)):
            if t.layout == torch.strided and StorageWeakRef(t.untyped_storage()) == arena_ref and t.numel():
                end = max(end, _extent(t)[1])
    return -(-end // _ALIGN) * _ALIGN


def _place(allocations: list[_Allocation], base: int) -> int:
    """Offsets by lifetime and size, planned as the graph passes plan theirs
    (`arena.plan_offsets`), from `base` on, so nothing this graph reads from
    the arena is overwritten while it runs. Returns the arena bytes needed."""
    plan = plan_offsets([(a.first, a.last, a.storage.nbytes()) for a in allocations], _ALIGN)
    for a, offset in zip(allocations, plan.offsets):
        a.offset = base + offset
    return base + plan.nbytes


def _move(allocations: list[_Allocation], arena: torch.UntypedStorage) -> list[torch.Tensor]:
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
