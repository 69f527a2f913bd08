"""remove_noops and remove_redundant: each rewrite, and the cases where it must not fire."""

import pytest
import torch
from support import aot_graph, targets
from torch.fx.experimental.proxy_tensor import make_fx

import graphopt
from graphopt.passes.redundant import remove_noops, remove_redundant

aten = torch.ops.aten


def traced(fn, *args, mode="fake"):
    """The ATen graph of `fn` as written, in-place ops included (not functionalized)."""
    return make_fx(fn, tracing_mode=mode)(*args)


def apply(pass_fn, gm, *args):
    """Run `pass_fn` on `gm`; check the graph computes exactly what it did before."""
    expected = gm(*[a.clone() for a in args])
    result = pass_fn(gm)
    gm.graph.lint()
    gm.recompile()
    actual = gm(*[a.clone() for a in args])
    for e, a in zip(expected, actual) if isinstance(expected, tuple) else [(expected, actual)]:
        torch.testing.assert_close(a, e, atol=0, rtol=0, equal_nan=True)
        assert a.stride() == e.stride()
    return result


# ---- remove_noops ----

def test_remove_noops_drops_identity_views_and_slices():
    def fn(x):
        y = x[0:4, 0:9]                 # full-range slices (traced as one alias)
        y = y.view(x.shape)             # view to the same shape
        return y.expand(4, 5) * 3       # expand to the same shape

    x = torch.randn(4, 5)
    gm = traced(fn, x)
    assert targets(gm) == [aten.alias.default, aten.view.default, aten.expand.default, aten.mul.Tensor]

    result = apply(remove_noops, gm, x)

    assert result.counts == {"removed": 3}
    assert targets(gm) == [aten.mul.Tensor]


def test_remove_noops_works_on_symbolic_sizes():
    def fn(x):
        return x[: x.shape[0]].reshape(x.shape[0], -1) + 1

    x = torch.randn(5, 3)
    gm = traced(fn, x, mode="symbolic")
    assert aten.slice.Tensor in targets(gm) and aten.view.default in targets(gm)
    apply(remove_noops, gm, x)
    assert targets(gm) == [aten.add.Tensor]


def test_remove_noops_keeps_real_slices_and_views():
    gm = traced(lambda x: x[:, 1:3].reshape(-1) * 2, torch.randn(4, 5))
    result = apply(remove_noops, gm, torch.randn(4, 5))
    assert not result.changed
    assert aten.slice.Tensor in targets(gm)


def test_clone_contiguous_and_same_dtype_casts_are_dropped():
    def fn(x):
        same = x.clone().contiguous().to(torch.float32, copy=True)   # contiguous() traces to nothing
        return same * 2, torch.cat([x + 1]), x.repeat(1, 1) - 1

    x = torch.randn(3, 4)
    gm = traced(fn, x)
    assert aten._to_copy.default in targets(gm)
    result = apply(remove_noops, gm, x)
    assert result.counts == {"removed": 4}
    assert targets(gm) == [aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor]


def test_contiguous_of_a_transpose_stays():
    gm = traced(lambda x: x.t().contiguous().view(-1), torch.randn(3, 4))
    assert not apply(remove_noops, gm, torch.randn(3, 4)).changed
    assert aten.clone.default in targets(gm)


def test_a_cast_that_changes_dtype_stays():
    gm = traced(lambda x: x.to(torch.float16) * 2, torch.randn(3))
    assert not apply(remove_noops, gm, torch.randn(3)).changed
    assert aten._to_copy.default in targets(gm)


def test_a_clone_mutated_later_stays():
    def fn(x):
        y = x.clone()
        z = y * 2          # reads the clone before the write
        y.add_(1)          # the clone is written: it is what keeps x unchanged
        return z, y

    x = torch.randn(3)
    gm = traced(fn, x)
    assert not apply(remove_noops, gm, x).changed
    assert aten.clone.default in targets(gm)


def test_a_clone_of_a_value_written_later_stays():
    def fn(x):
        y = x * 1.5
        snapshot = y.clone()
        y.mul_(2)
        return snapshot + 0.5, y

    x = torch.randn(3)
    gm = traced(fn, x)
    assert not apply(remove_noops, gm, x).changed


