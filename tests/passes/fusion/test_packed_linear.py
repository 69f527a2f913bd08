"""fuse_packed_linear: linears on frozen weights packed once for oneDNN, with the GELU
or ReLU that follows as a post-op (level 1, CPU, float32 or native bfloat16); small float32 GEMMs gated."""

import copy

import pytest
import torch
import torch.nn.functional as F
from support import aot_graph, assert_close_tree, targets
from torch import nn

import graphopt
from graphopt._compat import mkldnn
from graphopt.passes.constant_fold import FROZEN_INPUTS
from graphopt.passes.fusion.linear import recompose_linear
from graphopt.passes.fusion.packed_linear import fuse_packed_linear

pytestmark = pytest.mark.skipif(not mkldnn.available(), reason="torch built without oneDNN")
aten = torch.ops.aten


class Mlp(nn.Module):
    def __init__(self, approximate="none"):
        super().__init__()
        self.up, self.down, self.approximate = nn.Linear(64, 256), nn.Linear(256, 64), approximate

    def forward(self, x):
        return self.down(F.gelu(self.up(x), approximate=self.approximate)) + x


def counts(step):
    return {k: v for p in step.report().passes if p.name == "fuse_packed_linear" for k, v in p.counts.items()}


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_an_mlp_equals_eager_packed_with_its_gelu(approximate):
    torch.manual_seed(0)
    model = Mlp(approximate).eval()
    step = graphopt.optimize(copy.deepcopy(model), graphopt.GraphOptimizationConfig(
        graph_opt_level=1, freeze_parameters=True))
    x = torch.randn(8, 64, 64)  # 512 rows: 2M+ multiply-adds per linear
    with torch.inference_mode():
        for _ in range(4):  # warm-ups, a host-graph capture, replays
            assert_close_tree(step(x), model(x), approximate)
    assert counts(step) == {"linear_gelu": 1, "linear": 1}


def test_refresh_repacks_the_weights():
    torch.manual_seed(0)
    model = Mlp().eval()
    step = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, freeze_parameters=True, use_cudagraph=False))
    x = torch.randn(8, 64, 64)
    with torch.inference_mode():
        step(x)
        model.up.weight.data.mul_(1.5)  # through .data: not noticed, so stale until refresh()
        stale = step(x)
        assert step.refresh() > 0
        fresh = model(x)
        assert not torch.allclose(stale, fresh)
        assert_close_tree(step(x), fresh, "after refresh()")


class GatedMlp(nn.Module):
    """gate and up read one input: horizontal fusion folds their weights into one concatenation."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(64, 256, bias=False), nn.Linear(64, 256, bias=False), \
            nn.Linear(256, 64, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def test_a_folded_weight_packed_for_onednn_is_not_kept_beside_its_packed_copy():
    """gate/up's concatenation is folded, then packed: the graph keeps the packed copy
    only (its recipe makes the concatenation again at refresh()), a quarter less memory
    than the weights on a Llama's MLP, and refresh() still follows an update."""
    torch.manual_seed(0)
    model = GatedMlp().eval()
    step = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, freeze_parameters=True, use_cudagraph=False, cache_dir=None))
    x = torch.randn(8, 64, 64)
    with torch.inference_mode():
        assert_close_tree(step(x), model(x), "first call")
        [gm] = step.graphs()
        held = dict(gm.named_buffers())
        assert sorted(held) == ["_packed_0", "_packed_1"], sorted(held)  # gate/up as one, and down
        assert not gm.graph.find_nodes(op="get_attr", target="_folded_0")
        with torch.no_grad():
            model.up.weight.mul_(1.5)  # noticed: refreshed before the call
        assert_close_tree(step(x), model(x), "after an update")
    assert counts(step) == {"linear": 2}


def run_pass(fn, args, frozen):
    """The pass on `fn`'s ATen graph (linears recomposed first, as at level 1); a
    GEMM of 8x64 rows x 128 x 96 is over the gate (6M multiply-adds)."""
    graph = aot_graph(fn, *args)
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    graph.gm.meta[FROZEN_INPUTS] = {p.name: args[i] for p, i in zip(placeholders, graph.order) if i in frozen}
    expected = graph(*args)
    recompose_linear(graph.gm)
    result = fuse_packed_linear(graph.gm)
    graph.gm.graph.lint()
    graph.gm.recompile()
    assert_close_tree(graph(*args), expected, fn.__name__)
    return graph, result


def linear_relu(x, w, b):
    return F.relu(F.linear(x, w, b)).sum()


def test_linear_relu_is_one_call():
    graph, result = run_pass(linear_relu, (torch.randn(8, 64, 128), torch.randn(96, 128), torch.randn(96)), {1, 2})
    assert result.counts == {"linear_relu": 1}
    assert targets(graph) == [mkldnn.linear_pointwise(), aten.sum.default]


