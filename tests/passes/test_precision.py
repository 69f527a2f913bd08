"""compute_dtype: lower_precision, its measured error, the tolerance fallback and the CPU check."""

import re

import pytest
import torch
import torch.nn.functional as F
from support import decode_inputs, unexpected_fallbacks

import graphopt
from graphopt import FallbackKind
from graphopt._compat import mkldnn
from graphopt.config import tolerance
from graphopt.models import Decoder, DecoderConfig
from graphopt.models.resnet import ResNet, ResNetConfig
from graphopt.passes import lowered_error, manager, precision
from graphopt.passes.precision import LOWERED_OPS, PRECISION_TABLE

aten, prims = torch.ops.aten, torch.ops.prims


@pytest.fixture(autouse=True)
def native_bf16(monkeypatch):
    """bfloat16 math is right on every CPU, only slow without AVX512-BF16 or AMX: the
    tests run everywhere as if the CPU had it, except the one of the refusal."""
    monkeypatch.setattr(mkldnn, "cpu_has_native_bf16", lambda: True)


@pytest.fixture
def decoder() -> Decoder:
    """One layer: its projections, norms and attention are those of every layer, and each
    layer adds its share to every compile."""
    torch.manual_seed(0)
    return Decoder(DecoderConfig.tiny(num_layers=1)).eval()


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 32)

    def forward(self, x):
        return torch.softmax(self.down(F.gelu(self.norm(self.up(x)))), -1) * 10


def optimized(model, level=1, **config):
    return graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=level, use_cudagraph=False, compute_dtype="bfloat16", **config))


def run(model, *args, level=1, **config):
    opt = optimized(model, level, **config)
    with torch.no_grad():
        out, expected = opt(*args), model(*args)
    return opt, out, expected


def assert_within_bf16(out, expected):
    assert out.dtype == expected.dtype == torch.float32
    atol, rtol = tolerance(torch.bfloat16)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def computed_in(gm, dtype):
    """The ops of `gm` (by name) whose floating inputs are all `dtype`, with their counts."""
    counts = {}
    for node in gm.graph.nodes:
        dtypes = {i.meta["val"].dtype for i in node.all_input_nodes
                  if isinstance(i.meta.get("val"), torch.Tensor) and i.meta["val"].dtype.is_floating_point}
        if node.op == "call_function" and node.target is not prims.convert_element_type.default \
                and dtypes == {dtype}:
            name = getattr(node.target, "_opname", getattr(node.target, "__name__", str(node.target)))
            counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.fresh_cache
@pytest.mark.parametrize("freeze", [False, True])
def test_mlp_at_level_1_computes_its_linears_in_bfloat16(freeze):
    torch.manual_seed(0)
    opt, out, expected = run(MLP().eval(), torch.randn(8, 64), freeze_parameters=freeze)
    assert_within_bf16(out, expected)
    (gm,) = opt.graphs()
    # With frozen weights fuse_packed_linear packs a bfloat16 linear's weight for oneDNN at any size.
    packed = freeze and mkldnn.available() and mkldnn.cpu_has_native_bf16()
    assert computed_in(gm, torch.bfloat16) == ({"_linear_pointwise": 2} if packed else {"linear": 2})
    assert {"native_layer_norm", "_softmax"} <= set(computed_in(gm, torch.float32))
    casts = [n for n in gm.graph.nodes if n.target is prims.convert_element_type.default]
    # The input and gelu's result to bfloat16, the two linears' results back; with frozen
    # weights their casts are folded into buffers, without they run at each call.
    assert len(casts) == (4 if freeze else 8)
    assert {p.name: p.counts for p in opt.report().passes}["lower_precision"] == {"linear": 2}
    assert unexpected_fallbacks(opt.report()) == {}


def test_the_report_gives_the_measured_error():
    torch.manual_seed(0)
    opt, out, expected = run(MLP().eval(), torch.randn(8, 64))
    (record,) = opt.report().graphs
    error = record.precision
    assert error["dtype"] == "bfloat16" and not error["fell_back"] and error["tolerance"] == 0.05
    # Measured on the compile's example inputs, which this call's are.
    assert error["max_abs_error"] == pytest.approx((out - expected).abs().max().item(), rel=0.01)
    assert 0 < error["mean_abs_error"] < error["max_abs_error"]
    assert error["relative_error"] == pytest.approx(error["max_abs_error"] / expected.abs().max().item(), rel=0.01)
    assert opt.report().to_dict()["graphs"][0]["precision"] == error
    kept = r"lower precision \(bfloat16\): max abs error \S+, mean \S+, \S+ of the output's magnitude \(kept\)"
    assert re.search(kept, str(opt.report()))


