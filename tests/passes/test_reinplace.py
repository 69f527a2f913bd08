import torch

from graphopt.passes.reinplace import inplace_variant, reinplace_input_mutations
from support import aot_graph, targets

aten = torch.ops.aten


def cache_write(cache, slots, pos, k):
    cache[slots, pos] = k
    return cache[slots].sum(1)


def cache_inputs():
    cache = torch.randn(6, 4, 3)
    return cache, torch.tensor([0, 2, 5]), torch.tensor([1, 3, 0]), torch.randn(3, 3)


def run(graph, *args):
    """Outputs and the mutated state of every argument, on clones."""
    args = [a.clone() for a in args]
    out = graph(*args)
    return out, args


def assert_same_run(before, after):
    (out_a, args_a), (out_b, args_b) = before, after
    for a, b in zip(out_a, out_b):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for a, b in zip(args_a, args_b):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_cache_write_becomes_index_put_():
    args = cache_inputs()
    graph = aot_graph(cache_write, *args)
    assert aten.copy_.default in targets(graph) and aten.index_put.default in targets(graph)
    before = run(graph, *args)

    result = reinplace_input_mutations(graph.gm)
    graph.gm.recompile()

    assert result.changed and result.counts == {"rewritten": 1}
    assert aten.copy_.default not in targets(graph)
    assert aten.index_put.default not in targets(graph)
    assert targets(graph).count(aten.index_put_.default) == 1
    assert_same_run(before, run(graph, *args))


def test_write_is_in_place_on_the_callers_buffer():
    cache, slots, pos, k = cache_inputs()
    graph = aot_graph(cache_write, cache, slots, pos, k)
    reinplace_input_mutations(graph.gm)
    graph.gm.recompile()
    expected = cache.clone()
    expected[slots, pos] = k
    address = cache.data_ptr()
    graph(cache, slots, pos, k)
    assert cache.data_ptr() == address
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


def reads_old_value_after_write(cache, slots, pos, k):
    old = cache * 2
    cache[slots, pos] = k
    return old + cache.sum()


def test_old_value_read_after_write_is_kept_functional():
    args = cache_inputs()
    graph = aot_graph(reads_old_value_after_write, *args)
    # The graph reads the old cache (`cache * 2`) before the write, so the
    # rewrite is allowed; move that read after the write to force the refusal.
    mul = next(n for n in graph.gm.graph.nodes if n.target is aten.mul.Tensor)
    index_put = next(n for n in graph.gm.graph.nodes if n.target is aten.index_put.default)
    index_put.append(mul)
    graph.gm.recompile()
    before = run(graph, *args)

    result = reinplace_input_mutations(graph.gm)
    graph.gm.recompile()

    assert not result.changed and result.counts == {"kept": 1}
    assert aten.copy_.default in targets(graph)
    assert_same_run(before, run(graph, *args))


def write_through_select(cache, idx, v):
    cache[1][idx] = v
    return cache.sum(0)


def test_write_through_a_view_is_reinplaced():
    args = (torch.randn(3, 5, 2), torch.tensor([0, 4]), torch.randn(2, 2))
    graph = aot_graph(write_through_select, *args)
    before = run(graph, *args)

    result = reinplace_input_mutations(graph.gm)
    graph.gm.recompile()

    assert result.counts == {"rewritten": 1}
    assert aten.copy_.default not in targets(graph)
    assert aten.select_scatter.default not in targets(graph)
    assert aten.index_put_.default in targets(graph)
    assert_same_run(before, run(graph, *args))


def test_inplace_variant_lookup():
    assert inplace_variant(aten.add.Tensor) is aten.add_.Tensor
    assert inplace_variant(aten.index_put.default) is aten.index_put_.default
    assert inplace_variant(aten.mm.default) is None  # no mm_
    assert inplace_variant(aten.add_.Tensor) is None  # already in place
