"""CapturedGraph on its own, on the host-graph path, with small plain functions:
warm-ups, capture, replay, what a replay copies in, refusals and release."""

from __future__ import annotations

import pytest
import torch

import graphopt
from graphopt import FallbackKind
from graphopt.report import PieceRecord, Report
from graphopt.runtime import native_tape
from graphopt.runtime.capture import CapturedGraph, running_at
from graphopt.runtime.pool import Pool


@pytest.fixture(autouse=True)
def python_replay(monkeypatch):
    """What CapturedGraph does is the same whichever way its host graphs replay: from
    Python these tests never wait for the C++ tape's first build (test_host_graph.py
    tests the tape)."""
    monkeypatch.setattr(native_tape, "ENABLED", False)


class Counted:
    """`x * w + 1`, counting the Python calls: a replay makes none."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, w):
        self.calls += 1
        return x * w + 1


def captured(fn, warmups: int = 2, static=(False, True), **config) -> tuple[CapturedGraph, Report]:
    cfg = graphopt.GraphOptimizationConfig(graph_opt_level=1, cudagraph_capture_sizes=[4, 8],
                                           cudagraph_num_of_warmups=warmups, **config)
    report = Report(1)
    return CapturedGraph(fn, PieceRecord(0, 0), cfg, report, Pool(cfg), list(static)), report


def test_warm_ups_then_one_capture_then_replays():
    fn, w = Counted(), torch.full((4,), 2.0)
    graph, report = captured(fn, warmups=2)
    for i in range(5):
        x = torch.full((4,), float(i))
        torch.testing.assert_close(graph.run_at((4,), (x, w)), x * w + 1)
    assert fn.calls == 3  # two warm-ups and the capture; the rest replayed
    assert [c.size for c in report.captures] == [4]
    assert (report.replays, graph.record.captures, graph.record.replays) == (2, 1, 2)
    assert graph.replayed and graph.owns_outputs
    assert not report.fallbacks


def test_a_replay_reads_the_new_values_of_an_input_at_a_new_address():
    graph, _ = captured(Counted(), warmups=1)
    w = torch.ones(4)
    for _ in range(2):
        graph.run_at((4,), (torch.zeros(4), w))
    x = torch.arange(4.0)  # another tensor: copied into the captured one
    torch.testing.assert_close(graph.run_at((4,), (x, w)), x + 1)
    x.add_(10)  # the same tensor, written in place: the graph reads it where it is
    torch.testing.assert_close(graph.run_at((4,), (x, w)), x + 1)


def test_each_capture_point_has_its_own_graph():
    fn = Counted()
    graph, report = captured(fn, warmups=1)
    w = torch.ones(8)
    with running_at((8,)):  # the point a split graph's pieces read
        for _ in range(3):
            graph(torch.ones(8), w)
    for _ in range(3):
        graph.run_at((4,), (torch.ones(4), w[:4]))
    assert sorted(c.size for c in report.captures) == [4, 8]
    assert set(graph.entries) == {(4,), (8,)} and report.replays == 2


def test_without_a_point_the_function_just_runs():
    fn = Counted()
    graph, report = captured(fn)
    for _ in range(4):
        graph(torch.ones(4), torch.ones(4))
    assert fn.calls == 4 and report.captures == [] and not graph.entries


def test_an_op_a_graph_cannot_replay_refuses_capture_for_good():
    def host_sync(x, w):
        return x * w.sum().item()

    graph, report = captured(host_sync, warmups=1)
    w = torch.ones(4)
    for i in range(4):
        x = torch.full((4,), float(i))
        torch.testing.assert_close(graph.run_at((4,), (x, w)), x * 4)
    assert report.captures == [] and report.replays == 0
    assert report.fallback_counts == {FallbackKind.CAPTURE_REFUSED: 1}
    assert "item" in graph.refused  # the op, for the user's line beside it


def test_outputs_that_require_grad_are_not_captured():
    graph, report = captured(Counted(), warmups=1)
    w = torch.ones(4, requires_grad=True)
    for _ in range(3):
        graph.run_at((4,), (torch.ones(4), w))
    assert report.captures == [] and report.fallback_counts == {FallbackKind.CAPTURE_REFUSED: 1}


def test_a_capture_over_the_memory_budget_is_refused_and_the_function_runs():
    fn = Counted()
    graph, report = captured(fn, warmups=1, graph_memory_budget=1)
    w = torch.ones(4)
    for i in range(4):
        x = torch.full((4,), float(i))
        torch.testing.assert_close(graph.run_at((4,), (x, w)), x + 1)
    assert report.captures == [] and fn.calls == 4
    (refusal,) = report.budget_refusals
    assert (refusal.size, refusal.available) == (4, 1) and refusal.needed > 1
    assert report.fallback_counts == {FallbackKind.CAPTURE_REFUSED: 1} and graph.share.refused_sizes == {4}


def test_release_lets_go_of_a_size_and_a_later_call_captures_it_again():
    fn = Counted()
    graph, report = captured(fn, warmups=1)
    w = torch.ones(4)
    for _ in range(3):
        graph.run_at((4,), (torch.ones(4), w))
    assert report.pool_bytes > 0
    graph.release(4)
    assert not graph.entries and report.pool_bytes == 0
    for _ in range(3):
        graph.run_at((4,), (torch.ones(4), w))
    assert len(report.captures) == 2 and fn.calls == 4  # the first run's check is not repeated
