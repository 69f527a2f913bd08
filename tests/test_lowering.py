import pytest
import torch
from support import aot_graph

import graphopt
from graphopt.backend.lowering import lower_to_bindings

aten = torch.ops.aten


def model(x, w, idx):
    h = torch.nn.functional.linear(x, w).view(2, -1)
    h = torch.softmax(h[:, 1:-1] * 0.5, dim=-1) + h[:, :3].sum()
    return torch.cat([h, h[idx]], 0).to(torch.float64)


ARGS = (torch.randn(4, 8), torch.randn(6, 8), torch.tensor([1, 0]))


def test_lowered_graph_computes_the_same():
    graph = aot_graph(model, *ARGS)
    expected = graph(*ARGS)
    lowered = lower_to_bindings(graph.gm)
    actual = lowered(*[ARGS[i] for i in graph.order])
    for a, b in zip(actual, expected):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_prim_cast_runs_as_to_copy():
    """lower_precision's and the quantization's casts are prims, which run eagerly through
    their Python reference; the executable calls `_to_copy` instead, with the same values."""
    x = torch.randn(4, 8)
    graph = aot_graph(lambda x: (x * 2).to(torch.bfloat16).float() + 1, x)
    for node in graph.gm.graph.nodes:
        if node.target is aten._to_copy.default:
            node.target = torch.ops.prims.convert_element_type.default
            node.args, node.kwargs = (node.args[0], node.kwargs["dtype"]), {}
    graph.gm.recompile()
    expected = graph(x)
    lowered = lower_to_bindings(graph.gm)
    targets = [n.target for n in lowered.graph.nodes if n.op == "call_function"]
    assert torch.ops.prims.convert_element_type.default not in targets
    assert targets.count(aten._to_copy.default) == 2
    for a, b in zip(lowered(*[(x,)[i] for i in graph.order]), expected):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_original_graph_stays_aten():
    graph = aot_graph(model, *ARGS)
    lower_to_bindings(graph.gm)
    ops = [n.target for n in graph.gm.graph.nodes if n.op == "call_function"]
    assert all(isinstance(t, torch._ops.OpOverload) for t in ops)


def test_ops_use_bindings_or_keep_their_overload():
    graph = aot_graph(model, *ARGS)
    lowered = lower_to_bindings(graph.gm)
    for node in lowered.graph.nodes:
        if node.op != "call_function":
            continue
        # every node is either lowered to a C binding or still an exact OpOverload
        assert isinstance(node.target, torch._ops.OpOverload) or type(node.target).__name__ in (
            "builtin_function_or_method", "method_descriptor"), node.target
    bound = [n.target for n in lowered.graph.nodes if n.op == "call_function"
             and not isinstance(n.target, torch._ops.OpOverload)]
    assert torch._C._VariableFunctions.narrow in bound  # slice with constant bounds
    assert len(bound) >= len(list(lowered.graph.nodes)) // 2


@pytest.mark.parametrize("start,end", [(0, 3), (1, -1), (-3, None), (2, 10**18), (-10, 2), (4, 2)])
def test_slice_as_narrow_matches_slice_bounds(start, end):
    x = torch.arange(20.0).view(4, 5)

    def fn(x):
        return x[:, start:end] * 1.0

    graph = aot_graph(fn, x)
    lowered = lower_to_bindings(graph.gm)
    torch.testing.assert_close(lowered(x)[0], fn(x), atol=0, rtol=0)


def test_view_ops_on_symbolic_shapes_use_bindings():
    """FakeTensor's own metadata queries (prim.device) must not disqualify a view's binding."""
    def views(x):
        return x.view(-1, 2, 2).unsqueeze(0).transpose(1, 2).expand(3, -1, -1, -1) * 2

    opt = graphopt.optimize(views, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    for batch in (3, 5):  # the second call runs the dynamic-batch graph
        x = torch.randn(batch, 4)
        torch.testing.assert_close(opt(x), views(x))
    lowered = lower_to_bindings(opt.graphs()[-1])
    overloads = [n.target for n in lowered.graph.nodes
                 if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    assert overloads == []
