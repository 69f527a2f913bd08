"""The CUDA backend of DeviceGraph: `torch.cuda.CUDAGraph`, captured on a side stream."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .safety import CaptureGuard


class CudaGraph:
    def __init__(self, device: torch.device, mode: str, pool: Any = None):
        self.device = device
        self.mode = mode
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()
        # Capture may not run on the default stream: the legacy stream cannot be captured.
        self.stream = torch.cuda.Stream(device)
        self.nbytes = 0
        self._context: list[Any] = []

    def capture_begin(self) -> None:
        torch.cuda.synchronize(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        stream = torch.cuda.stream(self.stream)
        guard = CaptureGuard()
        stream.__enter__()
        guard.__enter__()
        self._context = [guard, stream]
        self._allocated = torch.cuda.memory_allocated(self.device)
        self.graph.capture_begin(pool=self.pool, capture_error_mode=self.mode)

    def capture_end(self, outputs: Sequence[torch.Tensor] | None = None) -> None:
        try:
            self.graph.capture_end()
        finally:
            for context in self._context:
                context.__exit__(None, None, None)
            self._context = []
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.nbytes = max(torch.cuda.memory_allocated(self.device) - self._allocated, 0)

    def replay(self) -> None:
        self.graph.replay()

    def reset(self) -> None:
        self.graph.reset()
        self.nbytes = 0
