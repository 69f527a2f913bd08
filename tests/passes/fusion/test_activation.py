"""fuse_activations: silu(gate) * up -> graphopt::silu_and_mul, GELU written out ->
gelu, PReLU written out -> _prelu_kernel; in hand-written forms, transformers'
modules, float32 and bfloat16."""

import math

import pytest
import torch
import torch.nn.functional as F
from support import aot_graph, decode_inputs, targets
from torch.func import functional_call

import graphopt
from graphopt.config import tolerance
from graphopt.passes.fusion.activation import fuse_activations

aten = torch.ops.aten
transformers = pytest.importorskip("transformers")
from transformers import activations  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
SILU_AND_MUL = torch.ops.graphopt.silu_and_mul.default


def check(fn, args, counts, fused_op, removed, gone):
    """Fuse `fn`'s ATen graph: exactly `counts` matches, `removed` nodes fewer, the
    fused op present, `gone` absent, and the same values as eager `fn`."""
    with torch.no_grad():
        expected = fn(*args)
    graph = aot_graph(fn, *args)
    before = len(targets(graph))

    result = fuse_activations(graph.gm)
    graph.gm.graph.lint()
    graph.gm.recompile()

    after = targets(graph)
    assert result.counts == counts
    assert after.count(fused_op) == sum(counts.values())
    for op in gone:
        assert op not in after, op
    assert len(after) == before - removed
    atol, rtol = tolerance(expected.dtype)
    torch.testing.assert_close(graph(*args)[0], expected, atol=atol, rtol=rtol)
    return graph


def unchanged(fn, *args):
    graph = aot_graph(fn, *args)
    before = targets(graph)
    result = fuse_activations(graph.gm)
    assert not result.changed and result.counts == {}
    assert targets(graph) == before


def module_fn(module):
    """`module` as a function of its input and parameters (the test graphs take
    every tensor as an argument)."""
    names = [name for name, _ in module.named_parameters()]
    return lambda x, *weights: functional_call(module, dict(zip(names, weights)), (x,))


def weights(module, dtype):
    return [p.detach().to(dtype) for p in module.parameters()]


# --- silu(gate) * up ---

def silu_mul(gate, up):
    return F.silu(gate) * up


def mul_silu(gate, up):
    return up * F.silu(gate)


def sigmoid_gate(gate, up):
    return gate * torch.sigmoid(gate) * up


def exp_silu(gate, up):
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn,removed", [(silu_mul, 1), (mul_silu, 1), (sigmoid_gate, 2), (exp_silu, 4)])
def test_silu_times_up(fn, removed, dtype):
    gate, up = torch.randn(2, 5, 16, dtype=dtype), torch.randn(2, 5, 16, dtype=dtype)
    check(fn, (gate, up), {"silu_and_mul": 1}, SILU_AND_MUL, removed,
          [aten.silu.default, aten.sigmoid.default, aten.mul.Tensor])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_of_a_sliced_input(dtype):
    """`F.silu(x[..., :d]) * x[..., d:]`: the op reads the two halves as views."""
    x = torch.randn(3, 32, dtype=dtype)
    graph = check(lambda x: F.silu(x[..., :16]) * x[..., 16:], (x,), {"silu_and_mul": 1}, SILU_AND_MUL, 1,
                  [aten.silu.default, aten.mul.Tensor])
    assert targets(graph).count(aten.slice.Tensor) == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_of_a_chunked_input(dtype):
    def chunked(x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    check(chunked, (torch.randn(3, 32, dtype=dtype),), {"silu_and_mul": 1}, SILU_AND_MUL, 1, [aten.silu.default])


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_mlp(dtype):
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                      num_key_value_heads=2)
    mlp = LlamaMLP(config).eval()
    check(module_fn(mlp), (torch.randn(2, 3, 16, dtype=dtype), *weights(mlp, dtype)), {"silu_and_mul": 1},
          SILU_AND_MUL, 1, [aten.silu.default, aten.mul.Tensor])


def test_silu_and_mul_keeps_what_it_cannot_fuse():
    def silu_read_twice(gate, up):
        silu = F.silu(gate)
        return silu * up, silu + 1

    gate = torch.randn(4, 8)
    unchanged(silu_mul, gate, torch.randn(1, 8))  # up broadcasts: the op takes one shape
    unchanged(silu_mul, gate, torch.randn(4, 8, dtype=torch.float64))  # the product promotes
    unchanged(silu_read_twice, gate, torch.randn(4, 8))


