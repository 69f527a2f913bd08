"""weight_quantization="int8" at level 2: quantize_weights turns the mm / addmm Inductor's
decompositions leave of a linear into aten._weight_int8pack_mm on folded int8 weights,
which Inductor lowers (its extern ATen kernel or its C++ GEMM template, autotuned)."""

import pytest
import torch
from support import decode_inputs, unexpected_fallbacks

import graphopt
from graphopt.config import tolerance

aten = torch.ops.aten
GEMMS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default)


class LinearStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(64, 128), torch.nn.Linear(128, 128, bias=False), torch.nn.Linear(128, 32)])

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x)


def quantized(model, **config):
    return graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=2, use_cudagraph=False, freeze_parameters=True, weight_quantization="int8", **config))


def kernels(gm):
    return [n for n in gm.graph.nodes if n.target is aten._weight_int8pack_mm.default]


def assert_within_int8(out, expected):
    atol, rtol = tolerance(torch.bfloat16)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def test_linear_stack_at_level_2_runs_on_the_int8_kernel_and_refreshes():
    torch.manual_seed(0)
    model, x = LinearStack().eval(), torch.randn(2, 5, 64)
    opt = quantized(model)
    with torch.no_grad():
        out, expected = opt(x), model(x)
    assert_within_int8(out, expected)
    (gm,) = opt.graphs()
    found = kernels(gm)
    assert len(found) == 3 and not any(n.target in GEMMS for n in gm.graph.nodes)
    assert all(n.args[1].op == "get_attr" and n.args[1].meta["val"].dtype == torch.int8 for n in found)
    assert {p.name: p.counts for p in opt.report().passes}["quantize_weights"] == {"quantized": 3}
    (record,) = opt.report().graphs
    # Inductor lowered each call, timing its C++ template against ATen's kernel.
    assert len(record.gemms) == 3 and all(key.startswith("_weight_int8pack_mm") for key in record.gemms)
    assert record.precision["dtype"] == "int8 weights" and 0 < record.precision["relative_error"] < 0.05
    assert unexpected_fallbacks(opt.report()) == {}
    # refresh() quantizes the updated weight again, and compiles the graph again for the
    # copies of the weights the autotuned code took.
    with torch.no_grad():
        model.layers[0].weight.mul_(2)
        opt.refresh()
        assert opt.report().repacks == 1
        assert_within_int8(opt(x), model(x))


@pytest.mark.slow  # a level 2 compile of the decoder: about a minute on a small CPU
def test_decoder_step_at_level_2_with_int8_weights(decoder):
    # ATen's kernel only: timing the C++ template for each of the decoder's GEMMs takes a minute
    # on a small CPU, and the linear stack's test covers that choice.
    opt = quantized(decoder, inductor_compile_config={"max_autotune_gemm": False})
    with torch.inference_mode():
        out, expected = opt(*decode_inputs(3)), decoder(*decode_inputs(3))
    (gm,) = opt.graphs()
    # Every projection (q, k, v and gate, up each one after fuse_horizontal_linear) and the lm_head.
    assert {p.name: p.counts for p in opt.report().passes}["quantize_weights"] == {"quantized": len(kernels(gm))}
    assert len(kernels(gm)) >= 9 and not any(n.target in GEMMS for n in gm.graph.nodes)
    torch.testing.assert_close(out, expected, atol=0.1, rtol=0.1)
    error = opt.report().graphs[0].precision
    assert error["relative_error"] < 0.05 and error["tokens_compared"] == 3
    assert error["token_agreement"] == torch.sum(out.argmax(-1) == expected.argmax(-1)).item() / 3


class Scores(torch.nn.Module):
    """A linear, then a product of two activations (no weight in it)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 32)

    def forward(self, x, y):
        return self.proj(x) @ y.t()


def test_a_product_of_activations_is_neither_quantized_nor_counted():
    torch.manual_seed(0)
    model, x, y = Scores().eval(), torch.randn(8, 64), torch.randn(6, 32)
    # ATen's GEMMs only: what the quantization leaves is in the graph before Inductor, which
    # the linear stack's test sees autotuned.
    opt = quantized(model, inductor_compile_config={"max_autotune_gemm": False})
    with torch.no_grad():
        assert_within_int8(opt(x, y), model(x, y))
    assert {p.name: p.counts for p in opt.report().passes}["quantize_weights"] == {"quantized": 1}
    (gm,) = opt.graphs()
    assert len(kernels(gm)) == 1 and sum(n.target is aten.mm.default for n in gm.graph.nodes) == 1