def test_a_returned_clone_of_an_input_stays():
    """Returning the input itself would make the output alias the input."""
    gm = aot_graph(lambda x: x.clone(), torch.randn(3)).gm
    assert not remove_noops(gm).changed
    assert targets(gm) == [aten.clone.default]


def test_an_expand_feeding_a_bmm_stays_for_recompose_matmul():
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    graph = aot_graph(lambda a, b: a @ b, a, b)
    assert aten.expand.default in targets(graph)
    remove_noops(graph.gm)
    assert aten.expand.default in targets(graph)


# ---- remove_redundant ----

def test_transposes_that_cancel_are_dropped_from_a_matmul_operand():
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    gm = traced(lambda x, w: x @ w.t().t() + x.transpose(0, 1).transpose(1, 0).sum(), x, w)
    result = apply(remove_redundant, gm, x, w)
    assert result.counts == {"permutes": 2}
    assert aten.t.default not in targets(gm) and aten.transpose.int not in targets(gm)
    assert aten.mm.default in targets(gm)


def test_permutes_cancel_or_become_one():
    def fn(x):
        cancel = x.permute(2, 0, 1).permute(1, 2, 0)
        one = x.permute(1, 0, 2).transpose(0, 2)
        return cancel + 1, one * 2

    x = torch.randn(2, 3, 4)
    gm = traced(fn, x)
    result = apply(remove_redundant, gm, x)
    assert result.counts == {"permutes": 2}
    assert targets(gm).count(aten.permute.default) == 1
    assert aten.transpose.int not in targets(gm)


def test_a_permute_chain_whose_inner_op_has_other_readers_stays():
    def fn(x):
        p = x.permute(1, 0, 2)
        return p.transpose(0, 2) * 2, p + 1

    gm = traced(fn, torch.randn(2, 3, 4))
    assert not apply(remove_redundant, gm, torch.randn(2, 3, 4)).changed


def test_view_and_reshape_chains_of_a_contiguous_tensor_become_one():
    def fn(x):
        return x.view(2, 6).view(3, 4).reshape(12) * 2, x.view(6, 2).view(3, 4) + 1

    x = torch.randn(3, 4)
    gm = traced(fn, x)
    result = apply(remove_redundant, gm, x)
    # view(view(x, [2, 6]), [3, 4]) is x itself; then view(x, [12]) reads x directly
    assert result.counts == {"reshapes": 2}
    (view,) = [n for n in gm.graph.nodes if n.target is aten.view.default]
    assert view.args[0].op == "placeholder" and view.args[1] == [12]


def test_a_view_chain_of_a_non_contiguous_tensor_stays():
    def fn(x):
        t = x.transpose(1, 2)           # [2, 4, 3], not contiguous
        return t.view(2, 2, 2, 3).view(2, 4, 3) * 2

    x = torch.randn(2, 3, 4)
    gm = traced(fn, x)
    result = apply(remove_redundant, gm, x)
    assert "reshapes" not in result.counts


def test_lossless_cast_chains_become_one_cast():
    def fn(x, i):
        return x.to(torch.float64).to(torch.float16), i.to(torch.int64).to(torch.float32)

    x, i = torch.randn(5), torch.randint(-100, 100, (5,), dtype=torch.int32)
    gm = traced(fn, x, i)
    result = apply(remove_redundant, gm, x, i)
    assert result.counts == {"casts": 2}
    assert targets(gm).count(aten._to_copy.default) == 2


LOSSY_CHAINS = {  # x, the cast in between, the final dtype
    "float32 via float16": (torch.tensor([1e-8, 7e4, 3.14159]), torch.float16, torch.float32),
    "float32 via bfloat16": (torch.tensor([1e-8, 7e4, 3.14159]), torch.bfloat16, torch.float32),
    "int64 via int8": (torch.tensor([1, 300, -129]), torch.int8, torch.int32),
    # int8 -> float32 is exact, but float -> int is undefined out of range (-5 -> uint8)
    "int8 via float32 to uint8": (torch.tensor([1, -5, 3], dtype=torch.int8), torch.float32, torch.uint8),
}


