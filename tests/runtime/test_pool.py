"""PoolShare on its own: what one captured graph's device graphs hold of the pools, and
graph_memory_budget, checked before a capture and as the most a capture may grow by."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import graphopt
from graphopt import FallbackKind
from graphopt.report import Report
from graphopt.runtime.device_graph import PoolBudgetExceeded
from graphopt.runtime.pool import Pool, PoolShare, pools_with

CPU = torch.device("cpu")


def graph(nbytes: int) -> SimpleNamespace:
    """What a PoolShare reads of a captured device graph."""
    return SimpleNamespace(nbytes=nbytes, pool_growth=0)


def share(budget: int | None, report: Report, name: str = "graph 0") -> PoolShare:
    """A share whose graphs each have a pool of their own, so bytes are the graphs' own."""
    config = graphopt.GraphOptimizationConfig(
        graph_opt_level=1, graph_memory_budget=budget, reuse_pool_in_same_graph=False)
    return PoolShare(Pool(config), config, report, name)


def test_captures_are_accounted_and_a_release_gives_the_bytes_back():
    report = Report(1)
    pieces = share(None, report)
    four, eight = graph(400), graph(800)
    pieces.add(4, four)
    pieces.add(8, eight)
    assert report.pool_bytes == 1200 and pieces.held() == 1200
    pieces.remove(eight)
    pieces.released(8)
    assert report.pool_bytes == 400 and pieces.max_growth() is None


def test_the_next_size_is_estimated_from_the_largest_graph_scaled_by_batch():
    report = Report(1)
    pieces = share(None, report)
    pieces.add(4, graph(400))
    assert pieces.bytes_at(8) == 400 + 800  # a pool each: the graphs held, and one of 8 rows


def test_a_capture_over_the_budget_is_refused_before_it_starts_and_reported():
    report = Report(1)
    pieces = share(1000, report)
    pieces.add(4, graph(400))
    assert pieces.fits(CPU, 2)  # 400 + 200 <= 1000
    assert not pieces.fits(CPU, 8)  # 400 + 800 > 1000
    (refusal,) = report.budget_refusals
    assert (refusal.size, refusal.needed, refusal.available) == (8, 1200, 1000)
    assert pieces.refused_sizes == {8} and report.fallback_counts == {FallbackKind.CAPTURE_REFUSED: 1}
    pieces.released(8)
    assert pieces.refused_sizes == set()


def test_the_budget_counts_every_other_graphs_pools_and_a_grown_capture_is_refused():
    report = Report(1)
    first, second = share(1000, report, "graph 0"), share(1000, report, "graph 1")
    first.add(4, graph(700))
    assert second.max_growth() == 300
    second.exceeded(4, PoolBudgetExceeded(needed=500, available=second.max_growth()))
    (refusal,) = report.budget_refusals
    assert (refusal.piece, refusal.size, refusal.needed, refusal.available) == ("graph 1", 4, 500, 300)
    assert second.refused_sizes == {4} and first.refused_sizes == set()


def test_the_planner_sees_every_pool_with_a_runners_pieces_at_a_new_size():
    report = Report(1)
    other, piece = share(None, report, "graph 0"), share(None, report, "graph 1")
    other.add(4, graph(1000))
    piece.add(4, graph(100))
    assert pools_with([piece], report, 8) == 1000 + 100 + 200
