"""The CPU's device graph: a recorded ATen tape, replayed on the same buffers.

Between `capture_begin()` and `capture_end()` the function runs normally, and every
ATen op it issues in this thread is recorded (a `TorchDispatchMode` below a raising
`CaptureGuard`, so what a CUDA capture would refuse is refused here too). `replay()`
runs the tape again on the same tensor objects, each op writing where it wrote at
capture, so outputs land in the same buffers every time, as with a CUDA graph.
How each op is replayed is `tape.py`'s; the tape runs from C++ (`native_tape.py`)
or, where that extension cannot be built, from Python, under `torch.inference_mode()`
(a host graph records no autograd history). At `capture_end` what the capture
allocated moves into its `HostPool`'s arena (`host_arena.py`), shared by the pool's graphs.

Decisions:
- random ops draw fresh numbers at every replay, as eager does;
- Python values computed during capture (shapes, numbers) are baked into the tape,
  so reading a tensor's value into Python (`.item()`) is a `CaptureError`;
- tensors the caller keeps must be among `outputs`; a later op may overwrite others;
- the tape holds tensor objects, not addresses, so `rebind(old, new)` can move every
  tensor the capture saw on `old`'s memory to `new`'s (a new KV cache per
  `generate()`); `old` is a private alias the caller never touches again.

Not thread-safe: capture in one thread (the recorder is thread-local), and never
replay one graph, or two graphs of one pool, from two threads at once.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._compat import ops
from .._compat.names import TorchDispatchMode, tensor_leaves
from . import native_tape
from .analysis.safety import CaptureGuard
from .device_graph import PoolBudgetExceeded
from .host_arena import HostPool, analyse, arena_bytes_read, extent, move, place, storage_key
from .tape import is_copy_replay, plan_entry


class HostGraph:
    """A DeviceGraph on the CPU (see the module docstring). It records, places its
    memory in its pool's arena and replays; it does not copy inputs, pad, or decide
    whether a capture fits a budget (it only raises PoolBudgetExceeded past the
    growth it is given)."""

    device = torch.device("cpu")
    executes_during_capture = True  # recording runs the step
    rebinds = True  # the tape holds tensor objects, which `rebind` can point elsewhere
    pool_growth = 0  # an arena is sized exactly, not grown by an allocator

    def __init__(self, pool: HostPool | None = None, native: bool | None = None):
        """`native`: replay from C++ (default `native_tape.ENABLED`: yes unless
        `GRAPHOPT_NATIVE_TAPE=0`); False replays from Python."""
        if pool is not None and not isinstance(pool, HostPool):
            raise TypeError(f"HostGraph(pool=...) takes a HostPool, got {type(pool).__name__}")
        self.pool = pool if pool is not None else HostPool()
        self.native = native_tape.ENABLED if native is None else native
        self._tape: Any = None  # a native_tape Tape, or a tuple of (callable, args, kwargs)
        self.placed: list[torch.Tensor] = []  # every tensor object this graph moved into the arena
        self._nbytes = self._copy_replays = self._python_entries = 0
        self.replay_fallback: str | None = None  # why a native replay was asked for and not given
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
                allocations, fresh = analyse(recorder.records, escaping)
                self._inputs = _inputs(recorder.records)
                self._nbytes = place(allocations, arena_bytes_read(recorder.records, self.pool.storage))
                if max_growth is not None and self._nbytes - self.pool.nbytes > max_growth:
                    raise PoolBudgetExceeded(self._nbytes - self.pool.nbytes, max_growth)
                self.pool.graphs.add(self)
                self.pool.fit()
                self.placed = move(allocations, self.pool.storage)
                self.replay_fallback = native_tape.unavailable() if self.native else None
                native = self.native and self.replay_fallback is None
                entries = [plan_entry(*record, new, self.placed, bindings=not native)
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
        if StorageWeakRef(new.untyped_storage()) == StorageWeakRef(self.pool.storage):
            # A capture places its intermediates after what it reads from the arena; a rebind cannot.
            return "it lives in the graph pool's memory, where the graph's intermediates go"
        tensors = self._inputs.get(id(old), [old])
        if tensors is None:
            return "another tensor from before the capture shares the captured one's memory"
        low, high = extent(old)
        shift = (new.storage_offset() - old.storage_offset()) * old.element_size()
        if any(not low <= start <= end <= high or shift % t.element_size()
               for t, (start, end) in zip(tensors, map(extent, tensors))):
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
        self._tape, self.placed, self._nbytes, self._copy_replays, self._python_entries = None, [], 0, 0, 0
        self._inputs = {}
        if self in self.pool.graphs:
            self.pool.graphs.discard(self)
            self.pool.fit()

    abort = reset  # ends a capture whose step raised

    def _stop(self, caller: str) -> _Recorder:
        if self._modes is None:
            raise RuntimeError(f"HostGraph.{caller}(): no capture in progress; call capture_begin() first")
        recorder, guard = self._modes
        if ops.current_dispatch_mode() is not guard:
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
            key = storage_key(t)
            if key is not None and key not in made and id(t) not in on.setdefault(key, {}):
                on[key][id(t)] = t
                before.setdefault(key, []).append(id(t))
        for t in tensor_leaves(result):
            key = storage_key(t)
            if key in on:
                on[key].setdefault(id(t), t)
            elif key is not None:
                made.add(key)
    return {tid: list(on[key].values()) if len(ids) == 1 else None for key, ids in before.items() for tid in ids}
