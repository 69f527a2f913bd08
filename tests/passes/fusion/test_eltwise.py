"""fuse_eltwise: scalar coefficients of a binary sum folded into add/sub's alpha."""

import pytest
import torch
from support import aot_graph, targets

import graphopt
from graphopt._compat import inductor
from graphopt.config import tolerance
from graphopt.passes.fusion import FUSED_TAG
from graphopt.passes.fusion.eltwise import fuse_eltwise

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16]


def fused(fn, *args):
    """`fn`'s ATen graph after fuse_eltwise, its result and its node count before."""
    graph = aot_graph(fn, *args)
    before = len(targets(graph))
    result = fuse_eltwise(graph.gm)
    graph.gm.graph.lint()
    graph.gm.recompile()
    return graph, result, before


def assert_eager(graph, fn, args):
    with torch.no_grad():
        expected = fn(*args)
    atol, rtol = tolerance(expected.dtype)
    torch.testing.assert_close(graph(*args)[0], expected, atol=atol, rtol=rtol)


FORMS = [
    # fn, pass counts, the alpha it ends with, the op it sits on, the products left
    (lambda x1, x2: x1 * 0.3 + x2 * 0.7, {"scaled_sum": 1}, 0.7, aten.add.Tensor, 1),
    (lambda x1, x2: 0.3 * x1 + 0.7 * x2, {"scaled_sum": 1}, 0.7, aten.add.Tensor, 1),
    (lambda x1, x2: x1 * 0.25 + x2 * 0.5, {"scaled_sum": 1}, 0.5, aten.add.Tensor, 1),
    (lambda x1, x2: x1 * 2 - x2 * 3, {"scaled_difference": 1}, 3, aten.sub.Tensor, 1),
    (lambda x1, x2: x1 + x2 * 0.7, {"scaled_sum": 1}, 0.7, aten.add.Tensor, 0),
    (lambda x1, x2: x1 * 0.3 + x2, {"scaled_sum": 1}, 0.3, aten.add.Tensor, 0),
    (lambda x1, x2: x1 - 1.5 * x2, {"scaled_difference": 1}, 1.5, aten.sub.Tensor, 0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn,counts,alpha,op,products", FORMS, ids=[
    "both", "coefficients_on_the_left", "coefficients_like_the_traced_ones", "difference", "right_only",
    "left_only", "difference_right_only"])
def test_scaled_sums(fn, counts, alpha, op, products, dtype):
    args = (torch.randn(4, 8, dtype=dtype), torch.randn(4, 8, dtype=dtype))
    graph, result, before = fused(fn, *args)
    assert result.counts == counts
    assert len(targets(graph)) == before - 1
    assert targets(graph).count(aten.mul.Tensor) == products
    (sum_node,) = [n for n in graph.gm.graph.nodes if "alpha" in n.kwargs]
    assert sum_node.target is op and sum_node.kwargs["alpha"] == alpha
    assert sum_node.meta[FUSED_TAG] == "eltwise_sum"
    assert_eager(graph, fn, args)


def test_broadcast_operands():
    fn = lambda x1, x2: x1 * 0.3 + x2 * 0.7  # noqa: E731
    args = (torch.randn(1, 8), torch.randn(4, 8))
    graph, result, _ = fused(fn, *args)
    assert result.counts == {"scaled_sum": 1}
    assert_eager(graph, fn, args)


@pytest.mark.parametrize("fn,args", [
    # the sum promotes: alpha * x2 would skip eager's bfloat16 rounding of x2 * 0.7
    (lambda x1, x2: x1 * 0.3 + x2 * 0.7, (torch.randn(4, 8), torch.randn(4, 8, dtype=torch.bfloat16))),
    # integer tensors
    (lambda x1, x2: x1 * 2 + x2 * 3, (torch.arange(8), torch.arange(8))),
    # tensor coefficients
    (lambda x1, x2: x1 * x2[0] + x2 * x1[0], (torch.randn(4, 8), torch.randn(4, 8))),
    # a coefficient that is not finite
    (lambda x1, x2: x1 + x2 * float("inf"), (torch.randn(4, 8), torch.randn(4, 8))),
    # the scaled value has another reader
    (lambda x1, x2: (lambda s: (x1 + s, s.sum()))(x2 * 0.7), (torch.randn(4, 8), torch.randn(4, 8))),
    # division, not a product
    (lambda x1, x2: x1 + x2 / 3, (torch.randn(4, 8), torch.randn(4, 8))),
])
def test_left_alone(fn, args):
    graph = aot_graph(fn, *args)
    before = targets(graph)
    assert fuse_eltwise(graph.gm).counts == {}
    assert targets(graph) == before


def test_level_2():
    if not inductor.inductor_available():
        pytest.skip("level 2 needs a C++ compiler")

    class Blend(torch.nn.Module):
        def forward(self, x1, x2):
            return torch.relu(x1 * 0.3 + x2 * 0.7)

    model, args = Blend(), (torch.randn(4, 8), torch.randn(4, 8))
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=2, use_cudagraph=False))
    torch.testing.assert_close(opt(*args), model(*args))
    report = opt.report()
    assert next(p for p in report.passes if p.name == "fuse_eltwise").counts == {"scaled_sum": 1}
    assert report.graphs[0].fused_ops.get("eltwise_sum") == 1