def test_a_tight_tolerance_keeps_full_precision_and_says_why():
    torch.manual_seed(0)
    opt, out, expected = run(MLP().eval(), torch.randn(8, 64), precision_tolerance=1e-9)
    atol, rtol = tolerance(torch.float32)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    (gm,) = opt.graphs()
    assert computed_in(gm, torch.bfloat16) == {}
    (record,) = opt.report().graphs
    assert record.precision["fell_back"] and record.precision["relative_error"] > 1e-9
    assert unexpected_fallbacks(opt.report()) == {FallbackKind.PRECISION: 1}
    (reason,) = opt.report().reasons(FallbackKind.PRECISION)  # the message users read: it names the fix
    assert re.fullmatch(r"lower_precision \(bfloat16\): the graph's error against full precision, max abs \S+ "
                        r"\(mean \S+\), is \S+ of its output's largest magnitude, over precision_tolerance=1e-09; "
                        r"the pass is undone for this graph \(precision_tolerance=\S+ or more would keep it\)", reason)
    assert f"max abs {record.precision['max_abs_error']:.3g}" in reason
    assert "over precision_tolerance=1e-09: full precision" in str(opt.report())


@pytest.mark.fresh_cache
def test_a_cpu_without_native_bfloat16_computes_in_float32(monkeypatch):
    monkeypatch.setattr(mkldnn, "cpu_has_native_bf16", lambda: False)
    torch.manual_seed(0)
    opt, out, expected = run(MLP().eval(), torch.randn(8, 64))
    atol, rtol = tolerance(torch.float32)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    (gm,) = opt.graphs()
    assert computed_in(gm, torch.bfloat16) == {}
    assert opt.report().graphs[0].precision == {}
    assert unexpected_fallbacks(opt.report()) == {FallbackKind.PRECISION: 1}


def test_verify_holds_the_lowered_graph_to_the_precision_bound():
    torch.manual_seed(0)
    opt, out, expected = run(MLP().eval(), torch.randn(8, 64), verify=True)
    assert_within_bf16(out, expected)
    assert computed_in(opt.graphs()[0], torch.bfloat16) == {"linear": 2}


def test_disabled_passes_turns_it_off():
    torch.manual_seed(0)
    opt, _, _ = run(MLP().eval(), torch.randn(8, 64), disabled_passes=["lower_precision"])
    assert computed_in(opt.graphs()[0], torch.bfloat16) == {}
    assert "lower_precision" not in {p.name for p in opt.report().passes}


