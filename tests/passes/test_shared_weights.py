"""Weights once per model (shared_weights.py): two graphs of one model that fold, pack or
quantize the same weights the same way hold one copy, which refresh() still updates."""

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import graphopt
from graphopt.passes import shared_weights


class TwoWays(torch.nn.Module):
    """A gated MLP whose flag Dynamo specialises on: one graph per value, the same weights."""

    def __init__(self):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(64, 256, bias=False), torch.nn.Linear(64, 256, bias=False)
        self.down = torch.nn.Linear(256, 64, bias=False)

    def forward(self, x, doubled: bool):
        y = self.down(F.silu(self.gate(x)) * self.up(x))
        return y * 2 if doubled else y


def held(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """The large tensors a graph holds (folded, packed, quantized weights)."""
    return {name: t for name, t in gm.named_buffers() if t.numel() * t.element_size() >= 16384}


@pytest.mark.parametrize("options", [{}, {"weight_quantization": "int8"}, {"weight_quantization": "int4"}],
                         ids=["packed", "int8", "int4"])
def test_two_graphs_of_one_model_hold_one_copy_of_each_weight(options):
    torch.manual_seed(0)
    model = TwoWays().eval()
    step = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, freeze_parameters=True, use_cudagraph=False, cache_dir=None, precision_tolerance=None,
        **options))
    x = torch.randn(4, 64)
    with torch.no_grad():
        first, second = step(x, False), step(x, True)
        one, two = step.graphs()
        assert held(one) and len(held(one)) == len(held(two)), (sorted(held(one)), sorted(held(two)))
        assert {id(t) for t in held(one).values()} == {id(t) for t in held(two).values()}
        # The report says so: the first graph computed the values, the second took them.
        nbytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                      for _, t in one.named_buffers()}.values())
        records = step.report().graphs
        assert [r.weight_bytes for r in records] == [{"new": nbytes, "shared": 0}, {"new": 0, "shared": nbytes}]
        assert f"weights beyond the parameters: {nbytes / 2**20:.2f} MiB computed, 0.00 MiB shared" in \
            str(step.report())
        model.up.weight.mul_(1.5)  # each graph's refresh() recomputes the one copy in place
        expected = [model(x, False), model(x, True)]
        tolerance = {"atol": 1e-5, "rtol": 1e-4} if not options else {"atol": 0.1, "rtol": 0.1}
        for got, want in zip([step(x, False), step(x, True)], expected):
            torch.testing.assert_close(got, want, **tolerance)
    assert first.shape == second.shape


def test_a_value_is_not_shared_with_a_new_tensor_at_a_freed_ones_address():
    """The key names a tensor by id(): an entry must match the very tensor it was made from."""
    recipe_graph = torch.fx.Graph()
    w = recipe_graph.placeholder("w")
    recipe_graph.output(recipe_graph.call_function(torch.ops.aten.mul.Tensor, (w, 2.0)))
    recipe = torch.fx.GraphModule(torch.nn.Module(), recipe_graph)
    weight = torch.randn(8)
    found = shared_weights.key(recipe, {"w": weight})
    value = weight * 2
    shared_weights.share(found, value)
    assert shared_weights.find(shared_weights.key(recipe, {"w": weight})) is value
    assert shared_weights.find(shared_weights.key(recipe, {"w": weight.clone()})) is None
    weight.add_(1)  # a new version: the value no longer follows from it
    assert shared_weights.find(shared_weights.key(recipe, {"w": weight})) is None
    with torch.inference_mode():
        assert shared_weights.key(recipe, {"w": torch.randn(8)}) is None


def test_a_weight_level_2_would_transpose_in_place_is_copied_where_another_graph_reads_it():
    """store_transposed_weights transposes a folded weight in its own memory when nothing
    else reads it: a level 1 graph of the same model holding that very tensor would then
    read the transpose (Gemma-3's int8 decode step: 22 nats from eager's)."""
    torch.manual_seed(0)
    model, x = TwoWays().eval(), torch.randn(4, 64)

    def config(level):
        return graphopt.GraphOptimizationConfig(graph_opt_level=level, freeze_parameters=True, use_cudagraph=False,
                                                cache_dir=None)
    first, second = graphopt.optimize(model, config(1)), graphopt.optimize(model, config(2))
    with torch.no_grad():
        expected = model(x, False)
        torch.testing.assert_close(first(x, False), expected)
        [one] = first.graphs()
        torch.testing.assert_close(second(x, False), expected, atol=1e-4, rtol=1e-4)
        [two] = second.graphs()
        assert {id(t) for t in held(one).values()} & {id(t) for t in shared_values()}
        torch.testing.assert_close(first(x, False), expected)  # level 1's weights as they were


def shared_values() -> list[torch.Tensor]:
    return [v for entry in shared_weights._VALUES.values() if (v := entry.value()) is not None]


def test_held_bytes_counts_each_storage_once_and_opaque_packed_weights_by_their_elements():
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    weight = torch.randn(64, 64)
    gm.register_buffer("a", weight)
    gm.register_buffer("a_view", weight[:8])  # the same storage
    gm.register_buffer("packed", torch.randn(32, 64).to_mkldnn())  # oneDNN's layout: no storage
    taken = torch.randn(16)
    gm.register_buffer("taken", taken)
    with FakeTensorMode():
        gm.register_buffer("fake", torch.empty(1024))  # no memory: not counted
    assert shared_weights.held_bytes(gm, [weakref.ref(taken)]) == {"new": (64 * 64 + 32 * 64) * 4, "shared": 16 * 4}
