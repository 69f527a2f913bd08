"""The runs a pass is checked by: only the inputs a graph writes are copied and compared."""

import pytest
import torch
import torch.fx

from graphopt import PassVerificationError
from graphopt.passes.checks import GraphRun, Snapshot, check_same

aten = torch.ops.aten


def step(cache, weight, x):
    """A decode step's shape: reads a weight, writes a cache."""
    y = aten.mm.default(x, weight)
    aten.copy_.default(cache, y)
    return (aten.relu.default(y),)


def inputs():
    torch.manual_seed(0)
    return [torch.zeros(2, 3), torch.randn(4, 3), torch.randn(2, 4)]


def test_a_run_copies_and_returns_only_the_inputs_the_graph_writes():
    gm = torch.fx.symbolic_trace(step)
    cache, weight, x = args = inputs()
    run = GraphRun(gm, args)
    out, cache_after = run()
    assert run.written == [0]
    torch.testing.assert_close(cache_after, x @ weight)
    torch.testing.assert_close(out, torch.relu(x @ weight))
    assert not cache.any(), "the caller's cache is left as it was"


def test_a_pass_that_makes_the_graph_write_a_weight_is_an_error():
    gm = torch.fx.symbolic_trace(step)
    run = GraphRun(gm, inputs())
    weight = gm.graph.find_nodes(op="placeholder")[1]
    with gm.graph.inserting_before(gm.graph.output_node()):
        gm.graph.call_function(aten.mul_.Scalar, (weight, 2.0))
    gm.recompile()
    with pytest.raises(PassVerificationError, match=r"pass 'scale' made the graph write its inputs \['weight'\]"):
        run("scale")


def test_check_same_names_the_value_that_differs():
    with pytest.raises(PassVerificationError, match=r"pass 'p' changed the graph's results: value 1 differs"):
        check_same("p", [torch.ones(2), torch.ones(2)], [torch.ones(2), torch.zeros(2)])


def test_an_undone_pass_puts_back_the_value_it_replaced_under_the_same_name():
    gm = torch.fx.symbolic_trace(step)
    gm.register_buffer("_folded_0", torch.ones(3), persistent=False)
    before = Snapshot(gm)
    kept = gm._folded_0
    del gm._folded_0
    gm.register_buffer("_folded_0", torch.zeros(3, dtype=torch.int8), persistent=False)
    gm.register_buffer("_folded_1", torch.zeros(3), persistent=False)
    before.restore(gm)
    assert gm._folded_0 is kept and not hasattr(gm, "_folded_1")
    assert "_folded_0" not in gm.state_dict()
