"""fuse_pooling: chained means (mean over W, then over H) and sum / count become one
mean: a global average pool."""

import pytest
import torch
import torch.nn.functional as F
from support import aot_graph, targets

import graphopt
from graphopt._compat import inductor
from graphopt.config import tolerance
from graphopt.passes.fusion import FUSED_TAG
from graphopt.passes.fusion.pooling import fuse_pooling

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16]


def check(fn, x, counts, dims, keepdim, removed, gone):
    """fuse_pooling on `fn(x)`: exactly `counts`, `removed` nodes fewer, one mean over
    `dims` (of x) left, `gone` absent, and eager's values."""
    with torch.no_grad():
        expected = fn(x)
    graph = aot_graph(fn, x)
    before = len(targets(graph))

    result = fuse_pooling(graph.gm)
    graph.gm.graph.lint()
    graph.gm.recompile()

    assert result.counts == counts
    assert len(targets(graph)) == before - removed
    (mean,) = [n for n in graph.gm.graph.nodes if n.target is aten.mean.dim]
    assert (mean.args[0].op, list(mean.args[1]), mean.args[2]) == ("placeholder", dims, keepdim)
    assert mean.meta[FUSED_TAG] == "fused_mean"
    for op in gone:
        assert op not in targets(graph), op
    atol, rtol = tolerance(expected.dtype)
    torch.testing.assert_close(graph(x)[0], expected, atol=atol, rtol=rtol)


MEANS = {"mean_of_means": 1}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn,counts,dims,keepdim,removed", [
    (lambda x: x.mean(-1).mean(-1), MEANS, [2, 3], False, 1),
    (lambda x: x.mean(3).mean(2), MEANS, [2, 3], False, 1),
    (lambda x: x.mean(-1, keepdim=True).mean(-2, keepdim=True), MEANS, [2, 3], True, 1),
    (lambda x: x.mean(3, keepdim=True).mean(2, keepdim=True), MEANS, [2, 3], True, 1),
    (lambda x: x.mean(-2).mean(-1), MEANS, [2, 3], False, 1),  # H first, then W
    (lambda x: x.mean(-1).mean(-1).mean(-1), {"mean_of_means": 2}, [1, 2, 3], False, 2),
    (lambda x: x.mean(-1, keepdim=True).mean(-1, keepdim=True), MEANS, [3], True, 1),
    (lambda x: x.sum((2, 3)) / 20, {"sum_as_mean": 1}, [2, 3], False, 1),
    (lambda x: x.sum((-1, -2), keepdim=True) / (4 * 5.0), {"sum_as_mean": 1}, [3, 2], True, 1),
    (lambda x: x.sum(-1).sum(-1) / 20, {"sum_of_sums": 1, "sum_as_mean": 1}, [2, 3], False, 2),
], ids=["w_then_h_negative", "w_then_h", "keepdim_negative", "keepdim", "h_then_w", "three_means", "w_twice",
        "sum_over_count", "sum_keepdim_over_float_count", "sums_over_count"])
def test_global_average_pool(fn, counts, dims, keepdim, removed, dtype):
    check(fn, torch.randn(2, 3, 4, 5, dtype=dtype), counts, dims, keepdim, removed,
          [aten.sum.dim_IntList, aten.div.Tensor])


def test_means_of_other_dims_merge_too():
    """Over W, then (W gone) over C: a mean over C and W."""
    check(lambda x: x.mean(-1).mean(-2), torch.randn(2, 3, 4, 5), MEANS, [1, 3], False, 1, [])


def test_adaptive_avg_pool_arrives_as_one_mean():
    graph = aot_graph(lambda x: F.adaptive_avg_pool2d(x, 1), torch.randn(2, 3, 4, 5))
    assert targets(graph) == [aten.mean.dim]
    assert fuse_pooling(graph.gm).counts == {}


@pytest.mark.parametrize("fn,x", [
    (lambda x: x.mean(-1, keepdim=True).mean(-2), torch.randn(2, 3, 4, 5)),  # keepdim differs
    (lambda x: x.sum((2, 3)) / 21, torch.randn(2, 3, 4, 5)),  # not the count
    (lambda x: x.sum((2, 3)) / 20, torch.randn(2, 3, 4, 5, dtype=torch.float16)),  # a float16 sum overflows
    (lambda x: x.sum(-1).sum(-1), torch.randn(2, 3, 4, 5, dtype=torch.float16)),
    (lambda x: x.sum((2, 3)) / 20, torch.randint(0, 9, (2, 3, 4, 5))),  # integers
    (lambda x: x.sum((2, 3), dtype=torch.float64) / 20, torch.randn(2, 3, 4, 5)),  # a cast
    (lambda x: (lambda m: (m.mean(-1), m))(x.mean(-1)), torch.randn(2, 3, 4, 5)),  # the inner mean is read
    (lambda x: x.amax(-1).mean(-1), torch.randn(2, 3, 4, 5)),  # another reduction
])
def test_left_alone(fn, x):
    graph = aot_graph(fn, x)
    before = targets(graph)
    result = fuse_pooling(graph.gm)
    assert result.counts == {} and not result.changed
    assert targets(graph) == before


def test_small_cnn_end_to_end():
    """A small CNN writing out a per-channel PReLU, a mean over W then H and a scaled
    sum: through optimize(), each becomes one fused op in the report."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.slope = torch.nn.Parameter(torch.rand(8) * 0.3)
            self.head = torch.nn.Linear(8, 4)

        def forward(self, x):
            y = self.conv(x)
            y = torch.where(y > 0, y, self.slope.view(1, -1, 1, 1) * y)
            y = y.mean(-1).mean(-1)
            return self.head(0.5 * y + y * 0.25)

    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(2, 3, 8, 8)
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), atol=1e-5, rtol=1e-5)
    fused_ops = opt.report().graphs[0].fused_ops
    assert {name: fused_ops.get(name) for name in ("eltwise_sum", "fused_mean", "prelu")} == \
        {"eltwise_sum": 1, "fused_mean": 1, "prelu": 1}


def test_level_2():
    if not inductor.inductor_available():
        pytest.skip("level 2 needs a C++ compiler")

    class Pool(torch.nn.Module):
        def forward(self, x):
            return x.mean(-1).mean(-1), x.sum((2, 3)) / 16

    model, x = Pool(), torch.randn(2, 3, 4, 4)
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=2, use_cudagraph=False))
    for got, expected in zip(opt(x), model(x)):
        torch.testing.assert_close(got, expected)
    report = opt.report()
    assert next(p for p in report.passes if p.name == "fuse_pooling").counts == \
        {"mean_of_means": 1, "sum_as_mean": 1}
