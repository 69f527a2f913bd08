"""Executor choice (`executors`): a stateless graph is timed on ONNX Runtime against
graphopt's compiled graph at its first call; the engine runs it only with eager's
outputs. Stateful graphs (a KV cache) never leave torch; a failed export is a logged
fallback."""

import copy

import pytest
import torch
from support import assert_close_tree, decode_inputs, unexpected_fallbacks
from torch import nn

import graphopt
from graphopt import FallbackKind
from graphopt.backend import executors
from graphopt.models import Decoder, DecoderConfig, ResNet, ResNetConfig


def optimized(model, level=1, engines=("onnxruntime",), **config):
    config = graphopt.GraphOptimizationConfig(graph_opt_level=level, freeze_parameters=True,
                                              executors=list(engines), **config)
    return graphopt.optimize(model, config)


def needs_onnxruntime():
    for name in ("onnxruntime", "onnx", "onnxscript"):
        pytest.importorskip(name)


@pytest.fixture
def engine_wins(monkeypatch):
    """The timing says ONNX Runtime is faster, whatever this machine measures: the
    test then shows what the engine computes (it is kept only with eager's outputs)."""
    def timed(racing, inputs, *timing):
        return {name: (2.0 if name == "graphopt" else 1.0) for name in racing}
    monkeypatch.setattr(executors.candidates, "median_seconds", timed)


def bert():
    transformers = pytest.importorskip("transformers")
    from graphopt.bench.workloads import BertEncoder

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32)
    return BertEncoder(config).eval(), lambda batch: (torch.randint(0, 100, (batch, 12)),
                                                      torch.ones(batch, 12, dtype=torch.long))


def cnn():
    torch.manual_seed(0)
    return ResNet(ResNetConfig.tiny()).eval(), lambda batch: (torch.randn(batch, 3, 32, 32),)


@pytest.mark.parametrize("build,level,host_graphs", [(bert, 1, False), (cnn, 1, True), (cnn, 2, False)])
def test_a_stateless_graph_is_timed_on_the_engine_and_gives_eager_outputs(build, level, host_graphs):
    needs_onnxruntime()
    model, inputs = build()
    step = optimized(copy.deepcopy(model), level, use_cudagraph=host_graphs)
    with torch.inference_mode():
        for batch in (2, 1, 3):  # a static graph, then a dynamic one
            args = inputs(batch)
            assert_close_tree(step(*args), model(*args), f"batch {batch}")
    report = step.report()
    assert report.executors and all(set(e["seconds"]) == {"graphopt", "onnxruntime"} for e in report.executors)
    assert all(e["executor"] in ("graphopt", "onnxruntime") for e in report.executors)
    assert unexpected_fallbacks(report) == {}
    assert "executor of graph 0:" in str(report)


@pytest.mark.parametrize("build", [bert, cnn])
def test_the_engine_runs_a_graph_with_eager_outputs_at_every_batch(build, engine_wins):
    needs_onnxruntime()
    model, inputs = build()
    step = optimized(copy.deepcopy(model))
    with torch.inference_mode():
        for batch in (2, 1, 3, 5):
            args = inputs(batch)
            assert_close_tree(step(*args), model(*args), f"batch {batch}")
    assert {e["executor"] for e in step.report().executors} == {"onnxruntime"}


def test_a_second_start_chooses_its_engine_again(engine_wins, tmp_path):
    """The engine is exported and timed from the graph Dynamo hands over: a step with
    executors stores no trace, so a second start on the same cache (its graph loaded
    from there) runs the engine again rather than graphopt's code."""
    needs_onnxruntime()
    model, inputs = cnn()
    args = inputs(2)
    for start in ("first", "second"):
        torch._dynamo.reset()
        step = optimized(copy.deepcopy(model), cache_dir=str(tmp_path))
        with torch.inference_mode():
            assert_close_tree(step(*args), model(*args), f"{start} start")
        assert {e["executor"] for e in step.report().executors} == {"onnxruntime"}, start
    assert (step.report().cache_hits, step.report().traces_used) == (1, 0)


def test_refresh_exports_the_weights_again(engine_wins):
    needs_onnxruntime()
    model, inputs = cnn()
    step = optimized(model)
    args = inputs(2)
    with torch.inference_mode():
        step(*args)
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.data.mul_(1.5)  # through .data: not noticed, so stale until refresh()
        stale = step(*args)
        step.refresh()
        fresh = model(*args)
        assert not torch.allclose(stale, fresh)
        assert_close_tree(step(*args), fresh, "after refresh()")


def test_a_graph_that_writes_its_kv_cache_does_not_qualify():
    needs_onnxruntime()
    eager = Decoder(DecoderConfig.tiny()).eval()
    model = copy.deepcopy(eager)
    step = optimized(model, use_cudagraph=False)
    with torch.inference_mode():
        assert_close_tree(step(*decode_inputs(2)), eager(*decode_inputs(2)), "decode step")
    reasons = [e["reason"] for e in step.report().executors]
    assert reasons and all("writes its input" in r and "in place" in r for r in reasons), reasons
    assert {e["executor"] for e in step.report().executors} == {"graphopt"}


def test_a_random_graph_does_not_qualify():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).train()
    step = optimized(model, use_cudagraph=False)
    with torch.no_grad():
        step(torch.randn(2, 8))
    assert "draws random numbers" in step.report().executors[0]["reason"]


@torch.library.custom_op("graphopt_test::no_onnx", mutates_args=())
def no_onnx(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@no_onnx.register_fake
def _(x):
    return torch.empty_like(x)


class Unexportable(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return no_onnx(self.linear(x)).relu()


def test_a_failed_export_is_a_logged_fallback(caplog):
    needs_onnxruntime()
    model = Unexportable().eval()
    # No compile cache: a trace naming the test's own operator cannot be stored (its own fallback).
    step = optimized(copy.deepcopy(model), use_cudagraph=False, cache_dir=None)
    x = torch.randn(3, 8)
    with torch.inference_mode(), caplog.at_level("WARNING", logger="graphopt"):
        assert_close_tree(step(x), model(x), "an op ONNX cannot express")
        step(x)
    assert set(step.report().fallback_counts) == {FallbackKind.EXECUTOR}
    (failed,) = step.report().fallbacks
    assert sum(failed in m for m in caplog.messages) == 1  # logged once
    assert step.report().executors[0]["executor"] == "graphopt"
    assert step.report().executors[0]["reason"] == "no engine ran it (see the fallbacks)"


@pytest.mark.parametrize("value,error,message", [
    ("onnxruntime", TypeError, "executors must be a list of engine names"),
    (["onnxrt"], ValueError, "'onnxrt' at index 0 is not one; did you mean 'onnxruntime'?"),
])
def test_bad_executors_are_named(value, error, message):
    with pytest.raises(error, match=message):
        graphopt.GraphOptimizationConfig(graph_opt_level=1, freeze_parameters=True, executors=value)


def test_executors_need_frozen_weights():
    with pytest.raises(ValueError, match="it needs freeze_parameters=True"):
        graphopt.GraphOptimizationConfig(graph_opt_level=1, executors=["onnxruntime"])


def test_openvino_runs_a_graph_with_eager_outputs(engine_wins):
    needs_onnxruntime()  # the exporter's packages
    pytest.importorskip("openvino")
    model, inputs = cnn()
    step = optimized(copy.deepcopy(model), engines=("openvino",), use_cudagraph=False)
    with torch.inference_mode():
        for batch in (2, 1, 3):
            args = inputs(batch)
            assert_close_tree(step(*args), model(*args), f"batch {batch}")
    assert {e["executor"] for e in step.report().executors} == {"openvino"}
