"""Where the CUDA graphs of one shared pool leave their outputs: one block per output
position, outside the pool, shared by every capture size.

A graph's outputs are the one thing in its pool that stays allocated after the
capture, so every capture size kept its own logits in the pool and the other sizes
could not reuse that memory (35 sizes of a 1.1B decoder: a 286 MiB pool against
24 MiB for the largest graph alone). Instead each graph ends with a copy of every
output it allocated into that output's block, and its own output goes back to the
pool for the next capture:

    before: graph(size) -> logits (pool, held between replays)          for every size
    after:  graph(size) -> logits (pool, reused) -> copy -> block[0] viewed at that size

The copy is one kernel per output in the graph. A replay's outputs are then
overwritten by the next replay of any size, which is the runner's contract already
(an output is valid until the next call). Blocks are sized by the first capture
(capture_all() captures the largest first); a larger output later gets a larger
block, and the graphs that write the old one keep it alive through their outputs.
An output on an argument's memory (a returned input or cache), or one that
overlaps itself (an expanded view), is handed out as the graph left it.
"""

from __future__ import annotations

from typing import Any

import torch

from .._compat.names import tree_flatten, tree_unflatten

# An output's layout: (shape, strides, dtype) of a tensor the step allocated, None for anything else.
Layout = tuple[torch.Size, tuple[int, ...], torch.dtype]


def layouts(outputs: Any, args: tuple) -> list[Layout | None]:
    """Each output leaf's layout, from a run outside the capture (a warm-up)."""
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return [(t.shape, t.stride(), t.dtype) if _copyable(t, inputs) else None for t in tree_flatten(outputs)[0]]


def _copyable(value: Any, inputs: set[int]) -> bool:
    return (isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in inputs
            and not any(s == 0 and n > 1 for n, s in zip(value.shape, value.stride())))


def _span(layout: Layout) -> int:
    """Bytes a tensor of this layout reaches from its first element."""
    shape, stride, dtype = layout
    if any(n == 0 for n in shape):
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * dtype.itemsize


class GraphOutputs:
    def __init__(self) -> None:
        self.blocks: dict[int, torch.Tensor] = {}  # output position -> bytes

    def reserve(self, wanted: list[Layout | None], device: torch.device) -> None:
        """Outside a capture: make each output's block hold its layout."""
        for i, layout in enumerate(wanted):
            if layout is None:
                continue
            block = self.blocks.get(i)
            if block is None or block.numel() < _span(layout):
                self.blocks[i] = torch.empty(_span(layout), dtype=torch.uint8, device=device)

    def copy_out(self, outputs: Any, wanted: list[Layout | None]) -> Any:
        """Inside the capture: each output whose layout was reserved, copied into its
        block; returns what the graph's replays hand out."""
        leaves, spec = tree_flatten(outputs)
        for i, (value, layout) in enumerate(zip(leaves, wanted)):
            if layout is None or not isinstance(value, torch.Tensor) or (value.shape, value.stride(),
                                                                         value.dtype) != layout:
                continue
            shape, stride, dtype = layout
            block = self.blocks[i][:_span(layout)]
            leaves[i] = block.view(dtype).as_strided(shape, stride).copy_(value)
        return tree_unflatten(leaves, spec)
