"""fuse_conv: batch norm folded into the convolution, and convolution + bias + residual
add + ReLU as one oneDNN call on a weight packed once (freeze_parameters=True, CPU)."""

import pytest
import torch
import torch.nn.functional as F
from support import aot_graph, assert_close_tree, targets
from torch import nn

import graphopt
from graphopt import FallbackKind
from graphopt._compat import mkldnn
from graphopt.models import ResNet, ResNetConfig
from graphopt.passes.constant_fold import FROZEN_INPUTS, may_be_read
from graphopt.passes.fusion.conv import fuse_conv

pytestmark = pytest.mark.skipif(not mkldnn.available(), reason="torch built without oneDNN")
aten = torch.ops.aten


def optimized(model, level=1, **config):
    config = graphopt.GraphOptimizationConfig(graph_opt_level=level, **{"freeze_parameters": True, **config})
    return graphopt.optimize(model, config)


def conv_counts(step):
    return {k: v for p in step.report().passes if p.name == "fuse_conv" for k, v in p.counts.items()}


def resnet():
    torch.manual_seed(0)
    return ResNet(ResNetConfig.tiny())


@pytest.mark.parametrize("level,host_graphs", [(1, False), (1, True), (2, False)])
def test_resnet_equals_eager_with_every_convolution_fused(level, host_graphs):
    model = resnet()
    images = torch.randn(2, 3, 32, 32)
    step = optimized(model, level, use_cudagraph=host_graphs, cudagraph_capture_sizes=[2])
    with torch.inference_mode():
        expected = model(images)
        for _ in range(4):  # host graphs: warm-ups, a capture, replays
            assert_close_tree(step(images), expected, f"level {level}")
    assert (step.report().replays > 0) == host_graphs
    [gm] = step.graphs()
    unread = [name for name, value in gm.named_buffers() if not may_be_read(value)
              and not any(n.users for n in gm.graph.find_nodes(op="get_attr", target=name))]
    assert not unread, unread  # a weight folded with its batch norm is not kept dense beside its packed copy
    counts = conv_counts(step)
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    if level == 1:  # batch norm is still an op to fold; at level 2 Inductor has decomposed it
        assert counts["batch_norm_folded"] == convs
        # 3 blocks: conv1 + ReLU; conv2 + add + ReLU; the stem's conv + ReLU; 2 shortcuts alone.
        assert counts == {"batch_norm_folded": convs, "conv_relu": 4, "conv_add_relu": 3, "conv": 2}
        assert not any(t in (aten.convolution.default, aten._native_batch_norm_legit_no_training.default)
                       for t in targets(step.graphs()[0]))
    else:
        assert sum(counts.values()) == convs


@pytest.mark.parametrize("level,inductor", [(1, {}), (2, {}), (2, {"freezing": True})])
def test_refresh_recomputes_folded_and_packed_weights(level, inductor):
    """Level 2 takes the packed weights as Inductor constants (by reference); with
    Inductor's freezing, its compiled code holds its own copies, compiled again."""
    model = resnet()
    images = torch.randn(1, 3, 32, 32)
    step = optimized(model, level, inductor_compile_config=inductor)
    with torch.inference_mode():
        step(images)
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.BatchNorm2d)):
                m.weight.data.mul_(1.5)  # through .data: not noticed, so stale until refresh()
        stale = step(images)
        # Level 2: Inductor takes the packed weights as constants; refresh() must reach them.
        assert sum(conv_counts(step).values()) > 0
        assert step.refresh() > 0
        fresh = model(images)
        assert not torch.allclose(stale, fresh), "the update must change the output for this test to tell"
        assert_close_tree(step(images), fresh, f"level {level} after refresh()")


@pytest.mark.parametrize("lowering", [
    {"weight_quantization": "int8"},
    pytest.param({"compute_dtype": "bfloat16"}, marks=pytest.mark.skipif(
        not mkldnn.cpu_has_native_bf16(), reason="compute_dtype is refused without native bfloat16"))],
    ids=["int8", "bfloat16"])
def test_a_linear_head_lowered_after_the_convolutions_are_packed(lowering):
    """The head's weight is folded (quantized, or cast) after the convolutions' weights were
    packed from their batch-norm-folded values. That fold frees the folded values the graph
    no longer reads and reuses their names, so a packed weight's recipe must not read its
    source by name: the stored entry failed to load, and refresh() packed a stale value."""
    model = resnet()
    images = torch.randn(2, 3, 32, 32)
    step = optimized(model, use_cudagraph=False, **lowering)
    with torch.inference_mode():
        torch.testing.assert_close(step(images), model(images), atol=0.05, rtol=0.05)
        convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
        assert conv_counts(step)["batch_norm_folded"] == convs
        if "compute_dtype" in lowering:  # each packed again from its weight in bfloat16
            lowered = next(p.counts for p in step.report().passes if p.name == "lower_precision")
            assert lowered["packed_convolution"] == convs, lowered
            (gm,) = step.graphs()
            packed = [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("_packed_")]
            # and the head's linear: fuse_packed_linear packs a bfloat16 weight at any size
            assert len(packed) == convs + 1 and {getattr(gm, t).dtype for t in packed} == {torch.bfloat16}
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.BatchNorm2d)):
                m.weight.data.mul_(1.5)
        stale = step(images)
        assert step.refresh() > 0
        fresh = model(images)
        assert not torch.allclose(stale, fresh, atol=0.05, rtol=0.05), "the update must change the output"
        torch.testing.assert_close(step(images), fresh, atol=0.05, rtol=0.05)


