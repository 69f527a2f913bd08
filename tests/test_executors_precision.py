"""The executors race at the precision the user allowed: in float32 every engine is asked
for float32 by name (OpenVINO's CPU plugin would otherwise compute in bfloat16 on a CPU
with bfloat16 units); with compute_dtype="bfloat16" OpenVINO's bfloat16 hint is a
candidate too, judged by its error against full precision and precision_tolerance."""

import copy

import pytest
import torch
from support import assert_close_tree
from torch import nn

import graphopt
from graphopt import FallbackKind
from graphopt._compat import mkldnn
from graphopt.backend import engines, executors
from graphopt.passes import lowered_error


def needs_openvino():
    for name in ("onnx", "onnxscript", "openvino"):
        pytest.importorskip(name)


def needs_native_bf16():
    if not mkldnn.cpu_has_native_bf16():
        pytest.skip("this CPU has no native bfloat16 (compute_dtype falls back to float32)")


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).eval()
    return model, torch.randn(4, 64)


def optimized(model, engines_=("openvino",), **config):
    config = graphopt.GraphOptimizationConfig(graph_opt_level=1, freeze_parameters=True, use_cudagraph=False,
                                              executors=list(engines_), **config)
    return graphopt.optimize(model, config)


@pytest.fixture
def fastest(monkeypatch):
    """Fake timing: the candidate named by the test is fastest, whatever this machine measures."""
    wanted = {}

    def timed(racing, inputs, *timing):
        return {name: (1.0 if name == wanted["name"] else 2.0) for name in racing}
    monkeypatch.setattr(executors.candidates, "median_seconds", timed)
    return wanted


@pytest.fixture
def compiles(monkeypatch):
    """Each OpenVINO compile: (the config graphopt passed, the precision the compiled model runs at)."""
    openvino = pytest.importorskip("openvino")

    seen, real = [], openvino.Core.compile_model

    def spy(core, model, device, config=None):
        compiled = real(core, model, device, config)
        seen.append((dict(config), str(compiled.get_property("INFERENCE_PRECISION_HINT"))))
        return compiled
    monkeypatch.setattr(openvino.Core, "compile_model", spy)
    return seen


def test_candidates_are_float32_and_bfloat16_only_where_allowed():
    assert engines.candidates(["onnxruntime", "openvino"], bfloat16=False) == [("onnxruntime", "f32"),
                                                                              ("openvino", "f32")]
    # ONNX Runtime's CPU provider has no bfloat16 compute mode on x86: float32 only.
    assert engines.candidates(["onnxruntime", "openvino"], bfloat16=True) == [
        ("onnxruntime", "f32"), ("openvino", "f32"), ("openvino", "bf16")]
    assert engines.openvino_config(3, "f32") == {"INFERENCE_NUM_THREADS": "3", "INFERENCE_PRECISION_HINT": "f32"}


@pytest.mark.parametrize("compute_dtype,native", [(None, True), ("bfloat16", False)])
def test_a_float32_race_asks_openvino_for_float32(compute_dtype, native, compiles, fastest, monkeypatch):
    needs_openvino()
    if not native:  # compute_dtype is refused here: the graph and the race stay float32
        monkeypatch.setattr(mkldnn, "cpu_has_native_bf16", lambda: False)
    fastest["name"] = "openvino"
    model, x = mlp()
    step = optimized(copy.deepcopy(model), compute_dtype=compute_dtype)
    with torch.inference_mode():
        assert_close_tree(step(x), model(x), "openvino in float32")
    (record,) = step.report().executors
    assert set(record["seconds"]) == {"graphopt", "openvino"} and record["executor"] == "openvino"
    assert "precision" not in record
    assert compiles == [({"INFERENCE_NUM_THREADS": str(torch.get_num_threads()), "INFERENCE_PRECISION_HINT": "f32"},
                         "<Type: 'float32'>")]


def test_with_bfloat16_allowed_openvino_bf16_races_within_precision_tolerance(compiles, fastest):
    needs_openvino()
    needs_native_bf16()
    fastest["name"] = "openvino-bf16"
    model, x = mlp()
    step = optimized(copy.deepcopy(model), engines_=("onnxruntime", "openvino"), compute_dtype="bfloat16")
    with torch.inference_mode():
        got, expected = step(x), model(x)
        step(x)
    relative, largest, _ = lowered_error.worst_error([expected], [got])
    assert 0 < relative <= 0.05  # precision_tolerance's default
    (record,) = step.report().executors
    assert set(record["seconds"]) == {"graphopt", "onnxruntime", "openvino", "openvino-bf16"}
    assert record["executor"] == "openvino-bf16"
    error = record["precision"]["openvino-bf16"]
    assert error["dtype"] == "bfloat16" and error["tolerance"] == 0.05 and not error["fell_back"]
    assert error["max_abs_error"] == pytest.approx(largest, rel=1e-6)  # what runs is what was measured
    assert largest > 1e-5  # bfloat16 products, not float32's
    assert sorted(hint for config, hint in compiles) == ["<Type: 'bfloat16'>", "<Type: 'float32'>"]
    assert "openvino-bf16 (bfloat16): max abs error" in str(step.report())


def test_openvino_bf16_past_precision_tolerance_is_not_a_candidate(fastest):
    needs_openvino()
    needs_native_bf16()
    fastest["name"] = "openvino-bf16"
    model, x = mlp()
    step = optimized(copy.deepcopy(model), compute_dtype="bfloat16", precision_tolerance=1e-7)
    with torch.inference_mode():
        assert_close_tree(step(x), model(x), "float32 back where bfloat16's error is over the bound")
    report = step.report()
    (record,) = report.executors
    assert record["executor"] == "graphopt" and set(record["seconds"]) == {"graphopt", "openvino"}
    assert record["precision"]["openvino-bf16"]["fell_back"]
    (why,) = [f for f in report.fallbacks if "openvino-bf16" in f]
    assert "over precision_tolerance=1e-07" in why and "not a candidate" in why
    assert report.fallback_counts[FallbackKind.EXECUTOR] == 1


@pytest.mark.fresh_cache  # each case times its race: a cached choice from the case before would skip it
@pytest.mark.parametrize("first,again,picked", [
    ({"graphopt": 1.0, "onnxruntime": 0.96}, {"graphopt": 1.0, "onnxruntime": 0.8}, "onnxruntime"),
    ({"graphopt": 1.0, "onnxruntime": 0.9}, {"graphopt": 1.0, "onnxruntime": 1.2}, "graphopt"),
    ({"graphopt": 2.0, "onnxruntime": 1.0}, None, "onnxruntime"),
])
def test_a_close_race_is_timed_again_over_more_rounds(first, again, picked, monkeypatch):
    for name in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(name)
    calls = []

    def timed(racing, inputs, rounds, *timing):
        calls.append((set(racing), rounds))
        return dict(first if len(calls) == 1 else again)
    monkeypatch.setattr(executors.candidates, "median_seconds", timed)
    model, x = mlp()
    step = optimized(copy.deepcopy(model), engines_=("onnxruntime",))
    with torch.inference_mode():
        assert_close_tree(step(x), model(x), f"{picked} picked")
    (record,) = step.report().executors
    assert record["executor"] == picked
    assert calls[0] == ({"graphopt", "onnxruntime"}, executors._ROUNDS)
    assert calls[1:] == ([({"graphopt", "onnxruntime"}, executors._CLOSE_ROUNDS)] if again else [])
    assert record["seconds"] == (again or first)
