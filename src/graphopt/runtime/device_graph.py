"""DeviceGraph: one captured, replayable step, on whichever device the model runs.

The same API on both backends: `capture_begin()`, run the step, `capture_end()`,
then `replay()` as often as needed; `reset()` frees what the graph holds. On CUDA
it is a `torch.cuda.CUDAGraph`; on the CPU a host graph (a recorded ATen tape
replayed on the captured tensors). Device graphs know nothing of batch sizes or
padding: that is the GraphRunner's job.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch

from ..config import CAPTURE_ERROR_MODES


def default_place() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def graph_pool_handle(place: torch.device | str | None = None) -> Any:
    """A memory pool that device graphs on `place` can share (pool mode 1), alive
    while this object is."""
    device = torch.device(place) if place is not None else default_place()
    if device.type == "cuda":
        from .cuda_graph import CudaPool

        return CudaPool(device)
    from .host_graph import HostPool

    return HostPool()


@contextlib.contextmanager
def warmup_stream(device: torch.device) -> Iterator[None]:
    """Where warm-ups run: on CUDA the capture stream, so the library state and
    the caching allocator's blocks a capture will meet already exist there."""
    if device.type != "cuda":
        yield
        return
    from .cuda_graph import on_capture_stream

    with on_capture_stream(device):
        yield


class PoolBudgetExceeded(Exception):
    """`capture_end(max_growth=...)` refused: the pool would have grown by `needed`
    bytes, more than the `available` it may. The graph is left uncaptured."""

    def __init__(self, needed: int, available: int):
        super().__init__(f"the graph pool would grow by {needed} bytes, more than the {available} it may")
        self.needed, self.available = needed, available


class DeviceGraph:
    def __init__(self, place: torch.device | str | None = None, mode: str = "thread_local",
                 pool: Any = None):
        if mode not in CAPTURE_ERROR_MODES:
            raise ValueError(f"mode must be one of {CAPTURE_ERROR_MODES}, got {mode!r}")
        self.device = torch.device(place) if place is not None else default_place()
        self.mode = mode
        if self.device.type == "cuda":
            from .cuda_graph import CudaGraph

            self._graph = CudaGraph(self.device, mode, pool)
        elif self.device.type == "cpu":
            from .host_graph import HostGraph

            self._graph = HostGraph(pool)
        else:
            raise ValueError(f"device graphs run on CUDA or the CPU, not {self.device}")

    def capture_begin(self) -> None:
        self._graph.capture_begin()

    def capture_end(self, outputs: Sequence[torch.Tensor] | None = None, max_growth: int | None = None) -> None:
        """End the capture. `outputs` (optional) are the tensors that must stay
        valid after a replay; the host backend reuses the memory of the rest.
        `max_growth`: the most bytes the graph's pool may grow by; more raises
        PoolBudgetExceeded (a host arena is checked before it grows, a CUDA pool
        after its capture, which is then dropped)."""
        self._graph.capture_end(outputs, max_growth)

    def replay(self) -> None:
        self._graph.replay()

    @property
    def replayer(self) -> Callable[[], None]:
        """`replay` for a caller that replays every step to keep: the backend's own replay,
        without this class's layer (a host graph's native tape's). Valid until `reset()`."""
        return getattr(self._graph, "replayer", self._graph.replay)

    def reset(self) -> None:
        self._graph.reset()

    def abort(self) -> None:
        """End a capture whose step raised, and free what it recorded."""
        self._graph.abort()

    def rebind(self, old: torch.Tensor, new: torch.Tensor) -> str | None:
        """Make the graph read and write `new`, a tensor of the same size, stride
        and dtype, wherever it reads and writes `old`, one of its inputs, without
        capturing again. A host graph can (its tape holds tensors, and `old` must be
        a tensor only the graph holds); a CUDA graph holds addresses and cannot.
        Returns None when done, else why not."""
        return self._graph.rebind(old, new)

    @property
    def rebinds(self) -> bool:
        """Whether `rebind` can succeed on this backend."""
        return self._graph.rebinds

    @property
    def executes_during_capture(self) -> bool:
        """A host graph runs the step while recording it; a CUDA graph only records."""
        return self._graph.executes_during_capture

    @property
    def replay_fallback(self) -> str | None:
        """Why this host graph replays from Python although C++ was asked for; None otherwise."""
        return getattr(self._graph, "python_replay_reason", None)

    @property
    def pool_growth(self) -> int:
        """Bytes the capture made a CUDA pool reserve (`torch.cuda.memory_stats`); 0 on the host."""
        return getattr(self._graph, "pool_growth", 0)

    @property
    def nbytes(self) -> int:
        """Bytes of pool memory this graph's intermediates and outputs take."""
        return self._graph.nbytes