def test_without_compute_dtype_the_pipeline_is_unchanged():
    opt = graphopt.optimize(MLP().eval(), graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    with torch.no_grad():
        opt(torch.randn(8, 64))
    assert [p.name for p in opt.report().passes] == manager.PIPELINES[1]


def test_conv_net_computes_its_convolutions_in_bfloat16():
    torch.manual_seed(0)
    model = ResNet(ResNetConfig.tiny()).eval()
    opt, out, expected = run(model, torch.randn(2, 3, 32, 32))
    assert_within_bf16(out, expected)
    lowered = computed_in(opt.graphs()[0], torch.bfloat16)
    assert lowered["convolution"] == sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    assert "_native_batch_norm_legit_no_training" in computed_in(opt.graphs()[0], torch.float32)


def test_decoder_step_computes_its_projections_in_bfloat16(decoder):
    opt = optimized(decoder)
    with torch.inference_mode():
        out, expected = opt(*decode_inputs(3)), decoder(*decode_inputs(3))
    assert_within_bf16(out, expected)
    (gm,) = opt.graphs()
    projections = sum(isinstance(m, torch.nn.Linear) for m in decoder.modules())
    assert {p.name: p.counts for p in opt.report().passes}["lower_precision"] == {"linear": projections}
    # Attention over the cache (graphopt's kernel) and the norms stay float32.
    assert computed_in(gm, torch.bfloat16) == {"linear": projections}
    assert opt.report().graphs[0].precision["relative_error"] < 0.05


@pytest.mark.parametrize("freeze", [False, True])
def test_mlp_at_level_2_computes_its_gemms_in_bfloat16(freeze):
    torch.manual_seed(0)
    # ATen's GEMMs with frozen weights too: the lowering is in the graph before Inductor, and
    # timing the C++ template (the int8 tests' subject) would only make the compile longer.
    opt, out, expected = run(MLP().eval(), torch.randn(8, 64), level=2, freeze_parameters=freeze,
                             inductor_compile_config={"max_autotune_gemm": False})
    assert_within_bf16(out, expected)
    (gm,) = opt.graphs()
    assert computed_in(gm, torch.bfloat16) == {"addmm": 2}
    assert {p.name: p.counts for p in opt.report().passes}["lower_precision"] == {"addmm": 2}
    assert not opt.report().graphs[0].precision["fell_back"]


def test_a_compile_cache_hit_reports_the_stored_error(tmp_path):
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(8, 64)
    first, _, _ = run(model, x, cache_dir=str(tmp_path))
    torch._dynamo.reset()
    second, out, expected = run(model, x, cache_dir=str(tmp_path))
    assert_within_bf16(out, expected)
    (record,) = second.report().graphs
    assert record.cache_hit and record.precision == first.report().graphs[0].precision


def test_the_error_is_that_of_the_worst_result():
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    gm.meta[precision.COMPUTE_DTYPE] = torch.bfloat16
    logits, cache = torch.tensor([4.0, -2.0]), torch.zeros(1000)
    error = lowered_error.measured_error(gm, [logits, cache], [torch.tensor([4.1, -2.0]), cache], 0.05)
    # The cache's zeros do not dilute the mean: it is the logits'.
    assert error == {"dtype": "bfloat16", "max_abs_error": pytest.approx(0.1), "mean_abs_error": pytest.approx(0.05),
                     "relative_error": pytest.approx(0.025), "tolerance": 0.05, "slack": 1.0, "fell_back": False}
    flipped = lowered_error.measured_error(gm, [torch.tensor([1])], [torch.tensor([0])], None)
    assert flipped["relative_error"] == float("inf") and not flipped["fell_back"]


def test_every_lowered_op_has_a_reason():
    assert LOWERED_OPS and all(reason for _, reason in PRECISION_TABLE.values())
    assert {how for how, _ in PRECISION_TABLE.values()} == {"lower", "float32"}


def quantized(model, **config):
    config = {"graph_opt_level": 1, **config}
    return graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        use_cudagraph=False, freeze_parameters=True, weight_quantization="int8", **config))


@pytest.mark.fresh_cache
def test_int8_weights_run_on_the_int8_kernel_with_the_error_reported():
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(8, 64)
    opt = quantized(model)
    with torch.no_grad():
        out, expected = opt(x), model(x)
    assert_within_bf16(out, expected)
    (gm,) = opt.graphs()
    kernels = [n for n in gm.graph.nodes if n.target is aten._weight_int8pack_mm.default]
    assert len(kernels) == 2 and not any(n.target is aten.linear.default for n in gm.graph.nodes)
    assert [n.args[1].meta["val"].dtype for n in kernels] == [torch.int8, torch.int8]
    assert all(n.args[1].op == "get_attr" and n.args[2].op == "get_attr" for n in kernels)  # folded once
    assert {p.name: p.counts for p in opt.report().passes}["quantize_weights"] == {"quantized": 2}
    error = opt.report().graphs[0].precision
    assert error["dtype"] == "int8 weights" and 0 < error["relative_error"] < 0.05
    assert "lower precision (int8 weights): max abs error" in str(opt.report())


def test_refresh_quantizes_updated_weights_again():
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(8, 64)
    opt = quantized(model)
    with torch.no_grad():
        opt(x)
        model.up.weight.mul_(2)
        opt.refresh()
        assert_within_bf16(opt(x), model(x))


def test_int8_weights_with_bfloat16_compute_measure_both_against_full_precision():
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(8, 64)
    opt = quantized(model, compute_dtype="bfloat16")
    with torch.no_grad():
        assert_within_bf16(opt(x), model(x))
    names = [p.name for p in opt.report().passes]
    assert names.index("quantize_weights") + 1 == names.index("lower_precision")
    assert opt.report().graphs[0].precision["dtype"] == "int8 weights + bfloat16"