@pytest.mark.parametrize("name", LOSSY_CHAINS)
def test_a_lossy_cast_chain_stays(name):
    x, via, to = LOSSY_CHAINS[name]
    gm = traced(lambda x: x.to(via).to(to), x)
    assert targets(gm).count(aten._to_copy.default) == 2
    assert not remove_redundant(gm).changed
    assert targets(gm).count(aten._to_copy.default) == 2


def test_neg_neg_is_dropped():
    gm = traced(lambda x: -(-x) * 3, torch.randn(4))
    assert apply(remove_redundant, gm, torch.randn(4)).counts == {"negs": 1}
    assert targets(gm) == [aten.mul.Tensor]


def test_cat_then_split_into_the_same_pieces_gives_the_pieces_back():
    def fn(a, b):
        first, second = torch.split(torch.cat([a, b * 2], 0), [3, 2], 0)
        return first + 1, second - 1

    a, b = torch.randn(3, 4), torch.randn(2, 4)
    gm = traced(fn, a, b)
    result = apply(remove_redundant, gm, a, b)
    assert result.counts == {"splits": 1}
    assert targets(gm) == [aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor]


def test_cat_then_split_along_the_last_dim_keeps_views_valid():
    """The pieces of a split along dim 1 are strided slices; the inputs are
    contiguous, which every later view accepts."""
    def fn(a, b):
        first, second = torch.cat([a, b], 1).split([3, 2], 1)
        return first.view(2, 2, 3) * 2, second.sum(1)

    a, b = torch.randn(4, 3), torch.randn(4, 2)
    gm = traced(fn, a, b)
    assert apply(remove_redundant, gm, a, b).counts == {"splits": 1}
    assert aten.cat.default not in targets(gm)


def test_split_into_other_pieces_stays():
    def fn(a, b):
        first, second = torch.cat([a, b], 0).split([2, 3], 0)
        return first + 1, second - 1

    a, b = torch.randn(3, 4), torch.randn(2, 4)
    gm = traced(fn, a, b)
    assert not apply(remove_redundant, gm, a, b).changed


def test_a_piece_returned_as_the_input_itself_stays():
    def fn(a, b):
        first, second = torch.cat([a, b], 0).split([3, 2], 0)
        return first, second * 2

    graph = aot_graph(fn, torch.randn(3, 4), torch.randn(2, 4))
    remove_redundant(graph.gm)
    assert aten.cat.default in targets(graph)


# ---- data node conversion: a cast and its inverse ----

@pytest.mark.parametrize("dtype, via", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                        (torch.int32, torch.int64), (torch.float16, torch.float64)])
def test_a_cast_and_its_exact_inverse_are_removed(dtype, via):
    x = (torch.randn(6) * 100).to(dtype)
    gm = traced(lambda x: x.to(via).to(dtype) * 2, x)
    assert apply(remove_redundant, gm, x).counts == {"casts": 1}
    assert targets(gm) == [aten.mul.Tensor]


def test_an_inexact_round_trip_stays_through_the_pipeline():
    def fn(x):
        return x.to(torch.float16).to(torch.float32) * 2

    x = torch.tensor([1e-8, 7e4, 3.14159, 1 / 3])
    opt = graphopt.optimize(fn, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    torch.testing.assert_close(opt(x), fn(x), atol=0, rtol=0)
    assert not torch.equal(opt(x), x * 2)  # float32 -> float16 -> float32 is not exact
    (gm,) = opt.graphs()
    assert targets(gm).count(aten._to_copy.default) == 2


def test_a_returned_round_trip_of_an_input_becomes_one_copy():
    x = torch.randn(4).half()
    gm = traced(lambda x: x.float().half(), x)
    assert apply(remove_redundant, gm, x).counts == {"casts": 1}
    # x itself would make the output alias the input: one same-dtype cast (a copy) stays
    assert targets(gm) == [aten._to_copy.default]
