"""The dispatcher: the one place that decides how a call runs, from its batch size.

    batch -> Dispatch(mode, size, reason)

`mode` is "graph" (run at capture size `size`, padding the batch up to it) or
"none" (run the compiled graph directly, `reason` says why). A pure function of
the batch: no tensors, no state.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dispatch:
    mode: str                 # "graph" | "none"
    size: int | None = None   # the capture size (None: a graph without a batch symbol)
    reason: str | None = None  # why "none", when it is worth a fallback record


class Dispatcher:
    """Capture sizes and whether padding is legal decide every call.

    With padding, a batch runs at the smallest capture size >= it. Without
    (a static input or an output is tied to the exact batch), it runs at exactly
    its own size, as long as that is within the largest capture size. With
    `planned` sizes (capture sizes "auto"), only the planned sizes get graphs and
    a batch the plan leaves out runs without one, with no fallback record: the
    plan's reasons (`report().plans`) say why. Each batch up to the largest size
    is decided once: a re-plan makes a new Dispatcher.
    """

    def __init__(self, capture_sizes: list[int] | tuple[int, ...], padding: bool, planned: bool = False):
        self.sizes = sorted(capture_sizes)
        self.padding = padding
        self.planned = planned
        self.largest = self.sizes[-1] if self.sizes else 0
        self.decided: dict[int | None, Dispatch] = {}  # the few batches a step sees, decided once

    def __call__(self, batch: int | None) -> Dispatch:
        dispatch = self.decided.get(batch)
        if dispatch is None:
            dispatch = self.decide(batch)
            if batch is None or batch <= self.largest:
                self.decided[batch] = dispatch
        return dispatch

    def decide(self, batch: int | None) -> Dispatch:
        if batch is None:
            return Dispatch("graph")
        if batch == 0:
            return Dispatch("none")  # nothing to replay: the compiled code handles (or rejects) it as eager does
        if self.planned and (not self.sizes or batch > self.sizes[-1]):
            return Dispatch("none")
        if batch > self.sizes[-1]:
            return Dispatch("none", reason=f"batch size {batch} is above the largest capture size "
                                           f"{self.sizes[-1]}; running without a device graph")
        if not self.padding:
            return Dispatch("graph", batch) if not self.planned or batch in self.sizes else Dispatch("none")
        return Dispatch("graph", next(s for s in self.sizes if s >= batch))
