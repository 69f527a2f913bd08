"""fuse_matmul_transpose: a materialised transpose read by a matmul becomes the
transposed view; with frozen weights, constant folding has made it a constant."""

import pytest
import torch
from support import aot_graph, targets

import graphopt
from graphopt.config import tolerance
from graphopt.passes.fusion.linear import fuse_matmul_transpose

aten = torch.ops.aten
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)


def t_contiguous_rhs(x, w):
    return x @ w.t().contiguous()


def t_contiguous_lhs(w, x):
    return w.t().contiguous() @ x


def transpose_contiguous_3d(q, k):
    return torch.matmul(q, k.transpose(-1, -2).contiguous())


def transpose_contiguous_4d(q, k):  # attention scores: the view merges batch and heads
    return torch.matmul(q, k.transpose(-1, -2).contiguous()) * 0.25


def mt_contiguous(q, k):
    return q @ k.mT.contiguous()


def permute_contiguous(q, k):
    return torch.matmul(q, k.permute(0, 1, 3, 2).contiguous())


def bmm_of_transpose_clone(q, k):
    return torch.bmm(q, k.transpose(1, 2).clone(memory_format=torch.contiguous_format))


def addmm_of_t_contiguous(b, x, w):
    return torch.addmm(b, x, w.t().contiguous())


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


FORMS = {
    "t_contiguous_rhs": (t_contiguous_rhs, lambda d: (rand(5, 8, dtype=d), rand(6, 8, dtype=d))),
    "t_contiguous_lhs": (t_contiguous_lhs, lambda d: (rand(6, 5, dtype=d), rand(6, 8, dtype=d))),
    "transpose_3d": (transpose_contiguous_3d, lambda d: (rand(2, 5, 8, dtype=d), rand(2, 6, 8, dtype=d))),
    "transpose_4d": (transpose_contiguous_4d, lambda d: (rand(2, 3, 5, 8, dtype=d), rand(2, 3, 6, 8, dtype=d))),
    "mT": (mt_contiguous, lambda d: (rand(2, 3, 5, 8, dtype=d), rand(2, 3, 6, 8, dtype=d))),
    "permute": (permute_contiguous, lambda d: (rand(2, 3, 5, 8, dtype=d), rand(2, 3, 6, 8, dtype=d))),
    "bmm": (bmm_of_transpose_clone, lambda d: (rand(2, 5, 8, dtype=d), rand(2, 6, 8, dtype=d))),
    "addmm": (addmm_of_t_contiguous, lambda d: (rand(6, dtype=d), rand(5, 8, dtype=d), rand(6, 8, dtype=d))),
}


def fused(fn, args):
    graph = aot_graph(fn, *args)
    expected = graph(*args)
    before = targets(graph)
    result = fuse_matmul_transpose(graph.gm)
    graph.gm.graph.lint()
    graph.gm.recompile()
    return graph, expected, before, result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_each_written_form_loses_its_copy(form, dtype):
    fn, make_args = FORMS[form]
    args = make_args(dtype)
    graph, expected, before, result = fused(fn, args)

    after = targets(graph)
    assert result.counts == {"copies_removed": 1}
    assert before.count(aten.clone.default) == 1 and aten.clone.default not in after
    assert len(after) == len(before) - 1
    assert sorted(map(str, (t for t in after if t in MATMULS))) == \
        sorted(map(str, (t for t in before if t in MATMULS)))
    # The matmul now reads the transposing view itself.
    matmul = next(n for n in graph.gm.graph.nodes if n.target in MATMULS)
    assert any(a.target in (aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default,
                            aten.view.default) for a in matmul.all_input_nodes)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(graph(*args), expected, atol=atol, rtol=rtol)


def test_fake_values_follow_the_new_strides():
    args = FORMS["transpose_4d"][1](torch.float32)
    graph, *_ = fused(transpose_contiguous_4d, args)
    for node in graph.gm.graph.nodes:
        if node.target in (aten.expand.default, aten.view.default) and node.args[0].target is aten.transpose.int:
            assert node.meta["val"].stride() == node.args[0].meta["val"].stride()


def test_permute_that_needs_the_copy_for_the_batched_view_stays():
    """[b, n, h, d] -> [b, h, d, n]: b and h cannot be merged into one batch dim
    without the copy."""
    graph, _, _, result = fused(lambda q, k: torch.matmul(q, k.permute(0, 2, 3, 1).contiguous()),
                                (torch.randn(2, 3, 5, 8), torch.randn(2, 6, 3, 8)))
    assert not result.changed and aten.clone.default in targets(graph)


def test_copy_read_by_something_else_stays():
    def also_returned(x, w):
        wt = w.t().contiguous()
        return x @ wt, wt

    graph, _, _, result = fused(also_returned, (torch.randn(5, 8), torch.randn(6, 8)))
    assert not result.changed and aten.clone.default in targets(graph)


def test_copy_of_a_value_written_in_place_stays():
    def snapshot_then_write(x, w):
        wt = w.t().contiguous()
        w.add_(1)
        return x @ wt

    graph, _, _, result = fused(snapshot_then_write, (torch.randn(5, 8), torch.randn(6, 8)))
    assert not result.changed and aten.clone.default in targets(graph)


def test_copy_that_is_not_a_transpose_stays():
    graph, _, _, result = fused(lambda x, w: x @ w.contiguous(), (torch.randn(5, 8), torch.randn(8, 6)[:, :4]))
    assert not result.changed


class TransposedWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 8))

    def forward(self, x):
        return (x @ self.weight.t().contiguous()).relu()


def optimized(model, freeze):
    config = graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False, freeze_parameters=freeze)
    return graphopt.optimize(model, config)


def test_end_to_end_the_matmul_reads_the_weight_as_a_linear():
    model = TransposedWeight().eval()
    opt = optimized(model, freeze=False)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    report = opt.report()
    record = next(p for p in report.passes if p.name == "fuse_matmul_transpose")
    assert record.counts == {"copies_removed": 1}
    ops = targets(opt.graphs()[0])
    assert aten.clone.default not in ops and aten.linear.default in ops


def test_end_to_end_with_a_dynamic_batch_the_batched_view_takes_symbolic_sizes():
    opt = optimized(transpose_contiguous_4d, freeze=False)
    for batch in (2, 3):
        q, k = torch.randn(batch, 3, 5, 8), torch.randn(batch, 3, 6, 8)
        torch.testing.assert_close(opt(q, k), transpose_contiguous_4d(q, k))
    records = [p for p in opt.report().passes if p.name == "fuse_matmul_transpose"]
    assert records[-1].counts == {"copies_removed": 1}
    assert aten.clone.default not in targets(opt.graphs()[-1])


def test_with_frozen_weights_the_transpose_is_folded_into_a_constant():
    model = TransposedWeight().eval()
    opt = optimized(model, freeze=True)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        (gm,) = opt.graphs()
        ops = targets(gm)
        assert aten.clone.default not in ops and aten.t.default not in ops
        mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
        constant = getattr(gm, mm.args[1].target)
        torch.testing.assert_close(constant, model.weight.t(), atol=0, rtol=0)

        model.weight.mul_(2)
        assert opt.refresh() == 1
        torch.testing.assert_close(opt(x), model(x))
