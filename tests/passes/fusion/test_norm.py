"""fuse_norms: LayerNorm and RMSNorm written out, residual add + LayerNorm, residual
add + RMSNorm and its npugraph_ex epilogues, each in the forms model code writes, and
where they must not fuse."""

import pytest
import torch
import torch.nn.functional as F
from support import aot_graph, decode_inputs, targets
from torch.func import functional_call
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import graphopt
from graphopt._compat import inductor
from graphopt.config import tolerance
from graphopt.kernels import layer_norm as layer_norm_kernel
from graphopt.models import Decoder, DecoderConfig
from graphopt.models.decoder import RMSNorm
from graphopt.passes.cleanup import cse
from graphopt.passes.fusion.norm import fuse_norms

aten, graphopt_ops = torch.ops.aten, torch.ops.graphopt
BF16 = torch.bfloat16
H = 16
NORM_OPS = [aten.mean.dim, aten.var.correction, aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.sqrt.default]


def fuse(fn, *args):
    """fn's level-1 ATen graph after CSE (the cleanup before every fusion) and
    fuse_norms: (result, node count before, targets after). Outputs must equal
    eager's within tolerance, integer outputs exactly."""
    graph = aot_graph(fn, *args)
    cse(graph.gm)
    graph.gm.recompile()
    before = len(targets(graph))
    result = fuse_norms(graph.gm)
    graph.gm.graph.lint()
    graph.gm.recompile()
    with torch.no_grad():
        expected, got = fn(*args), graph(*args)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for e, g in zip(expected, got):
        atol, rtol = tolerance(e.dtype)
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol)
    return result, before, targets(graph)


def assert_fused(fn, args, name, op, removed, added=1):
    """One `name` match: `removed` decomposed nodes become `added` ones (`op`, the
    reads of its outputs, views), and no norm arithmetic is left."""
    result, before, after = fuse(fn, *args)
    assert result.counts == {name: 1}
    assert after.count(op) == 1
    assert not set(after) & set(NORM_OPS), after
    assert before - len(after) == removed - added
    return after


def assert_not_fused(fn, *args):
    result, before, after = fuse(fn, *args)
    assert result.counts == {} and not result.changed
    assert len(after) == before
    return after


# --- LayerNorm -------------------------------------------------------------------------

def normalize(x, squares, use_rsqrt, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True) if squares else x.var(-1, keepdim=True, unbiased=False)
    return (x - mean) * torch.rsqrt(var + eps) if use_rsqrt else (x - mean) / torch.sqrt(var + eps)


VARIANCES = [pytest.param(True, id="mean_of_squares"), pytest.param(False, id="var")]
ROOTS = [pytest.param(True, id="rsqrt"), pytest.param(False, id="sqrt")]


@pytest.mark.parametrize("squares", VARIANCES)
@pytest.mark.parametrize("use_rsqrt", ROOTS)
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_layer_norm_written_out(squares, use_rsqrt, dtype):
    x, w, b = torch.randn(2, 5, H, dtype=dtype), torch.randn(H, dtype=dtype), torch.randn(H, dtype=dtype)
    core = 7 if squares else 6  # mean, sub, (pow, mean | var), add, root, mul/div
    # native_layer_norm and the read of its output
    assert_fused(lambda x, w, b: normalize(x, squares, use_rsqrt) * w + b, (x, w, b),
                 "layer_norm", aten.native_layer_norm.default, core + 2, added=2)
    assert_fused(lambda x, w: normalize(x, squares, use_rsqrt) * w, (x, w),
                 "layer_norm", aten.native_layer_norm.default, core + 1, added=2)
    assert_fused(lambda x: normalize(x, squares, use_rsqrt), (x,),
                 "layer_norm", aten.native_layer_norm.default, core, added=2)


def upcast(x, w, b):
    return normalize(x.float(), True, True).to(x.dtype) * w + b


def upcast_affine_in_float32(x, w, b):
    return (normalize(x.float(), False, False) * w + b).to(x.dtype)


