import pytest
import torch
import torch.nn.functional as F
from support import aot_graph, targets

from graphopt.passes.fusion.linear import recompose_linear, recompose_matmul

aten = torch.ops.aten


def check(fn, pass_fn, args, fused_key, fused_count, fused_op, gone):
    graph = aot_graph(fn, *args)
    expected = graph(*args)
    before = len(targets(graph))

    result = pass_fn(graph.gm)
    graph.gm.graph.lint()
    graph.gm.recompile()

    assert result.counts == {fused_key: fused_count}
    assert targets(graph).count(fused_op) == fused_count
    for op in gone:
        assert op not in targets(graph), op
    assert len(targets(graph)) < before
    for a, b in zip(graph(*args), expected):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    return graph


def test_3d_linear_with_and_without_bias():
    x, w, b = torch.randn(2, 5, 8), torch.randn(6, 8), torch.randn(6)
    check(lambda x, w, b: (F.linear(x, w), F.linear(x, w, b)), recompose_linear, (x, w, b),
          "linear", 2, aten.linear.default, [aten.mm.default, aten.addmm.default, aten._unsafe_view.default])


def test_2d_linear_has_no_reshapes():
    x, w = torch.randn(5, 8), torch.randn(6, 8)
    check(lambda x, w: F.linear(x, w), recompose_linear, (x, w),
          "linear", 1, aten.linear.default, [aten.mm.default, aten.t.default])


def test_permuted_weight_as_inductor_writes_the_transpose():
    x, w = torch.randn(2, 5, 8), torch.randn(6, 8)
    check(lambda x, w: x @ w.permute(1, 0), recompose_linear, (x, w),
          "linear", 1, aten.linear.default, [aten.mm.default, aten.permute.default])


def test_plain_mm_against_a_non_transposed_weight_is_left_alone():
    graph = aot_graph(lambda x, w: x @ w, torch.randn(5, 8), torch.randn(8, 6))
    assert recompose_linear(graph.gm).changed is False


def regroups_leading_dims(x, w):
    return (x.reshape(-1, 8) @ w.t()).reshape(5, 2, 6)  # leading dims [2, 5] -> [5, 2]


def regroups_last_dims(x, w):
    return (x.reshape(4, 8) @ w.t()).reshape(2, 4, 3)  # prefix [2, 4] kept, but not a linear of x


@pytest.mark.parametrize("fn,x", [(regroups_leading_dims, torch.randn(2, 5, 8)),
                                  (regroups_last_dims, torch.randn(2, 4, 4))])
def test_reshapes_that_regroup_dims_stay(fn, x):
    """Only the 2-D product becomes a linear; both reshapes stay around it."""
    w = torch.randn(6, 8)
    graph = check(fn, recompose_linear, (x, w), "linear", 1, aten.linear.default, [aten.mm.default])
    linear = next(n for n in graph.gm.graph.nodes if n.target is aten.linear.default)
    assert linear.args[0].target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
    assert next(iter(linear.users)).target in (aten.view.default, aten._unsafe_view.default)


def test_linears_sharing_one_flattened_input():
    x, wq, wk = torch.randn(2, 5, 8), torch.randn(6, 8), torch.randn(4, 8)

    def qk(x, wq, wk):
        flat = x.view(-1, 8)
        return (flat @ wq.t()).view(2, 5, 6), (flat @ wk.t()).view(2, 5, 4)

    check(qk, recompose_linear, (x, wq, wk), "linear", 2, aten.linear.default,
          [aten.mm.default, aten.view.default, aten._unsafe_view.default])


def test_batched_matmul():
    q, k = torch.randn(2, 4, 3, 16), torch.randn(2, 4, 16, 7)
    check(lambda q, k: torch.matmul(q, k), recompose_matmul, (q, k),
          "matmul", 1, aten.matmul.default, [aten.bmm.default, aten.expand.default])


def test_broadcasting_matmul_is_left_alone():
    graph = aot_graph(lambda q, k: torch.matmul(q, k), torch.randn(2, 4, 3, 16), torch.randn(1, 4, 16, 7))
    assert recompose_matmul(graph.gm).changed is False
