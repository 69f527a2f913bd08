"""convert_layout: channels-last regions, their borders, cancelling pairs, the gate."""

import pytest
import torch
import torch.nn.functional as F
from support import aot_graph, targets, unexpected_fallbacks
from torch import nn

import graphopt
from graphopt.config import tolerance
from graphopt.models import ResNet, ResNetConfig
from graphopt.passes import layout
from graphopt.passes.constant_fold import refresh_folded_constants
from graphopt.passes.layout import channels_last_faster, convert_layout

aten = torch.ops.aten
NHWC = torch.channels_last
ATOL, RTOL = tolerance(torch.float32)
CONVS = 9  # in ResNetConfig.tiny(): stem, 2 per block, 2 shortcut convs

needs_onednn = pytest.mark.skipif(not channels_last_faster(torch.device("cpu"), torch.float32),
                                  reason="the CPU build has no oneDNN: the pass does nothing here")


def conversions(gm, fmt=None):
    """Layout conversion nodes of `gm` (to `fmt` when given)."""
    return [n for n in gm.graph.nodes if layout.is_layout_conversion(n)
            and (fmt is None or n.kwargs["memory_format"] is fmt)]


def channels_last_strides(val):
    """NHWC strides, read off the sizes: torch 2.11's `is_contiguous(memory_format=...)`
    answers False for a symbolic batch even where the strides are channels-last."""
    n, c, h, w = val.shape
    return tuple(val.stride()) == (c * h * w, 1, w * c, c)


def layout_counts(opt):
    return [p.counts for p in opt.report().passes if p.name == "convert_layout"]


def resnet():
    torch.manual_seed(0)
    return ResNet(ResNetConfig.tiny())


def optimized(model, **config):
    return graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=1, **config))


def close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


def run_pass(graph, *args):
    """Run convert_layout on an aot_graph; check it computes what it did, with the same output strides."""
    expected = graph(*args)
    result = convert_layout(graph.gm)
    graph.gm.graph.lint()
    graph.gm.recompile()
    actual = graph(*args)
    for a, e in zip(actual, expected):
        close(a, e)
        assert a.stride() == e.stride()
    return result


@pytest.mark.fresh_cache
@needs_onednn
@pytest.mark.parametrize("use_cudagraph", [False, True], ids=["fx", "host-graph"])
@pytest.mark.parametrize("freeze", [False, True], ids=["live-weights", "frozen"])
def test_resnet_at_level_1_matches_eager_with_one_conversion_instead_of_one_pair_per_conv(use_cudagraph, freeze):
    model = resnet()
    # fuse_conv would take every frozen convolution first (tests/passes/fusion/test_conv.py).
    opt = optimized(model, use_cudagraph=use_cudagraph, freeze_parameters=freeze, cudagraph_capture_sizes=[2, 4],
                    disabled_passes=["fuse_conv"])
    with torch.no_grad():
        for batch in (2, 3, 4) * (4 if use_cudagraph else 1):  # host graphs: warm-ups, captures, replays
            x = model.example_input(batch)
            out = opt(x)
            close(out, model(x))
            assert out.stride() == model(x).stride()
            del out  # a replay overwrites the previous outputs
    report = opt.report()
    assert unexpected_fallbacks(report) == {}
    assert (report.replays > 0 and len(report.captures) == 2) if use_cudagraph else report.replays == 0
    naive = 2 * CONVS  # to-NHWC before and to-NCHW after every convolution
    for counts in layout_counts(opt):
        # the image is converted once; the mean over H and W reads channels-last as it is
        assert counts == {"inserted": 1, "weights": CONVS}
        assert counts["inserted"] < naive
    for gm in opt.graphs():
        assert targets(gm).count(aten.convolution.default) == CONVS
        assert len(conversions(gm, torch.contiguous_format)) == 0
        # live weights: one op per weight in the graph; frozen: converted once into buffers
        assert len(conversions(gm, NHWC)) == (1 if freeze else 1 + CONVS)
        assert all(channels_last_strides(n.meta["val"]) for n in gm.graph.nodes if n.target is aten.convolution.default)