def upcast_no_affine(x, w, b):
    return normalize(x.float(), False, True).to(x.dtype)


@pytest.mark.parametrize("fn,removed", [(upcast, 11), (upcast_affine_in_float32, 10), (upcast_no_affine, 8)])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_layer_norm_upcast_to_float32(fn, removed, dtype):
    x, w, b = torch.randn(2, 5, H, dtype=dtype), torch.randn(H, dtype=dtype), torch.randn(H, dtype=dtype)
    assert_fused(fn, (x, w, b), "layer_norm", aten.native_layer_norm.default, removed, added=2)


def test_nn_layer_norm_is_already_native_layer_norm():
    x, w, b = torch.randn(2, 5, H), torch.randn(H), torch.randn(H)
    after = assert_not_fused(lambda x, w, b: F.layer_norm(x, (H,), w, b), x, w, b)
    assert aten.native_layer_norm.default in after


@pytest.mark.parametrize("fn", [
    pytest.param(lambda x, w, b: (x - x.mean(-1, True)) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5) * w + b,
                 id="unbiased_variance"),
    pytest.param(lambda x, w, b: (x - x.mean(0, True)) / torch.sqrt(x.var(0, keepdim=True, unbiased=False) + 1e-5),
                 id="over_dim_0"),
    pytest.param(lambda x, w, b: normalize(x, True, True, eps=b.abs()[:, None, None]), id="eps_tensor_per_row"),
])
def test_layer_norm_that_must_stay(fn):
    assert_not_fused(fn, torch.randn(H, 4, H), torch.randn(H), torch.randn(H))


@pytest.mark.parametrize("fn,removed,left", [
    pytest.param(lambda x, w, b: normalize(x, True, True) * w + b.half(), 8, [aten.add.Tensor], id="float16_bias"),
    pytest.param(lambda x, w, b: normalize(x, True, True) * w[:, None] + b, 7, [aten.mul.Tensor, aten.add.Tensor],
                 id="weight_over_another_dim"),
])
def test_layer_norm_scaled_by_other_than_a_vector_of_its_dtype_fuses_without_it(fn, removed, left):
    after = assert_fused(fn, (torch.randn(4, H, H), torch.randn(H), torch.randn(H)),
                         "layer_norm", aten.native_layer_norm.default, removed, added=2)
    assert set(left) <= set(after)


# --- Residual add + LayerNorm ----------------------------------------------------------

AFFINES = [pytest.param(lambda w, b: (w, b), id="weight_and_bias"), pytest.param(lambda w, b: (w, None), id="weight"),
           pytest.param(lambda w, b: (None, None), id="neither")]


@pytest.mark.parametrize("affine", AFFINES)
def test_add_then_layer_norm_whose_sum_only_the_norm_reads(affine):
    """BERT's `LayerNorm(dense + input)`: add, native_layer_norm and its getitem become one op."""
    x, r, w, b = torch.randn(2, 5, H), torch.randn(2, 5, H), torch.randn(H), torch.randn(H)
    after = assert_fused(lambda x, r, w, b: F.layer_norm(x + r, (H,), *affine(w, b), 1e-12), (x, r, w, b),
                         "skip_layer_norm", graphopt_ops.skip_layer_norm.default, removed=3)
    assert aten.add.Tensor not in after and aten.native_layer_norm.default not in after


@pytest.mark.parametrize("affine", AFFINES)
def test_add_then_layer_norm_whose_sum_is_read_elsewhere_returns_it(affine):
    """A pre-norm block: the sum is the next residual, so the op returns it too."""
    x, r, w, b = torch.randn(2, 5, H), torch.randn(2, 5, H), torch.randn(H), torch.randn(H)

    def block(x, r, w, b):
        summed = x + r
        return F.layer_norm(summed, (H,), *affine(w, b)), summed * 2

    after = assert_fused(block, (x, r, w, b), "add_layer_norm", graphopt_ops.add_layer_norm.default,
                         removed=3, added=3)  # the op and the reads of its two outputs
    assert aten.native_layer_norm.default not in after