def test_silu_and_mul_op_matches_its_definition():
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(torch.ops.graphopt.silu_and_mul(gate, up), F.silu(gate) * up)
    torch.library.opcheck(torch.ops.graphopt.silu_and_mul.default, (gate, up))


# --- GELU ---

def gelu_erf(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_erf_reciprocal(x):
    return x * 0.5 * (1.0 + torch.erf(x * (1 / math.sqrt(2))))


def gelu_erf_m_sqrt1_2(x):  # Inductor's own decomposition of gelu writes M_SQRT1_2
    return x * 0.5 * (1.0 + torch.erf(x * 0.7071067811865476))


def gelu_tanh_short_constants(x):
    return 0.5 * x * (1 + torch.tanh(0.79788456 * (x + 0.044715 * torch.pow(x, 3))))


def gelu_tanh_pow(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gelu_tanh_cube(x):
    return x * 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + x * x * x * 0.044715)))


ERF_OPS = [aten.erf.default, aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor]
TANH_OPS = [aten.tanh.default, aten.pow.Tensor_Scalar, aten.mul.Tensor, aten.add.Tensor]
GELU_FORMS = [
    (gelu_erf, "gelu_erf", 4, ERF_OPS),
    (gelu_erf_reciprocal, "gelu_erf", 4, ERF_OPS),
    (gelu_erf_m_sqrt1_2, "gelu_erf", 4, ERF_OPS),
    (activations.GELUActivation(use_gelu_python=True), "gelu_erf", 4, ERF_OPS),
    (gelu_tanh_pow, "gelu_tanh", 7, TANH_OPS),
    (gelu_tanh_cube, "gelu_tanh", 8, TANH_OPS),
    (gelu_tanh_short_constants, "gelu_tanh", 7, TANH_OPS),
    (activations.NewGELUActivation(), "gelu_tanh", 7, TANH_OPS),  # GPT-2's gelu_new
    (activations.GELUTanh(use_gelu_tanh_python=True), "gelu_tanh", 7, TANH_OPS),
    (activations.AccurateGELUActivation(), "gelu_tanh", 7, TANH_OPS),
    (activations.FastGELUActivation(), "gelu_tanh", 8, TANH_OPS),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn,name,removed,gone", GELU_FORMS,
                         ids=lambda f: getattr(f, "__name__", type(f).__name__) if callable(f) else None)
def test_gelu_written_out(fn, name, removed, gone, dtype):
    x = torch.linspace(-6, 6, 97, dtype=dtype).reshape(1, 97)
    graph = check(fn, (x,), {name: 1}, aten.gelu.default, removed, gone)
    gelu = next(n for n in graph.gm.graph.nodes if n.target is aten.gelu.default)
    assert gelu.kwargs.get("approximate", "none") == ("tanh" if name == "gelu_tanh" else "none")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt2_mlp(dtype):
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    torch.manual_seed(0)
    mlp = GPT2MLP(32, transformers.GPT2Config(n_embd=16, n_head=2)).eval()
    check(module_fn(mlp), (torch.randn(2, 3, 16, dtype=dtype), *weights(mlp, dtype)), {"gelu_tanh": 1},
          aten.gelu.default, 7, [aten.tanh.default, aten.pow.Tensor_Scalar])


def test_library_gelu_arrives_fused():
    """BERT's GELUActivation and GELUTanh call F.gelu: already one op, nothing to do."""
    x = torch.randn(4, 8)
    for module in (activations.GELUActivation(), activations.GELUTanh(), torch.nn.GELU()):
        graph = aot_graph(module, x)
        assert targets(graph) == [aten.gelu.default]
        unchanged(module, x)


def test_gelu_with_other_constants_is_not_gelu():
    x = torch.randn(4, 8)
    unchanged(lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.05 * x**3))), x)
    unchanged(lambda x: 0.5 * x * (1 + torch.erf(x / 1.5)), x)
    unchanged(lambda x: 0.5 * x * (1 + torch.tanh(0.7979 * (x + 0.044715 * x**3))), x)  # 2e-5 off
    unchanged(lambda x, s: 0.5 * x * (1 + torch.erf(x / s)), x, torch.tensor(math.sqrt(2)))  # not a number
    unchanged(activations.QuickGELUActivation(), x)  # x * sigmoid(1.702 x): another function