@needs_onednn
def test_frozen_weights_are_channels_last_buffers_and_refresh_after_load_state_dict():
    model = resnet()
    opt = optimized(model, use_cudagraph=False, freeze_parameters=True)
    x = model.example_input(2)
    with torch.no_grad():
        opt(x)
        (gm,) = opt.graphs()
        weights = [n.args[1] for n in gm.graph.nodes if n.target is aten.convolution.default]
        assert all(w.op == "get_attr" and getattr(gm, w.target).is_contiguous(memory_format=NHWC)
                   for w in weights)
        model.load_state_dict(resnet().state_dict() | {"stem.conv.weight": torch.randn(16, 3, 3, 3)})
        refresh_folded_constants(gm)
        close(opt(x), model(x))


def test_disabled_layout_pass_leaves_the_graph_nchw():
    model = resnet()
    opt = optimized(model, use_cudagraph=False, disabled_passes=["convert_layout"])
    x = model.example_input(2)
    with torch.no_grad():
        close(opt(x), model(x))
    (gm,) = opt.graphs()
    assert conversions(gm) == [] and layout_counts(opt) == []


class ConvChain(nn.Module):
    """`depth` conv-bn-relu layers, then a flatten: a view that needs contiguous strides."""

    def __init__(self, depth: int, returns_map: bool = False):
        super().__init__()
        torch.manual_seed(depth)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                                      for _ in range(depth)]).eval()
        self.returns_map = returns_map

    def forward(self, x):
        y = self.layers(x)
        return (y.flatten(1) * 2, y) if self.returns_map else y.flatten(1) * 2


def chain_graph(depth, **kwargs):
    model = ConvChain(depth, **kwargs)
    params = {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}

    def fn(x, *values):
        return torch.func.functional_call(model, dict(zip(params, values)), (x,))

    args = (torch.randn(2, 8, 6, 6), *params.values())
    return aot_graph(fn, *args), args


@needs_onednn
def test_a_region_is_converted_back_where_a_view_needs_contiguous_strides():
    graph, args = chain_graph(4)
    assert run_pass(graph, *args).counts == {"inserted": 2, "weights": 4}
    gm = graph.gm
    (back,) = conversions(gm, torch.contiguous_format)
    assert [u.target for u in back.users] == [aten.view.default]
    assert len(conversions(gm, NHWC)) == 1 + 4


@needs_onednn
def test_a_returned_feature_map_is_converted_back_once():
    graph, args = chain_graph(4, returns_map=True)
    assert run_pass(graph, *args).counts == {"inserted": 2, "weights": 4}
    (back,) = conversions(graph.gm, torch.contiguous_format)
    assert graph.gm.graph.output_node() in back.users  # the flatten and the output share it


@needs_onednn
@pytest.mark.parametrize("depth", [1, 3])
def test_few_convolutions_per_conversion_stay_nchw(depth):
    # measured: one conv-bn-relu between two conversions is 1.33x slower than NCHW, three 1.06x
    graph, args = chain_graph(depth)
    assert depth < layout.CONVS_PER_CONVERSION * 2
    before = graph.gm.code
    assert not run_pass(graph, *args).changed
    assert graph.gm.code == before