@pytest.mark.skipif(not mkldnn.cpu_has_native_bf16(), reason="compute_dtype is refused without native bfloat16")
def test_bfloat16_convolutions_past_the_tolerance_are_put_back_in_float32():
    model = resnet()
    images = torch.randn(2, 3, 32, 32)
    step = optimized(model, use_cudagraph=False, compute_dtype="bfloat16", precision_tolerance=1e-9)
    with torch.inference_mode():
        assert_close_tree(step(images), model(images), "undone")
    assert FallbackKind.PRECISION in step.report().fallback_counts
    (gm,) = step.graphs()
    packed = [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("_packed_")]
    assert packed and {getattr(gm, t).dtype for t in packed} == {torch.float32}


def test_not_frozen_leaves_convolutions():
    model = resnet()
    step = optimized(model, freeze_parameters=False)
    images = torch.randn(1, 3, 32, 32)
    with torch.inference_mode():
        assert_close_tree(step(images), model(images), "not frozen")
    assert conv_counts(step) == {}


def run_pass(fn, args, frozen):
    graph = aot_graph(fn, *args)
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    graph.gm.meta[FROZEN_INPUTS] = {p.name: args[i] for p, i in zip(placeholders, graph.order) if i in frozen}
    expected = graph(*args)
    result = fuse_conv(graph.gm)
    graph.gm.graph.lint()
    graph.gm.recompile()
    assert_close_tree(graph(*args), expected, fn.__name__)
    return graph, result


def bn_args(c):
    return [torch.rand(c) + 0.5, torch.randn(c), torch.randn(c) * 0.1, torch.rand(c) + 0.5]


def conv_bn_add_relu(x, w, g, b, m, v, other):
    y = F.batch_norm(F.conv2d(x, w, padding=1), m, v, g, b, training=False)
    return F.relu(y + other).mean()


def test_conv_bn_add_relu_is_one_call():
    x, w, other = torch.randn(2, 4, 8, 8), torch.randn(6, 4, 3, 3), torch.randn(2, 6, 8, 8)
    g, b, m, v = bn_args(6)
    graph, result = run_pass(conv_bn_add_relu, (x, w, g, b, m, v, other), frozen={1, 2, 3, 4, 5})
    assert result.counts == {"batch_norm_folded": 1, "conv_add_relu": 1}
    assert targets(graph) == [mkldnn.conv_add(), aten.mean.default]


def test_live_weights_are_left_alone():
    x, w, other = torch.randn(2, 4, 8, 8), torch.randn(6, 4, 3, 3), torch.randn(2, 6, 8, 8)
    graph, result = run_pass(conv_bn_add_relu, (x, w, *bn_args(6), other), frozen={2, 3, 4, 5})
    assert not result.changed and aten.convolution.default in targets(graph)


def conv_returned(x, w):
    return F.conv2d(x, w, padding=1)  # eager returns NCHW; the fused op would return channels-last


def test_a_returned_convolution_is_left_alone():
    graph, result = run_pass(conv_returned, (torch.randn(1, 4, 8, 8), torch.randn(6, 4, 3, 3)), frozen={1})
    assert not result.changed and targets(graph) == [aten.convolution.default]


def conv_broadcast_add(x, w, bias_map):
    return F.relu(F.conv2d(x, w, padding=1) + bias_map).sum()


def test_a_broadcasting_add_stays_outside():
    args = (torch.randn(1, 4, 8, 8), torch.randn(6, 4, 3, 3), torch.randn(6, 1, 1))
    graph, result = run_pass(conv_broadcast_add, args, frozen={1})
    assert result.counts == {"conv": 1} and aten.add.Tensor in targets(graph)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_other_dtypes_are_left_alone(dtype):
    x, w = torch.randn(1, 4, 8, 8, dtype=dtype), torch.randn(6, 4, 3, 3, dtype=dtype)
    graph, result = run_pass(conv_broadcast_add, (x, w, torch.randn(6, 1, 1, dtype=dtype)), frozen={1})
    assert not result.changed


def transposed(x, w):
    return F.relu(F.conv_transpose2d(x, w)).sum()


def test_transposed_convolution_is_left_alone():
    graph, result = run_pass(transposed, (torch.randn(1, 4, 8, 8), torch.randn(4, 6, 3, 3)), frozen={1})
    assert not result.changed
