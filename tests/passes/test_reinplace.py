import pytest
import torch
from support import aot_graph, targets

import graphopt
from graphopt.backend.lowering import lower_to_bindings
from graphopt.config import tolerance
from graphopt.passes.constant_fold import fold_constants
from graphopt.passes.reinplace import inplace_variant, reinplace_input_mutations, reinplace_intermediates

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
    assert inplace_variant(aten.pow.Tensor_Scalar) is aten.pow_.Scalar  # torch's schema match


# -- re-inplacing intermediates ---------------------------------------------------------------

def assert_close_to_eager(actual, expected):
    actual, expected = (v if isinstance(v, (tuple, list)) else (v,) for v in (actual, expected))
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        atol, rtol = tolerance(e.dtype)
        assert a.shape == e.shape and a.dtype == e.dtype
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol)


def reinplaced(fn, *args):
    """fn's ATen graph after reinplace_intermediates, checked against eager: the
    outputs, and that no argument was written."""
    graph = aot_graph(fn, *args)
    result = reinplace_intermediates(graph.gm)
    graph.gm.graph.lint()
    graph.gm.recompile()
    before = [a.clone() for a in args]
    assert_close_to_eager(graph(*args), fn(*args))
    for a, b in zip(args, before):
        assert torch.equal(a, b)
    return result, graph


def names(graph) -> list[str]:
    return [t._schema.name.split("::")[1] for t in targets(graph)]


def chain(x, y):
    return ((x * 2).relu() + y).sigmoid() * 3


XY = (torch.randn(4, 8), torch.randn(4, 8))


def test_elementwise_chain_is_written_in_place():
    result, graph = reinplaced(chain, *XY)
    assert result.changed and result.counts == {"inplace": 4}
    assert names(graph) == ["mul", "relu_", "add_", "sigmoid_", "mul_"]  # mul reads the input x


def used_after(x):
    t = x * 2
    return t.relu() + t             # relu stays: t is read again; add writes relu's result


def view_used_after(x):
    t = x * 2
    row = t[0]
    return t.relu() * row           # relu stays: a view of t is read after it


def output_aliases_input(x):
    t = x * 2
    return t.view(-1), t.relu().sin()   # relu stays: t is returned (through a view)


def graph_input(x):
    return x.relu().sin()           # relu stays: x belongs to the caller


@pytest.mark.parametrize("fn,kept,written", [
    (used_after, "relu", "add_"),
    (view_used_after, "relu", "mul_"),
    (output_aliases_input, "relu", "sin_"),
    (graph_input, "relu", "sin_"),
])
def test_not_in_place_when_the_input_is_read_later_or_not_ours(fn, kept, written):
    result, graph = reinplaced(fn, torch.randn(4, 8))
    assert result.counts == {"inplace": 1}
    assert kept in names(graph) and kept + "_" not in names(graph) and written in names(graph)


def broadcast_grows(x):
    return x.sum(1, keepdim=True) + x           # [4, 1] + [4, 8] -> [4, 8]


def int_to_float(x):
    return x.to(torch.int64) * 0.5              # int64 * float -> float32


def half_to_float(x):
    return x.half() + x                         # float16 + float32 -> float32


def overlapping(x):
    t = x * 2
    return t + t.t()                            # add_ would read what it writes


def self_product(x):
    t = x * 2
    return t * t                                # elementwise would be safe; not every op is


def random(x):
    return torch.bernoulli(x.sigmoid())


@pytest.mark.parametrize("fn", [broadcast_grows, int_to_float, half_to_float, overlapping, self_product])
def test_not_in_place_when_the_result_differs_or_overlaps(fn):
    result, graph = reinplaced(fn, torch.randn(8, 8))
    assert not result.changed and result.counts == {}
    assert not any(name.endswith("_") for name in names(graph))


def test_random_ops_stay_out_of_place():
    graph = aot_graph(random, torch.randn(4, 8))
    result = reinplace_intermediates(graph.gm)
    assert result.counts == {} and "bernoulli_" not in names(graph)


def plus_constant(x):
    return torch.arange(24.0).view(3, 8).cos() + x


def test_folded_constants_are_never_written():
    x = torch.randn(3, 8)
    graph = aot_graph(plus_constant, x)
    fold_constants(graph.gm)
    assert any(n.op == "get_attr" for n in graph.gm.graph.nodes)
    result = reinplace_intermediates(graph.gm)
    graph.gm.recompile()
    assert result.counts == {}
    for _ in range(2):  # a write would change the second call
        assert_close_to_eager(graph(x), plus_constant(x))


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 8))

    def forward(self, x):
        return (self.w * 2 + 1) * x     # mul(w) stays: w is a parameter; add and mul are ours


def level_1(fn, dynamic_dims=None, **config):
    return graphopt.optimize(fn, graphopt.GraphOptimizationConfig(graph_opt_level=1, **config),
                             dynamic_dims=dynamic_dims)


def inplace_count(opt) -> int:
    record = next(p for p in opt.report().passes if p.name == "reinplace_intermediates")
    return record.counts.get("inplace", 0)


def test_parameters_are_never_written():
    model = Scaled().eval()
    weight = model.w.detach().clone()
    opt = level_1(model, use_cudagraph=False, dynamic_dims={"x": None})
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(2):
            assert_close_to_eager(opt(x), model(x))
    assert inplace_count(opt) == 2
    assert torch.equal(model.w, weight)


def test_in_place_ops_lower_to_bindings():
    graph = aot_graph(chain, *XY)
    reinplace_intermediates(graph.gm)
    graph.gm.recompile()
    lowered = lower_to_bindings(graph.gm)
    bound = [n.target for n in lowered.graph.nodes if n.op == "call_function"]
    assert torch._C.TensorBase.add_ in bound and torch._C.TensorBase.mul_ in bound
    assert_close_to_eager(lowered(*[XY[i] for i in graph.order]), chain(*XY))


def test_pipeline_with_verify_and_host_graphs():
    verified = level_1(chain, use_cudagraph=False, verify=True)
    replayed = level_1(chain, cudagraph_capture_sizes=[4, 8])
    for batch in (3, 5, 8, 3, 5, 8):
        x, y = torch.randn(batch, 8), torch.randn(batch, 8)
        assert_close_to_eager(verified(x, y), chain(x, y))
        assert_close_to_eager(replayed(x, y), chain(x, y))
    assert inplace_count(verified) == 4 and inplace_count(replayed) == 4
    assert "verify skipped" not in str(verified.report())
    assert replayed.report().replays > 0