def test_a_small_gemm_is_gated():
    graph, result = run_pass(linear_relu, (torch.randn(2, 8, 16), torch.randn(8, 16), torch.randn(8)), {1, 2})
    assert result.counts == {"gated": 1} and aten.linear.default in targets(graph)


def test_a_live_weight_is_left_alone():
    graph, result = run_pass(linear_relu, (torch.randn(8, 64, 128), torch.randn(96, 128), torch.randn(96)), {2})
    assert not result.changed and aten.linear.default in targets(graph)


def gelu_read_twice(x, w):
    y = F.linear(x, w)
    return F.gelu(y).sum() + y.mean()


def test_an_activation_whose_input_is_read_elsewhere_stays_outside():
    graph, result = run_pass(gelu_read_twice, (torch.randn(8, 64, 128), torch.randn(96, 128)), {1})
    assert result.counts == {"linear": 1} and aten.gelu.default in targets(graph)


def gelu_between_casts(x, w):
    return F.gelu(F.linear(x, w).float()).to(torch.bfloat16)


def gelu_between_casts_read_in_float32(x, w):
    g = F.gelu(F.linear(x, w).float())
    return g.to(torch.bfloat16), g.sum()


native_bf16 = pytest.mark.skipif(not mkldnn.cpu_has_native_bf16(),
                                 reason="bfloat16 is packed where the CPU multiplies it natively")


@native_bf16
def test_a_gelu_between_casts_is_the_bfloat16_linears_post_op():
    """lower_precision's spelling of a GELU it leaves in float32 (bfloat16 linear, cast
    up, GELU, cast down) becomes one call that rounds once."""
    args = (torch.randn(8, 64, 128, dtype=torch.bfloat16), torch.randn(96, 128, dtype=torch.bfloat16))
    graph, result = run_pass(gelu_between_casts, args, {1})
    assert result.counts == {"linear_gelu": 1}
    assert targets(graph) == [mkldnn.linear_pointwise()]


@native_bf16
def test_a_gelu_between_casts_read_in_float32_stays_outside():
    args = (torch.randn(8, 64, 128, dtype=torch.bfloat16), torch.randn(96, 128, dtype=torch.bfloat16))
    graph, result = run_pass(gelu_between_casts_read_in_float32, args, {1})
    assert result.counts == {"linear": 1} and aten.gelu.default in targets(graph)


@native_bf16
def test_a_small_bfloat16_gemm_is_packed_where_float32_is_gated():
    """oneDNN reorders a plain bfloat16 weight at every call: a decode step's one-row
    GEMMs, gated in float32, are packed in bfloat16."""
    args = (torch.randn(2, 8, 16), torch.randn(8, 16), torch.randn(8))
    graph, result = run_pass(linear_relu, tuple(a.bfloat16() for a in args), {1, 2})
    assert result.counts == {"linear_relu": 1}
    assert targets(graph) == [mkldnn.linear_pointwise(), aten.sum.default]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_other_dtypes_are_left_alone(dtype):
    """bfloat16 is packed only where the CPU multiplies it natively (the next test)."""
    if dtype == torch.bfloat16 and mkldnn.cpu_has_native_bf16():
        pytest.skip("this CPU multiplies bfloat16 natively")
    args = (torch.randn(8, 64, 128, dtype=dtype), torch.randn(96, 128, dtype=dtype), torch.randn(96, dtype=dtype))
    graph, result = run_pass(linear_relu, args, {1, 2})
    assert not result.changed


@native_bf16
def test_compute_dtype_linears_are_packed_in_bfloat16_and_refreshed():
    torch.manual_seed(0)
    model = Mlp().eval()
    step = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, freeze_parameters=True, use_cudagraph=False, compute_dtype="bfloat16"))
    x = torch.randn(8, 64, 64)
    with torch.inference_mode():
        torch.testing.assert_close(step(x), model(x), atol=0.05, rtol=0.05)
        # The GELU lower_precision left in float32 between two casts is the up linear's post-op.
        assert counts(step) == {"linear_gelu": 1, "linear": 1}
        (gm,) = step.graphs()
        assert aten.gelu.default not in targets(gm)
        packed = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("_packed_")]
        assert {getattr(gm, n.target).dtype for n in packed} == {torch.bfloat16}
        model.up.weight.data.mul_(1.5)
        stale = step(x)
        assert step.refresh() > 0
        fresh = model(x)
        assert not torch.allclose(stale, fresh, atol=0.05, rtol=0.05), "the update must change the output"
        torch.testing.assert_close(step(x), fresh, atol=0.05, rtol=0.05)


def test_not_frozen_leaves_linears():
    model = Mlp().eval()
    step = graphopt.optimize(copy.deepcopy(model), graphopt.GraphOptimizationConfig(
        graph_opt_level=1, use_cudagraph=False))
    x = torch.randn(8, 64, 64)
    with torch.inference_mode():
        assert_close_tree(step(x), model(x), "not frozen")
    assert counts(step) == {}