@pytest.mark.parametrize("fn,args", [
    pytest.param(lambda x, r, w: F.layer_norm(x + r, (H,), w), (torch.randn(2, 5, H), torch.randn(1, 5, H)),
                 id="residual_broadcast"),
    pytest.param(lambda x, r, w: F.layer_norm(x + r, (5, H)), (torch.randn(2, 5, H), torch.randn(2, 5, H)),
                 id="over_two_dims"),
    pytest.param(lambda x, r, w: F.layer_norm(x + r, (H,), w.to(BF16)), (torch.randn(2, 5, H).to(BF16),
                 torch.randn(2, 5, H).to(BF16)), id="bfloat16"),
    pytest.param(lambda x, r, w: F.layer_norm(x + r.double(), (H,), w.double()),
                 (torch.randn(2, 5, H), torch.randn(2, 5, H)), id="float64_after_promotion"),
    pytest.param(lambda x, r, w: F.layer_norm(x * r, (H,), w), (torch.randn(2, 5, H), torch.randn(2, 5, H)),
                 id="product_not_sum"),
])
def test_add_then_layer_norm_that_must_stay(fn, args):
    after = assert_not_fused(fn, *args, torch.randn(H))
    assert aten.native_layer_norm.default in after


def test_add_then_layer_norm_stays_where_its_kernel_cannot_be_built(monkeypatch):
    """Without the C++ kernel the op would be the same two torch ops behind one more call."""
    monkeypatch.setattr(layer_norm_kernel, "native_unavailable", lambda: "no compiler")
    x, r, w, b = torch.randn(2, 5, H), torch.randn(2, 5, H), torch.randn(H), torch.randn(H)
    assert_not_fused(lambda x, r, w, b: F.layer_norm(x + r, (H,), w, b), x, r, w, b)


class PostNormBlock(torch.nn.Module):
    """BERT's output block: dense, then LayerNorm of it plus the block's input."""

    def __init__(self):
        super().__init__()
        self.dense, self.norm = torch.nn.Linear(H, H), torch.nn.LayerNorm(H, eps=1e-12)

    def forward(self, x):
        return self.norm(self.dense(x) + x)


@pytest.mark.parametrize("use_cudagraph", [False, True], ids=["plain", "host_graphs"])
def test_add_then_layer_norm_fuses_at_level_1_and_serves_every_batch_size(use_cudagraph):
    torch.manual_seed(0)
    model = PostNormBlock().eval()
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, use_cudagraph=use_cudagraph, cudagraph_capture_sizes=[1, 4, 8], cache_dir=None))
    with torch.no_grad():
        for batch in (1, 3, 8, 5):
            x = torch.randn(batch, 7, H)
            torch.testing.assert_close(opt(x), model(x), atol=1e-5, rtol=1e-5)
    report = opt.report()
    assert {p.counts.get("skip_layer_norm") for p in report.passes if p.name == "fuse_norms"} == {1}
    assert all(t != aten.native_layer_norm.default for g in opt.graphs() for t in targets(g))


def test_add_then_layer_norm_stays_at_level_2():
    """Inductor makes one kernel of the add and the LayerNorm itself."""
    if not inductor.inductor_available():
        pytest.skip("level 2 needs a C++ compiler")
    torch.manual_seed(0)
    model, x = PostNormBlock().eval(), torch.randn(3, 5, H)
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=2, use_cudagraph=False,
                                                                    cache_dir=None))
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), atol=1e-5, rtol=1e-5)
    assert not next(p for p in opt.report().passes if p.name == "fuse_norms").counts


# --- RMSNorm ---------------------------------------------------------------------------

LLAMA_NORM, DECODER_NORM = LlamaRMSNorm(H, eps=1e-6), RMSNorm(H, 1e-6, torch.float32)


def llama_rms_norm(x, w):
    """transformers' LlamaRMSNorm (Qwen2RMSNorm is the same code), with weight `w`."""
    return torch.func.functional_call(LLAMA_NORM, {"weight": w}, (x,))