def test_a_tight_tolerance_undoes_the_quantization():
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(8, 64)
    opt = quantized(model, precision_tolerance=1e-9)
    with torch.no_grad():
        out, expected = opt(x), model(x)
    atol, rtol = tolerance(torch.float32)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    assert not any(n.target is aten._weight_int8pack_mm.default for n in opt.graphs()[0].graph.nodes)
    assert unexpected_fallbacks(opt.report()) == {FallbackKind.PRECISION: 1}


@pytest.mark.parametrize("level", [1, 2])
def test_a_tight_tolerance_undoes_the_quantization_of_a_fused_qkv_weight(decoder, level):
    """The quantization frees the float32 QKV concatenation and may store its int8 weight
    under the freed name: undone, the graph reads the float32 value again."""
    with torch.inference_mode():
        expected = decoder(*decode_inputs(3))
        # ATen's GEMMs at level 2: the fallback is graphopt's, decided before Inductor times any.
        aten_gemms = {"inductor_compile_config": {"max_autotune_gemm": False}} if level == 2 else {}
        opt = quantized(decoder, graph_opt_level=level, precision_tolerance=1e-9, **aten_gemms)
        out = opt(*decode_inputs(3))
    atol, rtol = tolerance(torch.float32)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    assert {p.name: p.counts for p in opt.report().passes}["fuse_horizontal_linear"]
    assert unexpected_fallbacks(opt.report()) == {FallbackKind.PRECISION: 1}


def test_decoder_step_with_int8_weights(decoder):
    opt = quantized(decoder)
    with torch.inference_mode():
        out, expected = opt(*decode_inputs(3)), decoder(*decode_inputs(3))
    (gm,) = opt.graphs()
    kernels = sum(n.target is aten._weight_int8pack_mm.default for n in gm.graph.nodes)
    # Every linear: per layer q, k, v (one after fuse_horizontal_linear), o, gate, up (one) and down; the lm_head.
    counts = {p.name: p.counts for p in opt.report().passes}["quantize_weights"]
    assert counts == {"quantized": 4 * decoder.config.num_layers, "logits quantized": 1}
    assert kernels == 4 * decoder.config.num_layers + 1
    assert not any(n.target is aten.linear.default for n in gm.graph.nodes)
    assert opt.report().graphs[0].precision["relative_error"] < 0.05
    torch.testing.assert_close(out, expected, atol=0.1, rtol=0.1)


@pytest.mark.parametrize("changes, error, message", [
    ({"weight_quantization": "int2"}, ValueError, "weight_quantization must be one of 'int8', 'int4' or null, "
                                                 "got 'int2'"),
    ({"weight_quantization": "int8"}, ValueError, "weight_quantization='int8' quantizes frozen weights at compile "
                                                  "time, at level 1, 2 or 'auto': it needs freeze_parameters=True "
                                                  "and a level above 0"),
    ({"weight_quantization": "int8", "freeze_parameters": True, "graph_opt_level": 0}, ValueError,
     "it needs freeze_parameters=True and a level above 0"),
    ({"compute_dtype": "float16"}, ValueError, "compute_dtype must be one of 'bfloat16' or null, got 'float16'"),
    ({"compute_dtype": torch.bfloat16}, TypeError, "compute_dtype must be one of 'bfloat16' or null, got "),
    ({"precision_tolerance": 0}, ValueError, "precision_tolerance must be a number > 0 (a causal LM's next-token "
                                             "KL in nats, else a fraction of the output's largest magnitude) or null "
                                             "for no bound, got 0"),
    ({"precision_tolerance": float("nan")}, ValueError, "precision_tolerance must be a number > 0"),
    ({"precision_tolerance": "0.1"}, TypeError, "precision_tolerance must be a number > 0"),
    ({"precision_tolerance": True}, TypeError, "precision_tolerance must be a number > 0"),
])
def test_invalid_values_are_refused(changes, error, message):
    with pytest.raises(error, match=re.escape(message)):
        graphopt.GraphOptimizationConfig(**changes)


def test_the_keys_come_from_json():
    cfg = graphopt.GraphOptimizationConfig.from_json('{"compute_dtype": "bfloat16", "precision_tolerance": 0.01}')
    assert (cfg.compute_dtype, cfg.precision_tolerance) == ("bfloat16", 0.01)
    assert graphopt.GraphOptimizationConfig.from_json(cfg.to_json()) == cfg


def test_the_docs_show_the_table():
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "precision.md").read_text()
    for op, (how, reason) in PRECISION_TABLE.items():
        assert f"| `{op}` | {'bfloat16' if how == 'lower' else 'float32'} | {reason} |" in text