class WideConvs(nn.Module):
    """Four 64-channel 3x3 convolutions: 147K weights, against 4 x 64 x H x W activations."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.convs = nn.ModuleList(nn.Conv2d(64, 64, 3, padding=1) for _ in range(4))
        self.eval()

    def forward(self, x):
        for conv in self.convs:
            x = F.relu(conv(x))
        return x.mean(dim=(2, 3))


@needs_onednn
@pytest.mark.parametrize("freeze", [False, True], ids=["live", "frozen"])
@pytest.mark.parametrize("size", [4, 32])
def test_live_weights_that_outnumber_the_activations_stay_nchw(freeze, size):
    """Live weights are converted in every step: measured on ResNet-18, that copy
    costs more than channels-last gains until the activations outnumber the weights.
    Frozen weights are converted once, so they never hold the pass back (without
    fuse_conv, which would make these convolutions oneDNN's channels-last calls first)."""
    model, x = WideConvs(), torch.randn(2, 64, size, size)
    weights, activations = 4 * 64 * 64 * 9, 4 * x.numel()
    opt = optimized(model, use_cudagraph=False, freeze_parameters=freeze, disabled_passes=["fuse_conv"])
    with torch.no_grad():
        close(opt(x), model(x))
    converts = freeze or weights <= layout.LIVE_WEIGHTS_PER_ACTIVATION * activations
    assert converts == (size == 32 or freeze)
    assert layout_counts(opt) == ([{"inserted": 1, "weights": 4}] if converts else [{}])


class MixedCNN(nn.Module):
    """Convolutions among pooling, a grouped conv, a concat, a strided slice, reductions
    over C and over H and W, a cast of max-pool indices and a flatten."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.c3, self.c4 = nn.Conv2d(16, 8, 1), nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.scale, self.bn = nn.Parameter(torch.randn(8, 1, 1)), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4 + 8, 5)
        self.eval()

    def forward(self, x):
        a = F.silu(self.c1(x))
        p, idx = F.max_pool2d(a, 2, return_indices=True)
        c = self.c3(torch.cat([p, self.c2(p) * self.scale], 1))
        e = self.bn(self.c4(c)) + p
        f = F.adaptive_avg_pool2d(F.avg_pool2d(e, 2) + F.hardtanh(e[:, :, ::2, ::2]), (4, 4))
        logits = self.fc(torch.cat([f.flatten(1), e.amax(dim=(2, 3))], 1)) + e.mean(dim=1).sum(dim=(1, 2))[:, None]
        return logits, idx.float().sum(dim=(1, 2, 3))


@needs_onednn
@pytest.mark.parametrize("use_cudagraph", [False, True], ids=["fx", "host-graph"])
def test_regions_of_a_mixed_cnn_keep_every_result_and_stride(monkeypatch, use_cudagraph):
    model = MixedCNN()
    default = optimized(model, use_cudagraph=False)
    with torch.no_grad():
        default(torch.randn(2, 3, 32, 32))
    # 4 convs need 3 conversions (the image in; back before the strided slice and the flatten)
    assert layout_counts(default) == [{}]
    monkeypatch.setattr(layout, "CONVS_PER_CONVERSION", 1)
    opt = optimized(model, use_cudagraph=use_cudagraph, verify=True, cudagraph_capture_sizes=[2, 4])
    with torch.no_grad():
        for batch in (2, 3, 4) * 3:
            x = torch.randn(batch, 3, 32, 32)
            out = opt(x)
            for actual, expected in zip(out, model(x)):
                close(actual, expected)
                assert actual.stride() == expected.stride()
            del out, actual  # a replay overwrites the previous outputs
    assert (opt.report().replays > 0) == use_cudagraph
    assert all(counts == {"inserted": 3, "weights": 4} for counts in layout_counts(opt))
    for gm in opt.graphs():
        readers = sorted(u.target.__name__ for n in conversions(gm, torch.contiguous_format) for u in n.users)
        assert readers == ["slice.Tensor", "view.default"]


def test_a_graph_without_convolutions_is_untouched():
    graph = aot_graph(lambda x, w: torch.relu(x @ w).mean(dim=-1), torch.randn(4, 8), torch.randn(8, 3))
    before = graph.gm.code
    assert run_pass(graph, torch.randn(4, 8), torch.randn(8, 3)).counts == {}
    assert graph.gm.code == before


@pytest.mark.parametrize("spelling", ["contiguous", "to"])
def test_conversions_that_cancel_are_removed(spelling):
    def fn(x):
        if spelling == "contiguous":
            y = x.contiguous(memory_format=NHWC).contiguous()
        else:
            y = x.to(memory_format=NHWC).to(memory_format=torch.contiguous_format)
        return y * 2

    x = torch.randn(2, 3, 4, 5)
    graph = aot_graph(fn, x)
    assert len(conversions(graph.gm)) == 2
    assert run_pass(graph, x).counts == {"removed": 2}
    assert targets(graph) == [aten.mul.Tensor]


def test_conversions_that_do_not_cancel_stay():
    x = torch.randn(2, 3, 5, 4).transpose(2, 3)  # neither NCHW nor NHWC: the pair does not give it back
    graph = aot_graph(lambda x: x.contiguous(memory_format=NHWC).contiguous() * 2, x)
    assert len(conversions(graph.gm)) == 2
    assert not run_pass(graph, x).changed
    assert len(conversions(graph.gm)) == 2

    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=NHWC)
    returned = aot_graph(lambda x: x.contiguous().contiguous(memory_format=NHWC), x)
    # the pair gives x back, but it is returned: an output must not alias an input
    assert not run_pass(returned, x).changed
    assert len(conversions(returned.gm)) == 2


def test_the_gate_is_by_device_and_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert channels_last_faster(cpu, torch.float32) == torch.backends.mkldnn.is_available()
    assert not channels_last_faster(cpu, torch.float16)
    assert not channels_last_faster(cpu, torch.float64)
    assert not channels_last_faster(cuda, torch.float32)
    assert not channels_last_faster(torch.device("meta"), torch.float32)