def decoder_rms_norm(x, w):
    return torch.func.functional_call(DECODER_NORM, {"weight": w}, (x,))


def scale_last(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def torch_rms_norm(x, w, eps=1e-6):
    return torch.rms_norm(x, (H,), w, eps)


def nn_rms_norm(x, w, eps=None):
    return F.rms_norm(x, (H,), w, eps)


RMS_FORMS = [llama_rms_norm, decoder_rms_norm, scale_last, torch_rms_norm, nn_rms_norm]
RMS_OPS = [*NORM_OPS, aten._to_copy.default]


def removed_by_rms_norm(form, x, w=None):
    """pow, mean, add, rsqrt, mul, the weight's mul, and the casts to float32 and
    back that every form but `scale_last` writes (gone in float32)."""
    casts = 2 if form is not scale_last and x.dtype != torch.float32 else 0
    return 5 + (w is not None) + casts


@pytest.mark.parametrize("form", RMS_FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16])
def test_rms_norm(form, dtype):
    x, w = torch.randn(2, 5, H, dtype=dtype), torch.randn(H, dtype=dtype)
    after = assert_fused(form, (x, w), "rms_norm", graphopt_ops.rms_norm.default, removed_by_rms_norm(form, x, w))
    assert not set(after) & set(RMS_OPS)


def test_llama_rms_norm_with_float32_weight_on_bfloat16_input():
    """LlamaRMSNorm whose weight stayed float32 returns float32: so does the op."""
    x, w = torch.randn(2, 5, H, dtype=BF16), torch.randn(H)
    assert_fused(llama_rms_norm, (x, w), "rms_norm", graphopt_ops.rms_norm.default, 8)


@pytest.mark.parametrize("form", [
    pytest.param(nn_rms_norm, id="nn_rms_norm"),
    pytest.param(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), id="written_out"),
])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_rms_norm_without_weight(form, dtype):
    x = torch.randn(2, 5, H, dtype=dtype)
    casts = 2 if form is nn_rms_norm and dtype != torch.float32 else 0
    after = assert_fused(lambda x: form(x, None), (x,), "rms_norm", graphopt_ops.rms_norm.default, 5 + casts)
    assert not set(after) & set(RMS_OPS)


@pytest.mark.parametrize("form", RMS_FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_add_rms_norm(form, dtype):
    x, r, w = torch.randn(2, 5, H, dtype=dtype), torch.randn(2, 5, H, dtype=dtype), torch.randn(H, dtype=dtype)

    def block(x, r, w):
        summed = x + r
        return form(summed, w), summed

    # the op and the reads of both its outputs
    assert_fused(block, (x, r, w), "add_rms_norm", graphopt_ops.add_rms_norm.default,
                 1 + removed_by_rms_norm(form, x, w), added=3)


def test_add_rms_norm_whose_sum_is_read_only_by_the_norm():
    x, r, w = torch.randn(2, 5, H), torch.randn(2, 5, H), torch.randn(H)
    after = assert_fused(lambda x, r, w: llama_rms_norm(x + r, w), (x, r, w), "add_rms_norm",
                         graphopt_ops.add_rms_norm.default, 1 + removed_by_rms_norm(llama_rms_norm, x, w), added=2)
    assert aten.add.Tensor not in after


@pytest.mark.parametrize("fn", [
    pytest.param(lambda x, r, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + r[..., :1]) * w,
                 id="eps_tensor_per_row"),
    pytest.param(lambda x, r, w: x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6) * w, id="over_dim_0"),
    pytest.param(lambda x, r, w: (scale_last(x, w), x.pow(2).mean(-1, keepdim=True)), id="variance_read_elsewhere"),
    pytest.param(lambda x, r, w: x * torch.rsqrt(x.pow(4).mean(-1, keepdim=True) + 1e-6) * w, id="fourth_power"),
])
def test_rms_norm_that_must_stay(fn):
    after = assert_not_fused(fn, torch.randn(4, H), torch.rand(4, H), torch.randn(H))
    assert aten.rsqrt.default in after


