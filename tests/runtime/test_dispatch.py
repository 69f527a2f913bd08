"""The dispatcher on its own: a batch size in, a mode and a capture size out."""

from __future__ import annotations

import pytest

from graphopt.runtime.dispatch import Dispatch, Dispatcher


@pytest.mark.parametrize("batch,size", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)])
def test_padding_runs_a_batch_at_the_smallest_capture_size_that_holds_it(batch, size):
    assert Dispatcher([8, 1, 4, 2], padding=True)(batch) == Dispatch("graph", size)


@pytest.mark.parametrize("batch", [1, 3, 5, 8])
def test_without_padding_a_batch_runs_at_its_own_size(batch):
    assert Dispatcher([1, 2, 4, 8], padding=False)(batch) == Dispatch("graph", batch)


@pytest.mark.parametrize("padding", [True, False])
def test_a_batch_above_the_largest_size_runs_without_a_graph_and_says_why(padding):
    dispatch = Dispatcher([1, 2, 4, 8], padding=padding)(9)
    assert dispatch.mode == "none" and dispatch.size is None
    assert "9" in dispatch.reason and "8" in dispatch.reason


def test_an_empty_batch_runs_the_compiled_graph_without_a_record():
    assert Dispatcher([1, 2, 4], padding=True)(0) == Dispatch("none")


def test_a_graph_without_a_batch_symbol_runs_its_one_graph():
    assert Dispatcher([1, 2, 4], padding=False)(None) == Dispatch("graph")


@pytest.mark.parametrize("padding,batch,expected", [
    (True, 3, Dispatch("graph", 4)),
    (True, 5, Dispatch("none")),       # above the plan: the plan's reasons say why, not a fallback
    (False, 2, Dispatch("none")),      # not a planned size
    (False, 4, Dispatch("graph", 4)),
])
def test_planned_sizes_give_graphs_only_to_the_plan(padding, batch, expected):
    assert Dispatcher([1, 4], padding=padding, planned=True)(batch) == expected


def test_an_empty_plan_gives_no_graph():
    assert Dispatcher([], padding=True, planned=True)(1) == Dispatch("none")


def test_each_batch_within_the_sizes_is_decided_once():
    dispatcher = Dispatcher([2, 4], padding=True)
    decisions = []
    decide = dispatcher.decide
    dispatcher.decide = lambda batch: decisions.append(batch) or decide(batch)
    for batch in (3, 3, 1, 3, 1, 9, 9):
        dispatcher(batch)
    # Batches above the largest size are not kept: a stream of ever larger ones would grow the table.
    assert decisions == [3, 1, 9, 9]
    assert set(dispatcher.decided) == {1, 3}
