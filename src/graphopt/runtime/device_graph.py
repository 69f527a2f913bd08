"""DeviceGraph: what a captured, replayable step offers, whichever device it runs on.

One protocol, two implementations: `CudaGraph` (`cuda_graph.py`, a `torch.cuda.CUDAGraph`)
and `HostGraph` (`host_graph.py`, a recorded ATen tape replayed on the captured
tensors). `graphs.device_graph()` picks one for a device. Both implementations import
this module and it imports neither, so the contract and its one exception have a home
of their own.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

import torch


class PoolBudgetExceeded(Exception):
    """`capture_end(max_growth=...)` refused: the pool would have grown by `needed`
    bytes, more than the `available` it may. The graph is left uncaptured."""

    def __init__(self, needed: int, available: int):
        super().__init__(f"the graph pool would grow by {needed} bytes, more than the {available} it may")
        self.needed, self.available = needed, available


@runtime_checkable
class DeviceGraph(Protocol):
    """One captured step: `capture_begin()`, run the step, `capture_end()`, then
    `replay()` as often as needed; `reset()` frees what the graph holds.

    It does not know batch sizes, padding, static buffers or budgets: the runner,
    `StaticInputs` and the pool's share (`pool.py`) do. It only records, replays,
    measures its memory and, where it can, rebinds an input."""

    device: torch.device
    executes_during_capture: bool  # a host graph runs the step while recording it; a CUDA graph only records
    rebinds: bool                  # whether `rebind` can succeed
    nbytes: int                    # pool bytes its intermediates and outputs take
    pool_growth: int               # bytes the capture made a CUDA pool reserve; 0 on the host
    replay_fallback: str | None    # why a host graph replays from Python although C++ was asked for

    def capture_begin(self) -> None: ...

    def capture_end(self, outputs: Sequence[torch.Tensor] | None = None, max_growth: int | None = None) -> None:
        """End the capture. `outputs` (optional): the tensors that must stay valid
        after a replay; a host graph reuses the memory of the rest. `max_growth`: the
        most bytes the pool may grow by; more raises PoolBudgetExceeded."""

    def replay(self) -> None: ...

    @property
    def replayer(self) -> Callable[[], None]:
        """What a replay calls, bound at capture and valid until `reset()`: the
        implementation's own (torch's `CUDAGraph.replay`, the native tape's), so a
        replayed step passes no frame of this class."""

    def reset(self) -> None: ...

    def abort(self) -> None:
        """End a capture whose step raised, and free what it recorded."""

    def rebind(self, old: torch.Tensor, new: torch.Tensor) -> str | None:
        """Read and write `new` (same size, stride and dtype) wherever the graph reads
        and writes `old`, one of its inputs, without capturing again. None when done,
        else why not."""
