"""A new tensor in a written input's place (the KV cache of a new `generate()`):
a host graph rebinds to it instead of capturing again; a CUDA graph captures again.

The step writes and reads its cache through views it makes itself (`cache[0]`,
`[:, 1]`), so the views in the tape must follow the cache to its new memory, and
the cache the step was captured on must never be written again."""

from __future__ import annotations

import pytest
import torch

import graphopt
from graphopt.report import PieceRecord, Report
from graphopt.runtime import native_tape
from graphopt.runtime.capture import CapturedGraph, running_at
from graphopt.runtime.pool import Pool


def layer_step(x, cache):
    layer = cache[0]
    layer[:, 1].add_(x)
    return layer.sum(1) * 2


def cache_of(value: float, dtype=torch.float32) -> torch.Tensor:
    return torch.full((2, 3, 4), value, dtype=dtype)


def config(level: int = 1, **kw) -> graphopt.GraphOptimizationConfig:
    return graphopt.GraphOptimizationConfig(graph_opt_level=level, cudagraph_capture_sizes=[3], **kw)


def check_step(opt, x, cache) -> None:
    """One call of `opt` against `layer_step` on a copy of `cache`."""
    expected_cache = cache.clone()
    expected = layer_step(x, expected_cache)
    torch.testing.assert_close(opt(x, cache), expected)
    torch.testing.assert_close(cache, expected_cache)


@pytest.mark.parametrize("level", [0, 1])
def test_new_cache_of_the_same_shape_is_rebound_and_the_old_one_left_alone(level):
    opt = graphopt.optimize(layer_step, config(level), dynamic_dims={"x": 0})
    x = torch.arange(3.0)
    old = cache_of(1.0)
    for _ in range(2):  # a warm-up, the capture
        check_step(opt, x, old)
    old_after = old.clone()
    new = cache_of(5.0)
    for _ in range(3):  # replays on the new cache
        check_step(opt, x + 1, new)
    report = opt.report()
    assert (len(report.captures), report.recaptures, report.rebinds) == (1, 0, 1), report
    assert report.replays == 3
    torch.testing.assert_close(old, old_after)  # nothing the graph runs writes it any more
    check_step(opt, x, old)  # and back: the old cache is the one written again
    torch.testing.assert_close(new[0, :, 1], torch.full((3,), 5.0) + 3 * (x + 1))
    assert (len(report.captures), report.rebinds) == (1, 2)


@pytest.mark.parametrize("change", ["stride", "dtype", "shape"])
def test_new_cache_of_another_layout_is_captured_anew(change):
    """Dynamo's guards see these first: the step is compiled again, and its new graph captured."""
    opt = graphopt.optimize(layer_step, config(cudagraph_num_of_warmups=1), dynamic_dims={"x": 0})
    x = torch.arange(3.0)
    for _ in range(2):
        check_step(opt, x, cache_of(1.0))
    other = {"stride": cache_of(2.0).transpose(1, 2).contiguous().transpose(1, 2),
             "dtype": cache_of(2.0, torch.float64),
             "shape": torch.full((3, 3, 4), 2.0)}[change]
    for _ in range(3):
        check_step(opt, x.to(other.dtype), other)
    assert len(opt.report().captures) == 2 and opt.report().rebinds == 0, opt.report()


def captured_step(fn, static: list[bool]) -> tuple[CapturedGraph, Report]:
    cfg = config(cudagraph_num_of_warmups=1)
    report = Report(1)
    return CapturedGraph(fn, PieceRecord(0, 0), cfg, report, Pool(cfg), static), report


def test_without_guards_a_cache_the_graph_cannot_rebind_is_captured_again_with_the_reason():
    step, report = captured_step(layer_step, [False, True])
    x = torch.arange(3.0)
    cache = cache_of(1.0)
    with running_at((3,)):
        for _ in range(3):  # the first run (a warm-up), the capture, a replay
            check_step(step, x, cache)
        check_step(step, x, cache_of(2.0, torch.float64))
    assert report.recaptures == 1 and report.rebinds == 0
    (reason,) = report.recapture_reasons
    assert reason == "graph 0: input 1 is a new tensor and its size, stride or dtype differs from the captured one's"


def test_a_new_parameter_is_captured_again():
    def scale(x, weight):
        return x * weight

    step, report = captured_step(scale, [False, True])
    x = torch.arange(3.0)
    with running_at((3,)):
        for weight in [torch.nn.Parameter(torch.ones(3))] * 3 + [torch.nn.Parameter(torch.full((3,), 2.0))]:
            with torch.no_grad():  # a step that records autograd is not captured
                torch.testing.assert_close(step(x, weight), x * weight)
    assert report.recaptures == 1 and report.rebinds == 0
    assert list(report.recapture_reasons) == ["graph 0: input 1 is a new tensor and it is a parameter"]


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_host_graph_rebinds_every_view_it_made_and_refuses_what_it_cannot_move(native, monkeypatch):
    monkeypatch.setattr(native_tape, "ENABLED", native)
    owner = cache_of(1.0)
    held = owner.view(owner.shape)  # the tensor only the graph holds (capture.py makes such an alias)
    x = torch.arange(3.0)
    graph = graphopt.DeviceGraph("cpu")
    graph.capture_begin()
    out = layer_step(x, held)
    graph.capture_end([out])
    for other in (cache_of(0.0, torch.float64), torch.zeros(2, 4, 3).transpose(1, 2), torch.zeros(3, 3, 4)):
        assert graph.rebind(held, other) == "its size, stride or dtype differs from the captured one's"
    new = torch.zeros(4, 3, 4)[1:3]  # same size and stride, another storage offset
    assert graph.rebind(held, new) is None
    graph.replay()
    torch.testing.assert_close(new[0, :, 1], x)
    torch.testing.assert_close(out, 2 * x)
    torch.testing.assert_close(owner[0, :, 1], 1 + x)  # the capture's own write, and no replay's


def test_host_graph_refuses_an_input_in_its_own_pool():
    """The output of a graph of the same pool may share memory with this graph's intermediates."""
    x = torch.ones(4)
    graph = graphopt.DeviceGraph("cpu")
    graph.capture_begin()
    out = (x + 1) * 2
    graph.capture_end([out])
    assert graph.rebind(x, out) == "it lives in the graph pool's memory, where the graph's intermediates go"


def test_host_graph_refuses_an_input_that_shares_memory_with_another():
    both = cache_of(1.0)
    a, b = both[0], both[1]
    graph = graphopt.DeviceGraph("cpu")
    graph.capture_begin()
    out = a * b
    graph.capture_end([out])
    assert graph.rebind(a, torch.zeros(3, 4)) == \
        "another tensor from before the capture shares the captured one's memory"


@pytest.mark.cuda
def test_cuda_graph_captures_again_for_a_new_cache_and_says_why():
    opt = graphopt.optimize(layer_step, config(), dynamic_dims={"x": 0})
    x = torch.arange(3.0, device="cuda")
    for cache in [cache_of(1.0).cuda()] * 3 + [cache_of(2.0).cuda()]:
        check_step(opt, x, cache)
    report = opt.report()
    assert report.recaptures == 1 and report.rebinds == 0
    assert any("a CUDA graph reads and writes its inputs at the addresses it captured" in reason
               for reason in report.recapture_reasons), report.recapture_reasons