# --- PReLU ---

def prelu_where(x, a):
    return torch.where(x > 0, x, a * x)


def prelu_where_slope_right(x, a):
    return torch.where(x > 0, x, x * a)


def prelu_relu(x, a):
    return F.relu(x) - a * F.relu(-x)


PRELU_FORMS = [(prelu_where, 2), (prelu_where_slope_right, 2), (prelu_relu, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn,removed", PRELU_FORMS)
@pytest.mark.parametrize("slope_shape", [(), (1,), (1, 3, 1, 1)], ids=["0d", "one_slope", "per_channel"])
def test_prelu_written_out(fn, removed, slope_shape, dtype):
    x, a = torch.randn(2, 3, 4, 4, dtype=dtype), torch.rand(slope_shape, dtype=dtype)
    check(fn, (x, a), {"prelu": 1}, aten._prelu_kernel.default, removed,
          [aten.where.self, aten.relu.default, aten.gt.Scalar, aten.mul.Tensor])


def test_prelu_with_a_viewed_channel_slope():
    x, a = torch.randn(2, 3, 4, 4), torch.rand(3)
    graph = check(lambda x, a: prelu_where(x, a.view(1, -1, 1, 1)), (x, a), {"prelu": 1},
                  aten._prelu_kernel.default, 2, [aten.where.self])
    assert aten.view.default in targets(graph)  # the slope's view stays, as nn.PReLU has it


def test_nn_prelu_arrives_fused():
    module = torch.nn.PReLU(3)
    x = torch.randn(2, 3, 4)
    with torch.no_grad():
        graph = aot_graph(module_fn(module), x, *weights(module, torch.float32))
    assert aten._prelu_kernel.default in targets(graph)


def test_prelu_keeps_what_it_cannot_fuse():
    x = torch.randn(2, 3, 4)
    unchanged(prelu_where, x, torch.rand(5, 1, 1, 1))  # the slope broadcasts x to 4-D
    unchanged(prelu_where, x, torch.rand(1, 3, 1, dtype=torch.float64))  # the slope promotes
    unchanged(lambda x: torch.where(x > 0, x, 0.1 * x), x)  # a Python slope: leaky_relu, not prelu
    unchanged(lambda x, a: torch.where(x > 0.5, x, a * x), x, torch.rand(1))  # another threshold


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fusions_on_cuda(dtype):
    gate, up = (torch.randn(4, 64, device="cuda", dtype=dtype) for _ in range(2))
    check(silu_mul, (gate, up), {"silu_and_mul": 1}, SILU_AND_MUL, 1, [aten.silu.default])
    x = torch.randn(2, 3, 8, device="cuda", dtype=dtype)
    check(gelu_tanh_pow, (x,), {"gelu_tanh": 1}, aten.gelu.default, 7, TANH_OPS)
    check(gelu_erf, (x,), {"gelu_erf": 1}, aten.gelu.default, 4, ERF_OPS)
    check(prelu_relu, (x, torch.rand(1, 3, 1, device="cuda", dtype=dtype)), {"prelu": 1},
          aten._prelu_kernel.default, 4, [aten.relu.default])


# --- levels and the pipeline ---

def test_not_applied_at_level_2():
    """Inductor decomposes gelu, _prelu_kernel and silu before graphopt's passes run
    and turns each chain into one kernel: the patterns are level 1 only."""
    x = torch.randn(4, 8)
    graph = aot_graph(gelu_tanh_pow, x)
    graph.gm.meta["graphopt_level"] = 2
    assert fuse_activations(graph.gm).counts == {}


def test_decoder_reports_silu_and_mul(decoder):
    opt = graphopt.optimize(decoder, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    args = decode_inputs(2)
    with torch.no_grad():
        expected, got = decoder(*args), opt(*args)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    report = opt.report()
    layers = decoder.config.num_layers
    assert next(p for p in report.passes if p.name == "fuse_activations").counts == {"silu_and_mul": layers}
    assert report.graphs[0].fused_ops["silu_and_mul"] == layers
