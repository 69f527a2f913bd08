"""A rank that dies or hangs mid-generation gives a clear error within a
deadline, never a hang: the surviving rank's collective (inside a host-graph
replay) raises, and the harness names what each rank did."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from harness import RanksFailed, run_ranks

import graphopt

COLLECTIVE_TIMEOUT = 5.0  # seconds a rank waits for its peer in a collective


class Summed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x @ self.weight, "sum", dist.group.WORLD)


def stop_mid_generation(rank: int, world: int, how: str) -> int:
    """Steps with host graphs; at step 6 rank 1 dies (`how="dies"`) or hangs."""
    opt = graphopt.optimize(Summed(), graphopt.GraphOptimizationConfig(graph_opt_level=0, max_num_seqs=4))
    with torch.inference_mode():
        for step in range(10):
            if rank == 1 and step == 6:
                if how == "hangs":  # far longer than a collective waits, then gone without a result
                    time.sleep(3 * COLLECTIVE_TIMEOUT)
                os._exit(3)
            opt(torch.randn(3, 8))
    return opt.report().replays


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_rank_that_dies_or_hangs_is_a_clear_error_not_a_hang(how):
    start = time.monotonic()
    with pytest.raises(RanksFailed) as failed:
        run_ranks(stop_mid_generation, how, timeout=90, collective_timeout=COLLECTIVE_TIMEOUT)
    assert time.monotonic() - start < 90
    survivor, stopped = failed.value.outcomes
    # The survivor's all_reduce (in a host-graph replay) raised: it did not wait forever.
    assert survivor.startswith("raised"), survivor
    assert stopped == "exited with code 3 without a result", stopped