@pytest.mark.parametrize("weight", [
    pytest.param(lambda r, w: r, id="rows_by_hidden"),
    pytest.param(lambda r, w: w[:1], id="of_shape_1"),
])
def test_rms_norm_scaled_by_other_than_a_vector_fuses_without_it(weight):
    args = (torch.randn(4, H), torch.randn(4, H), torch.randn(H))
    after = assert_fused(lambda x, r, w: scale_last(x, weight(r, w)), args, "rms_norm",
                         graphopt_ops.rms_norm.default, 5)
    assert aten.mul.Tensor in after


def test_add_rms_norm_whose_float32_copy_is_read_elsewhere_normalises_the_copy():
    """The sum is the pattern's output and may be read anywhere; its float32 copy
    is an intermediate: read elsewhere, it stays, and only what follows it fuses."""
    x, r, w = torch.randn(2, 5, H, dtype=BF16), torch.randn(2, 5, H, dtype=BF16), torch.randn(H, dtype=BF16)

    def block(x, r, w):
        upcast = (x + r).float()
        return w * (upcast * torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16), upcast

    after = assert_fused(block, (x, r, w), "rms_norm", graphopt_ops.rms_norm.default, 5)
    assert aten.add.Tensor in after and aten._to_copy.default in after


def test_add_rms_norm_scaled_by_gemmas_one_plus_weight():
    """GemmaRMSNorm scales by `1 + w`, computed after the norm, so after the residual
    add the fused op takes the place of: it must move after `1 + w`, and the later
    read of the residual after it."""
    norm = GemmaRMSNorm(H)

    def block(x, r, w):
        h = x + r
        return functional_call(norm, {"weight": w}, (h,)), h * 2

    result, _, after = fuse(block, torch.randn(2, 5, H), torch.randn(2, 5, H), torch.randn(H))
    assert result.counts == {"add_rms_norm": 1}
    assert after.count(graphopt_ops.add_rms_norm.default) == 1 and not set(after) & set(NORM_OPS)


# --- npugraph_ex's add + RMSNorm epilogues ----------------------------------------------

def dynamic_quant(y):
    scale = y.abs().amax(dim=-1, keepdim=True) / 127.0
    return torch.clamp(torch.round(y / scale), -128, 127).to(torch.int8), scale


QUANT_OPS = [aten.abs.default, aten.amax.default, aten.round.default, aten.clamp.default]
# (reshape of the normed value, whether it flattens [2, 5, H] to [10, H])
FLATTENS = [pytest.param(lambda t: t, False, id="as_is"),
            pytest.param(lambda t: t.view(-1, t.shape[-1]), True, id="view"),
            pytest.param(lambda t: t.flatten(0, 1), True, id="flatten")]


@pytest.mark.parametrize("flat,flattens", FLATTENS)
@pytest.mark.parametrize("form", [llama_rms_norm, torch_rms_norm, scale_last])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_add_rms_norm_dynamic_quant(flat, flattens, form, dtype):
    x, r, w = torch.randn(2, 5, H, dtype=dtype), torch.randn(2, 5, H, dtype=dtype), torch.randn(H, dtype=dtype)

    def block(x, r, w):
        summed = x + r
        return (*dynamic_quant(flat(form(summed, w))), summed)

    # The add, the norm, and abs, amax, div, div, round, clamp, cast; flattened, the
    # normed value is viewed once, and the fused form views both results.
    removed = 1 + removed_by_rms_norm(form, x, w) + 7 + flattens
    after = assert_fused(block, (x, r, w), "add_rms_norm_dynamic_quant",
                         graphopt_ops.add_rms_norm_dynamic_quant.default, removed, added=4 + 2 * flattens)
    assert not set(after) & set(QUANT_OPS)


def test_dynamic_quant_of_a_normed_value_read_elsewhere_fuses_only_the_norm():
    x, r, w = torch.randn(2, 5, H), torch.randn(2, 5, H), torch.randn(H)

    def block(x, r, w):
        summed = x + r
        normed = llama_rms_norm(summed, w)
        return (*dynamic_quant(normed), summed, normed)

    result, _, after = fuse(block, x, r, w)
    assert result.counts == {"add_rms_norm": 1}
    assert set(QUANT_OPS) <= set(after)


