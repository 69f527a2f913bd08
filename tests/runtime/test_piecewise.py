"""Piecewise graphs: a graph with an op a device graph cannot replay, or one the
user lists, is split there; the safe pieces replay, the rest run between them."""

import pytest
import torch

import graphopt
from graphopt import FallbackKind


def config(**kw):
    kw.setdefault("graph_opt_level", 1)
    kw.setdefault("cudagraph_capture_sizes", [2, 4])
    kw.setdefault("cudagraph_num_of_warmups", 1)
    return graphopt.GraphOptimizationConfig(**kw)


def masked_step(x, w):
    h = torch.relu(x @ w)
    # A boolean-mask write of a tensor: a data-dependent count, refused by a capture
    # (torch >= 2.15 turns `h[mask] = 1.0` into masked_fill_, which a capture can replay).
    h[(h > 1.0).any(dim=1)] = w[0]
    return torch.tanh(h @ w) + 1


def run(opt, fn, batches, w):
    for batch in batches:
        x = torch.randn(batch, 8)
        torch.testing.assert_close(opt(x, w), fn(x, w))


@pytest.mark.parametrize("level", [0, 1])
def test_an_unsafe_op_splits_the_graph_and_the_safe_pieces_replay(level):
    w = torch.randn(8, 8)
    opt = graphopt.optimize(masked_step, config(graph_opt_level=level), dynamic_dims={"x": 0})
    run(opt, masked_step, [3, 3, 3, 3], w)
    report = opt.report()
    (pieces,) = report.pieces
    assert [p.split_reason is None for p in pieces] == [True, False, True]
    assert "boolean-mask assignment" in pieces[1].split_reason and "test_piecewise.py" in pieces[1].split_reason
    assert [p.replays for p in pieces] == [2, 0, 2]  # a first run, the capture, then replays
    assert {c.size for c in report.captures} == {4}
    assert "runs between replays" in str(report)


def test_full_mode_refuses_a_graph_it_cannot_capture_and_says_why():
    w = torch.randn(8, 8)
    opt = graphopt.optimize(masked_step, config(cudagraph_mode="full"), dynamic_dims={"x": 0})
    run(opt, masked_step, [3, 3, 3], w)
    assert opt.report().fallback_counts == {FallbackKind.NO_DEVICE_GRAPH: 1}
    assert opt.report().captures == []


def mlp(x, w):
    return torch.relu(x @ w) @ w


def test_user_splitting_ops_split_where_asked():
    w = torch.randn(8, 8)
    opt = graphopt.optimize(mlp, config(cudagraph_splitting_ops=["aten.relu"]), dynamic_dims={"x": 0})
    run(opt, mlp, [2, 2, 2, 3, 3, 3], w)
    (pieces,) = opt.report().pieces
    assert [p.split_reason for p in pieces][1] == "aten.relu is in cudagraph_splitting_ops (at " + \
        pieces[1].split_reason.split("(at ")[1]
    assert [p.split_reason is None for p in pieces] == [True, False, True]
    assert all(p.replays == 2 for p in pieces if p.split_reason is None)


def test_cudagraph_mode_none_runs_no_device_graph():
    w = torch.randn(8, 8)
    opt = graphopt.optimize(mlp, config(cudagraph_mode="none"), dynamic_dims={"x": 0})
    run(opt, mlp, [3, 3, 3], w)
    assert opt.report().captures == [] and opt.report().pieces == []


def test_splitting_ops_are_validated():
    with pytest.raises(ValueError, match="'aten.no_such_op' at index 0 is not an ATen op"):
        graphopt.GraphOptimizationConfig(graph_opt_level=1, cudagraph_splitting_ops=["aten.no_such_op"])
    with pytest.raises(ValueError, match="cudagraph_mode must be one of 'none', 'piecewise', 'full' or null"):
        graphopt.GraphOptimizationConfig(graph_opt_level=1, cudagraph_mode="partial")
