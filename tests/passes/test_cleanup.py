import torch
from support import aot_graph, targets
from torch.fx.experimental.proxy_tensor import make_fx

from graphopt.passes.cleanup import cse, dce

aten = torch.ops.aten


def test_dce_removes_unused_values_and_keeps_effects():
    graph = aot_graph(lambda x: x.t() @ x, torch.randn(4, 3))
    g = graph.gm.graph
    x = next(n for n in g.nodes if n.op == "placeholder")
    output = next(n for n in g.nodes if n.op == "output")
    with g.inserting_before(output):
        g.call_function(aten.mul.Tensor, (x, 2))            # dead
        g.call_function(aten.add_.Tensor, (x, 1))           # dead value, but a write
        g.call_function(aten.rand.default, ([2],), {"device": torch.device("cpu")})  # a draw
    count = len(g.nodes)

    result = dce(graph.gm)

    assert result.changed and result.counts == {"removed": 1}
    assert len(g.nodes) == count - 1
    assert aten.mul.Tensor not in targets(graph)
    assert aten.add_.Tensor in targets(graph) and aten.rand.default in targets(graph)
    g.lint()


def test_dce_on_a_clean_graph_changes_nothing():
    graph = aot_graph(lambda x: torch.relu(x) + 1, torch.randn(3))
    assert dce(graph.gm).changed is False


def test_cse_merges_pure_duplicates():
    def fn(x, y):
        return x.unsqueeze(1) * y, x.unsqueeze(1) + y, torch.relu(x) - torch.relu(x)

    args = (torch.randn(3), torch.randn(3, 3))
    graph = aot_graph(fn, *args)
    expected = graph(*args)
    result = cse(graph.gm)
    graph.gm.recompile()
    assert result.counts == {"merged": 2}
    assert targets(graph).count(aten.unsqueeze.default) == 1
    assert targets(graph).count(aten.relu.default) == 1
    for a, b in zip(graph(*args), expected):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_cse_never_merges_random_ops():
    graph = aot_graph(lambda x: x + torch.rand(3) - torch.rand(3), torch.randn(3))
    assert targets(graph).count(aten.rand.default) == 2
    assert cse(graph.gm).changed is False
    assert targets(graph).count(aten.rand.default) == 2


def test_cse_does_not_reuse_a_value_across_an_in_place_write():
    graph = aot_graph(lambda x: x * 2, torch.randn(3))
    g = graph.gm.graph
    x = next(n for n in g.nodes if n.op == "placeholder")
    mul = next(n for n in g.nodes if n.target is aten.mul.Tensor)
    with g.inserting_after(mul):
        write = g.call_function(aten.add_.Tensor, (x, 1))
    with g.inserting_after(write):
        again = g.call_function(aten.mul.Tensor, (x, 2))   # reads x after the write
    output = next(n for n in g.nodes if n.op == "output")
    output.args = ((mul, again),)
    assert cse(graph.gm).changed is False
    graph.gm.recompile()
    before, after = graph(torch.ones(3))
    torch.testing.assert_close(after, before + 2)


def test_cse_keeps_two_returned_values_apart():
    """Merged, both outputs would be one tensor: a write into one would show in the other."""
    graph = aot_graph(lambda x: (x * 2, x * 2), torch.randn(3))
    assert cse(graph.gm).changed is False
    graph.gm.recompile()
    a, b = graph(torch.ones(3))
    assert a.data_ptr() != b.data_ptr()


def test_cse_never_merges_a_value_written_in_place():
    def fn(x):
        a = x.clone()
        b = x.clone()
        a.add_(1)
        return a * b

    x = torch.randn(3)
    gm = make_fx(fn)(x)
    assert cse(gm).changed is False
    gm.recompile()
    torch.testing.assert_close(gm(x.clone()), (x + 1) * x)


def test_cse_merges_across_a_random_op():
    """A random op is never merged, but it writes nothing: values around it merge."""
    graph = aot_graph(lambda x: (x * 2) + torch.rand(3) + (x * 2), torch.randn(3))
    assert cse(graph.gm).counts == {"merged": 1}
    assert targets(graph).count(aten.rand.default) == 1