@pytest.mark.parametrize("flat,flattens", FLATTENS)
@pytest.mark.parametrize("form", [llama_rms_norm, torch_rms_norm, scale_last])
def test_add_rms_norm_cast(flat, flattens, form):
    x, r, w = torch.randn(2, 5, H, dtype=BF16), torch.randn(2, 5, H, dtype=BF16), torch.randn(H, dtype=BF16)

    def block(x, r, w):
        summed = x + r
        normed = form(summed, w)
        return flat(normed).to(torch.float32), normed, summed

    removed = 1 + removed_by_rms_norm(form, x, w) + 1 + flattens
    after = assert_fused(block, (x, r, w), "add_rms_norm_cast", graphopt_ops.add_rms_norm_cast.default,
                         removed, added=4 + flattens)
    assert aten._to_copy.default not in after


def test_cast_to_another_dtype_than_float32_fuses_only_the_norm():
    x, r, w = torch.randn(2, 5, H, dtype=BF16), torch.randn(2, 5, H, dtype=BF16), torch.randn(H, dtype=BF16)

    def block(x, r, w):
        summed = x + r
        normed = llama_rms_norm(summed, w)
        return normed.to(torch.float16), normed, summed

    result, _, after = fuse(block, x, r, w)
    assert result.counts == {"add_rms_norm": 1}
    assert aten._to_copy.default in after


# --- end to end ------------------------------------------------------------------------

def test_reference_decoder_fuses_every_norm():
    torch.manual_seed(0)
    model = Decoder(DecoderConfig.tiny(dtype=BF16)).eval()
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    args = decode_inputs(3)
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), model(*args), atol=tolerance(BF16)[0], rtol=tolerance(BF16)[1])
    report = opt.report()
    assert next(p for p in report.passes if p.name == "fuse_norms").counts == {"add_rms_norm": 4, "rms_norm": 1}
    fused = report.graphs[0].fused_ops
    assert (fused["add_rms_norm"], fused["rms_norm"]) == (4, 1)


class QuantizingBlock(torch.nn.Module):
    """A residual add and LlamaRMSNorm whose output is flattened and quantized."""

    def __init__(self):
        super().__init__()
        self.norm = LlamaRMSNorm(H)
        torch.nn.init.normal_(self.norm.weight)

    def forward(self, x, residual):
        summed = x + residual
        return (*dynamic_quant(self.norm(summed).flatten(0, 1)), summed)


def test_add_rms_norm_dynamic_quant_serves_every_batch_size():
    torch.manual_seed(0)
    model = QuantizingBlock().to(BF16).eval()
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    for batch in (3, 5):
        x, r = torch.randn(batch, 4, H, dtype=BF16), torch.randn(batch, 4, H, dtype=BF16)
        with torch.no_grad():
            for got, expected in zip(opt(x, r), model(x, r)):
                torch.testing.assert_close(got, expected, atol=0, rtol=0)
    record = next(p for p in opt.report().passes if p.name == "fuse_norms")
    assert record.counts == {"add_rms_norm_dynamic_quant": 1}


class LayerNormBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(torch.randn(H)), torch.nn.Parameter(torch.randn(H))
        self.proj = torch.nn.Linear(H, H)

    def forward(self, x):
        return self.proj(normalize(x, False, True) * self.weight + self.bias)


def test_layer_norm_fuses_at_level_2():
    if not inductor.inductor_available():
        pytest.skip("level 2 needs a C++ compiler")
    torch.manual_seed(0)
    model, x = LayerNormBlock().eval(), torch.randn(3, 5, H)
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=2, use_cudagraph=False))
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), atol=1e-5, rtol=1e-5)
    assert next(p for p in opt.report().passes if p.name == "fuse_norms").counts == {"layer_norm": 1}
