"""Ranks on one rank (gloo, in this process): every capture ends with one all-reduce,
and a failed capture anywhere refuses device graphs on every rank
(tests/distributed/test_runtime.py runs it on two)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from graphopt.runtime.ranks import Ranks


@pytest.fixture
def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def test_ranks_that_all_captured_agree_and_a_failure_refuses_with_its_reason(world):
    ranks = Ranks([world])
    assert ranks.refusal(4, None) is None
    why = ranks.refusal(4, RuntimeError("out of memory"))
    assert why == f"the capture failed here (RuntimeError: out of memory), so no rank of process groups " \
                  f"{[world]} replays it"
