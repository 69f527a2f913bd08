"""The CUDA implementation of DeviceGraph: `torch.cuda.CUDAGraph`, captured the way
`torch.cuda.graph` does it: on one capture stream per device, the stream the
warm-ups ran on, so cuBLAS/cuDNN state exists before capture begins."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator, Sequence

import torch

from .analysis.safety import CaptureGuard
from .device_graph import PoolBudgetExceeded


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    # The legacy default stream cannot be captured; every graph of a device shares this one.
    return torch.cuda.Stream(device)


@functools.cache
def _stream_lock(device: torch.device) -> threading.RLock:
    return threading.RLock()


@contextlib.contextmanager
def on_capture_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """Run on the device's capture stream, one thread at a time: a thread's warm-up
    or capture on the stream another thread is capturing on would join (or break)
    that capture (cudaErrorStreamCaptureIsolation)."""
    stream = capture_stream(device)
    with _stream_lock(device):
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield stream
        torch.cuda.current_stream(device).wait_stream(stream)


class CudaPool:
    """A graph pool that lives as long as this object: `id` is the pool's handle,
    and `anchor`, a one-kernel graph captured into it and never replayed, holds it
    open (an empty capture draws torch's warning). A pool is freed
    when its last graph is reset, and capturing into its handle again then fails an
    allocator assertion (torch 2.11: in the device allocator and in the pinned host
    allocator); graphopt resets and captures a pool's graphs again (recapture,
    capture sizes "auto", a refused capture)."""

    def __init__(self, device: torch.device, handle: Any = None):
        self.device = device
        self.id = handle if handle is not None else torch.cuda.graph_pool_handle()
        self.anchor, scratch = torch.cuda.CUDAGraph(), torch.zeros(1, device=device)
        with on_capture_stream(device):
            self.anchor.capture_begin(pool=self.id)
            scratch.add_(1)
            self.anchor.capture_end()
        self.scratch = scratch  # what the anchor's kernel writes, kept as long as the anchor


_primed = threading.local()


def prime_libraries(device: torch.device) -> None:
    """cuBLAS and cuBLASLt make their handle and workspace at a thread's first GEMM
    on a stream, and making them inside a capture fails
    (CUBLAS_STATUS_NOT_INITIALIZED). A small GEMM of each kind on the capture
    stream, once per thread and device, makes them before any capture begins."""
    done = _primed.__dict__.setdefault("devices", set())
    if device in done:
        return
    dtypes = [torch.float32, torch.float16] + [torch.bfloat16] * torch.cuda.is_bf16_supported()
    with on_capture_stream(device):
        for dtype in dtypes:
            x = torch.ones(16, 16, device=device, dtype=dtype)
            torch.addmm(x[0], x, x)
            torch.mm(x, x)
            torch.bmm(x[None], x[None])
    torch.cuda.synchronize(device)
    done.add(device)


class CudaGraph:
    """A DeviceGraph on CUDA. It captures on the device's capture stream and measures
    what its pool grew by; it does not copy inputs, pad, or decide whether a capture
    fits a budget (it only raises PoolBudgetExceeded past the growth it is given)."""

    executes_during_capture = False  # a stream capture records without running
    rebinds = False  # a graph's kernels hold its inputs' addresses
    replay_fallback = None

    def __init__(self, device: torch.device, mode: str, pool: Any = None):
        self.device = device
        self.mode = mode
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()
        self.nbytes = 0
        self.pool_growth = 0  # bytes the capture made the caching allocator reserve
        self._context: contextlib.ExitStack | None = None

    def capture_begin(self) -> None:
        prime_libraries(self.device)
        context = contextlib.ExitStack()
        context.enter_context(on_capture_stream(self.device))
        torch.cuda.synchronize(self.device)
        context.enter_context(CaptureGuard())
        self._context = context
        self._allocated = torch.cuda.memory_allocated(self.device)
        self._reserved = _reserved(self.device)
        try:
            self.graph.capture_begin(pool=pool_id(self.pool), capture_error_mode=self.mode)
        except BaseException:
            self._close()
            raise

    def capture_end(self, outputs: Sequence[torch.Tensor] | None = None, max_growth: int | None = None) -> None:
        """`max_growth`: a capture that made the pool grow by more is dropped (a
        stream capture cannot be sized before it runs) and PoolBudgetExceeded raised."""
        try:
            self.graph.capture_end()
        finally:
            self._close()
        self.pool_growth = max(_reserved(self.device) - self._reserved, 0)
        # A graph of a shared pool copies its outputs out (graph_outputs.py) and holds
        # nothing allocated after its capture: what it cost is what the pool reserved.
        self.nbytes = max(torch.cuda.memory_allocated(self.device) - self._allocated, self.pool_growth)
        if max_growth is not None and self.pool_growth > max_growth:
            needed = self.pool_growth
            self.reset()
            raise PoolBudgetExceeded(needed, max_growth)

    def abort(self) -> None:
        """End a capture whose step raised, and leave the device usable."""
        if self._context is not None:
            with contextlib.suppress(RuntimeError):  # the capture may already be invalidated
                self.graph.capture_end()
            self._close()
        self.reset()

    def _close(self) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            context.close()

    def replay(self) -> None:
        self.graph.replay()

    @property
    def replayer(self) -> Callable[[], None]:
        return self.graph.replay

    def rebind(self, old: torch.Tensor, new: torch.Tensor) -> str | None:
        return "a CUDA graph reads and writes its inputs at the addresses it captured"

    def reset(self) -> None:
        self.graph.reset()
        self.nbytes = self.pool_growth = 0


def pool_id(pool: Any) -> Any:
    """The handle of a CudaPool, or of a bare `torch.cuda.graph_pool_handle()`."""
    return pool.id if isinstance(pool, CudaPool) else pool


def _reserved(device: torch.device) -> int:
    """What the caching allocator holds from the device, graph pools included."""
    return torch.cuda.memory_stats(device).get("reserved_bytes.all.current", 0)
