"""Device graphs of a step that communicates: the ranks capture together.

A graph with collectives pairs its all-reduces with the other ranks' at every
replay, so the ranks must replay graphs of the same size at the same step, or run
eagerly at the same step. Each rank captures lazily (at a size's first calls after
its warm-ups), so ranks that see the same batch sizes in the same order, with the
same config, capture the same sizes in the same order, as tensor parallelism
requires. `ranks_captured` checks it after each capture with one all-reduce (MAX)
of [failed, size, -size] over the step's own process group: a rank whose capture
failed makes every rank fall back, and ranks at different sizes are an error, not
a hang at the next replay.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._compat import distributed


def ranks_captured(group_names: list[str], size: int, failed: bool) -> bool:
    """True when every rank of every group in `group_names` captured `size` without
    failing; False when any rank failed. Raises when the ranks captured different sizes."""
    everywhere = True
    for name in group_names:
        group = distributed.process_group_named(name)
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        flags = torch.tensor([int(failed), size, -size], dtype=torch.int64, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        any_failed, largest, smallest = (int(f) for f in flags.tolist())
        if largest != -smallest:
            raise RuntimeError(
                f"the ranks of process group {name!r} captured device graphs of different sizes at the same "
                f"step ({-smallest} to {largest}): the ranks of a tensor-parallel step must run the same batch "
                "sizes in the same order with the same cudagraph_capture_sizes")
        everywhere = everywhere and not any_failed
    return everywhere


class Ranks:
    """The process groups a step communicates over, and after each capture whether
    every rank of them captured. It does not capture, nor drop graphs: it only says
    why no rank may replay (`refusal`), so that every rank falls back together."""

    def __init__(self, groups: list[str]):
        self.groups = groups

    def refusal(self, size: int, error: BaseException | None) -> str | None:
        """None when every rank captured `size`; else why no rank replays it (this
        rank's `error`, or another rank's failure). Every rank must call it after
        each capture, failed or not: it is one all-reduce."""
        if ranks_captured(self.groups, size, error is not None):
            return None
        where = f"here ({type(error).__name__}: {error})" if error is not None else "on another rank"
        return f"the capture failed {where}, so no rank of process groups {self.groups} replays it"
