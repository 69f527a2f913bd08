"""Which device graph, pool and warm-up stream a device gets: the one place that
knows both implementations of `DeviceGraph`."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ..config import CAPTURE_ERROR_MODES
from .cuda_graph import CudaGraph, CudaPool, on_capture_stream
from .device_graph import DeviceGraph
from .host_arena import HostPool
from .host_graph import HostGraph


def default_place() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def device_graph(place: torch.device | str | None = None, mode: str = "thread_local", pool: Any = None) -> DeviceGraph:
    """A device graph on `place` (default: CUDA where present, else the CPU): a CUDA
    graph captured in `mode` ("global" | "thread_local" | "relaxed"), or a host graph.
    `pool`: from `graph_pool_handle()`, shared with the other graphs given it."""
    if mode not in CAPTURE_ERROR_MODES:
        raise ValueError(f"mode must be one of {CAPTURE_ERROR_MODES}, got {mode!r}")
    device = torch.device(place) if place is not None else default_place()
    if device.type == "cuda":
        return CudaGraph(device, mode, pool)
    if device.type == "cpu":
        return HostGraph(pool)
    raise ValueError(f"device graphs run on CUDA or the CPU, not {device}")


def graph_pool_handle(place: torch.device | str | None = None) -> Any:
    """A memory pool that device graphs on `place` can share (pool mode 1), alive
    while this object is."""
    device = torch.device(place) if place is not None else default_place()
    return CudaPool(device) if device.type == "cuda" else HostPool()


@contextlib.contextmanager
def warmup_stream(device: torch.device) -> Iterator[None]:
    """Where warm-ups run: on CUDA the capture stream, so the library state and
    the caching allocator's blocks a capture will meet already exist there."""
    if device.type != "cuda":
        yield
        return
    with on_capture_stream(device):
        yield
