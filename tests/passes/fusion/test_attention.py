"""fuse_attention: matmul-softmax-matmul attention -> scaled_dot_product_attention, in
hand-written forms, transformers' eager attention and the reference Decoder's, in
float32 and bfloat16, with GQA repeats, at levels 1 and 2."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from support import AtenGraph, aot_graph, decode_inputs, targets
from torch._subclasses.fake_tensor import FakeTensorMode

import graphopt
from graphopt._compat import inductor, patterns
from graphopt.config import tolerance
from graphopt.models import Decoder, DecoderConfig
from graphopt.models.decoder import repeat_kv
from graphopt.passes.fusion import gates
from graphopt.passes.fusion.attention import fuse_attention

aten, prims = torch.ops.aten, torch.ops.prims
transformers = pytest.importorskip("transformers")
from transformers.models.bert import modeling_bert  # noqa: E402
from transformers.models.gpt2 import modeling_gpt2  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
DTYPES = [torch.float32, torch.bfloat16]
B, H, KV, L, D = 2, 4, 2, 8, 16
MATMUL_OPS = [aten.bmm.default, aten._softmax.default]
REPEAT_OPS = [aten.unsqueeze.default, aten.expand.default]


def qkv(dtype, kv_heads=H, seed=0):
    """q as the projections give it (a transposed view), k and v contiguous."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, H, D, generator=gen).to(dtype).transpose(1, 2)
    k, v = (torch.randn(B, kv_heads, L, D, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def additive_mask(dtype):
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return torch.zeros(B, 1, L, L, dtype=dtype).masked_fill(~causal, torch.finfo(dtype).min)


def merge_heads(out):
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


def check(fn, args, left, gone=MATMUL_OPS, level=1):
    """Fuse `fn`'s ATen graph: one SDPA, `left` ops in all, `gone` absent, and the
    same values as eager `fn`. Returns the fused SDPA node.

    The ops left, not the ops removed: the graph before depends on torch (2.13
    traces a no-op dropout as a `clone`, 2.14 as nothing), the fused graph does not."""
    with torch.no_grad():
        expected = fn(*args)
    graph = aot_graph(fn, *args) if level == 1 else AtenGraph(post_grad_graph(fn, args), list(range(len(args))))
    result = fuse_attention(graph.gm)
    graph.gm.graph.lint()
    graph.gm.recompile()

    after = targets(graph)
    assert result.counts == {"scaled_dot_product_attention": 1}
    assert after.count(SDPA) == 1
    for op in gone:
        assert op not in after, op
    assert len(after) == left, after
    actual = graph(*args)
    atol, rtol = tolerance(expected.dtype)
    torch.testing.assert_close(actual[0] if isinstance(actual, (tuple, list)) else actual, expected,
                               atol=atol, rtol=rtol)
    return next(n for n in graph.gm.graph.nodes if n.target is SDPA)


def post_grad_graph(fn, args):
    """`fn` decomposed as Inductor decomposes graphs before its post-grad passes."""
    mode = FakeTensorMode()
    with mode:
        gm = patterns.trace_forward(fn, [mode.from_tensor(a) for a in args], patterns.inductor_decompositions())
    gm.meta["graphopt_level"] = 2
    return gm


def unchanged(fn, *args):
    graph = aot_graph(fn, *args)
    before = targets(graph)
    result = fuse_attention(graph.gm)
    assert not result.changed and result.counts == {}
    assert targets(graph) == before


# --- the forms real code writes -------------------------------------------------

def decoder_attention(q, k, v, mask):
    """The reference Decoder's (and Llama's) attention: repeat_kv, float32 softmax."""
    keys, values = repeat_kv(k, H // KV), repeat_kv(v, H // KV)
    scores = torch.matmul(q, keys.transpose(2, 3)) * D**-0.5 + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return merge_heads(torch.matmul(probs, values))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decoder_form_with_gqa(dtype):
    """k and v reach SDPA unrepeated (enable_gqa): the repeats are gone too."""
    q, k, v = qkv(dtype, KV)
    # Left: SDPA, its getitem, and the transpose, clone and view merging the heads.
    sdpa = check(decoder_attention, (q, k, v, additive_mask(dtype)), 5,
                 MATMUL_OPS + REPEAT_OPS + [aten._to_copy.default])
    assert sdpa.args[1].meta["val"].shape[1] == KV and sdpa.kwargs["scale"] == D**-0.5


def nanogpt(q, k, v, causal):
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(causal[:, :, :L, :L] == 0, float("-inf"))
    return merge_heads(F.softmax(att, dim=-1) @ v)


def divided_where_finfo_min(q, k, v, keep):
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    scores = torch.where(keep, scores, torch.finfo(scores.dtype).min)
    return merge_heads(torch.softmax(scores, dim=-1) @ v)


def prescaled_q_no_mask(q, k, v):
    return merge_heads(torch.matmul(q * D**-0.5, k.transpose(2, 3)).softmax(-1) @ v)


def repeat_interleaved(q, k, v):
    k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    return merge_heads(F.dropout(scores.softmax(-1), p=0.0, training=True) @ v)


def keys_permuted_to_kt(q, projected, v):
    """kᵀ made by one permute of the projection [b, s, h, d], as GPT-2's old
    `split_heads(key, k=True)` wrote it: SDPA gets it permuted back."""
    kt = projected.permute(0, 2, 3, 1)
    return merge_heads(F.softmax(torch.matmul(q, kt) * 0.25, dim=-1) @ v)


def batched_3d(q, k, v):
    return torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.25, dim=-1), v)


def scaled_past_the_max(q, k, v):
    """softmax(q·kᵀ·s) as Inductor's joint-graph pass leaves it on torch 2.11: the
    scale moved past the max, exp((x - max x)·s) / Σ."""
    scores = q @ k.transpose(-2, -1)
    e = ((scores - scores.amax(-1, keepdim=True)) * D**-0.5).exp()
    return merge_heads((e / e.sum(-1, keepdim=True)) @ v)


CAUSAL = torch.ones(1, 1, 16, 16).tril()
KEEP = torch.rand(B, 1, L, L, generator=torch.Generator().manual_seed(1)) > 0.3
KEEP[..., 0] = True  # every query row keeps a key: all-masked rows differ by design


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn,extra,left,gqa", [
    (nanogpt, (CAUSAL,), 12, False),  # masked_fill(-inf) -> a bool mask (SDPA adds where + 2 scalars)
    (divided_where_finfo_min, (KEEP,), 8, False),  # finfo.min -> an additive mask (logical_not, cast, mul)
    (prescaled_q_no_mask, (), 5, False),
    (repeat_interleaved, (), 5, True),
    (scaled_past_the_max, (), 5, False),
], ids=["nanogpt", "where_finfo_min", "prescaled_q", "repeat_interleave", "scaled_past_the_max"])
def test_hand_written_forms(fn, extra, left, gqa, dtype):
    q, k, v = qkv(dtype, KV if gqa else H)
    sdpa = check(fn, (q, k, v, *extra), left)
    assert sdpa.args[1].meta["val"].shape[1] == (KV if gqa else H)


def test_prescaled_q_folds_its_scale_into_sdpa():
    sdpa = check(prescaled_q_no_mask, qkv(torch.float32), 5, MATMUL_OPS + [aten.mul.Tensor])
    assert sdpa.kwargs["scale"] == D**-0.5


@pytest.mark.parametrize("dtype", DTYPES)
def test_keys_permuted_to_kt(dtype):
    q, k, v = qkv(dtype)
    check(keys_permuted_to_kt, (q, k.transpose(1, 2).contiguous(), v), 7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_3d_bmm(dtype):
    """[batch*heads, seq, dim] operands: SDPA takes them unsqueezed to 4-D. One node
    more (three unsqueezes, SDPA, its getitem and a squeeze for a transpose, a mul,
    a softmax and two bmms), but one fused kernel where there were four."""
    q, k, v = (t.reshape(B * H, L, D) for t in qkv(dtype))
    check(batched_3d, (q, k, v), 6)


def flattened_heads(q, k, v):
    return (F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v).view(B, -1)


def test_a_view_that_needs_the_products_layout_gets_a_copy():
    """SDPA's result is laid out [b, l, h, d]: a `view` traced against the
    product's contiguous [b, h, l, d] needs it copied to that layout first."""
    sdpa = check(flattened_heads, qkv(torch.float32), 4)
    copy = next(iter(next(iter(sdpa.users)).users))
    assert copy.target is aten.clone.default and next(iter(copy.users)).target is aten.view.default


def module_stub(groups=1):
    return SimpleNamespace(num_key_value_groups=groups, training=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model,groups", [
    (modeling_llama, H // KV), (modeling_gpt2, 1), (modeling_bert, 1)], ids=["llama", "gpt2", "bert"])
def test_transformers_eager_attention(model, groups, dtype):
    """transformers' own `eager_attention_forward`, with the additive mask its
    mask utilities build; the attention weights it also returns are not used."""
    q, k, v = qkv(dtype, H // groups)
    stub = module_stub(groups)

    def attention(q, k, v, mask):
        out = model.eager_attention_forward(stub, q, k, v, mask, scaling=D**-0.5)[0]
        return out.reshape(B, L, -1)

    # Left: SDPA, its getitem, and the transpose, clone and view merging the heads:
    # Llama's repeat_kv, its float32 softmax's casts and the no-op dropout are gone.
    check(attention, (q, k, v, additive_mask(dtype)), 5, MATMUL_OPS + REPEAT_OPS + [aten._to_copy.default])


@pytest.mark.parametrize("dtype", DTYPES)
def test_level2_graph(dtype):
    """Inductor's post-grad form: softmax as amax/sub/exp/sum/div, casts as
    convert_element_type."""
    q, k, v = qkv(dtype, KV)
    check(decoder_attention, (q, k, v, additive_mask(dtype)), 5,
          [aten.bmm.default, aten.amax.default, aten.exp.default, prims.convert_element_type.default], level=2)


# --- the gate: single-token queries at level 2 on the CPU ------------------------

def decode_qkv(dtype=torch.float32):
    """One query token per sequence against a 2L-token cache, and its additive mask."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, 1, H, D, generator=gen).to(dtype).transpose(1, 2)
    k, v = (torch.randn(B, KV, 2 * L, D, generator=gen).to(dtype) for _ in range(2))
    mask = torch.zeros(B, 1, 1, 2 * L, dtype=dtype)
    mask[..., L + 3:] = torch.finfo(dtype).min  # positions not yet written
    return q, k, v, mask


def test_decode_attention_is_gated_at_level2_on_cpu():
    """Inductor's own code for a single-token query beats the CPU flash kernel
    (gates.sdpa_loses): at level 2 the match is counted as gated and left alone."""
    args = decode_qkv()
    gm = post_grad_graph(decoder_attention, args)
    before = [n.target for n in gm.graph.nodes]
    result = fuse_attention(gm)
    assert not result.changed and result.counts == {"gated": 1}
    assert [n.target for n in gm.graph.nodes] == before


def test_decode_attention_fuses_at_level1():
    """At level 1 the fused kernel replaces ~10 Python-dispatched ops, so it fuses."""
    # Left: SDPA, its getitem, the transpose and view merging the heads (one
    # query row: no clone).
    check(decoder_attention, decode_qkv(), 4, MATMUL_OPS + REPEAT_OPS)


def test_decode_attention_fuses_at_level2_with_the_gates_off(monkeypatch):
    """What benchmarks/fusion_gates.py times against the gated form."""
    monkeypatch.setattr(gates, "ENABLED", False)
    check(decoder_attention, decode_qkv(), 4,
          [aten.bmm.default, aten.amax.default, aten.exp.default, prims.convert_element_type.default], level=2)


def test_the_gate_holds_back_single_token_queries_at_level2_on_cpu_only():
    """A longer query (prefill, encoders), another level or device is not gated."""
    assert not gates.sdpa_loses(2, torch.device("cpu"), L)
    assert gates.sdpa_loses(2, torch.device("cpu"), 1)
    assert not gates.sdpa_loses(2, torch.device("cuda"), 1)
    assert not gates.sdpa_loses(1, torch.device("cpu"), 1)


# --- what must not fuse -------------------------------------------------------

def softmax_over_queries(q, k, v):
    return F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-2) @ v


def multiplied_mask(q, k, v, mask):
    return (F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) * mask) @ v


def scaled_after_the_mask(q, k, v, mask):
    return F.softmax((q @ k.transpose(-2, -1) + mask) * 0.25, dim=-1) @ v


def finite_fill(q, k, v, keep):
    return F.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, -1e9), dim=-1) @ v


def mask_added_before_a_scale_past_the_max(q, k, v, mask):
    """exp((x + mask - max)·s): the scale would reach the mask too, which SDPA's does not."""
    scores = q @ k.transpose(-2, -1) + mask
    e = ((scores - scores.amax(-1, keepdim=True)) * 0.25).exp()
    return (e / e.sum(-1, keepdim=True)) @ v


def weights_returned(q, k, v):
    probs = F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
    return probs @ v, probs


def contiguous_kt(q, kt, v):
    return F.softmax(torch.matmul(q, kt) * 0.25, dim=-1) @ v


def float32_mask_on_bfloat16(q, k, v, mask):
    return F.softmax(q @ k.transpose(-2, -1) * 0.25 + mask, dim=-1, dtype=torch.float32).to(q.dtype) @ v


@pytest.mark.parametrize("fn,extra", [
    (softmax_over_queries, ()),
    (multiplied_mask, (torch.rand(B, 1, L, L),)),
    (scaled_after_the_mask, (additive_mask(torch.float32),)),
    (finite_fill, (KEEP,)),
    (weights_returned, ()),
    (mask_added_before_a_scale_past_the_max, (additive_mask(torch.float32),)),
], ids=["softmax_dim", "multiplied_mask", "scale_after_mask", "fill_-1e9", "weights_returned", "mask_scaled"])
def test_left_alone(fn, extra):
    unchanged(fn, *qkv(torch.float32), *extra)


def test_what_sdpa_would_run_unfused_is_left_alone():
    """A contiguous kᵀ transposed back has a strided last dim: the CPU flash kernel
    refuses it and SDPA would run its math fallback, no fusion."""
    q, k, v = qkv(torch.float32)
    unchanged(contiguous_kt, q, k.transpose(2, 3).contiguous(), v)


def test_mask_of_another_dtype_is_left_alone():
    unchanged(float32_mask_on_bfloat16, *qkv(torch.bfloat16), additive_mask(torch.float32))


# --- end to end ---------------------------------------------------------------

def decoder_report(level):
    """Two decode steps of the tiny reference Decoder at `level`, checked against
    eager's; the report. Without fuse_decode_attention, which would take the same
    attention first (tests/passes/fusion/test_decode_attention.py)."""
    torch.manual_seed(0)
    reference = Decoder(DecoderConfig.tiny()).eval()
    model = Decoder(DecoderConfig.tiny()).eval()
    model.load_state_dict(reference.state_dict())
    config = graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=False,
                                              disabled_passes=["fuse_decode_attention"])
    opt = graphopt.optimize(model, config)
    with torch.inference_mode():
        for step, batch in enumerate((2, 3)):
            inputs = decode_inputs(batch, position=5 + step)
            torch.testing.assert_close(opt(*inputs), reference(*inputs), atol=1e-4, rtol=1e-4)
    return opt.report()


def test_decoder_end_to_end():
    """Every layer of the reference Decoder (KV cache, repeat_kv, additive mask)
    fuses, and its decode steps match eager's."""
    report = decoder_report(level=1)
    assert all(g.fused_ops.get("scaled_dot_product_attention") == 2 for g in report.graphs)


@pytest.mark.skipif(not inductor.inductor_available(), reason="level 2 needs a C++ compiler")
def test_level2_end_to_end():
    class Attention(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return decoder_attention(q, k, v, mask)

    q, k, v = qkv(torch.float32, KV)
    mask = additive_mask(torch.float32)
    opt = graphopt.optimize(Attention(), graphopt.GraphOptimizationConfig(graph_opt_level=2, use_cudagraph=False))
    with torch.inference_mode():
        torch.testing.assert_close(opt(q, k, v, mask), decoder_attention(q, k, v, mask), atol=1e-4, rtol=1e-4)
    assert opt.report().graphs[0].fused_ops == {"scaled_dot_product_attention": 1}


@pytest.mark.skipif(not inductor.inductor_available(), reason="level 2 needs a C++ compiler")
def test_level2_decoder_leaves_decode_attention_to_inductor():
    """The reference decoder's decode step at level 2 on the CPU: every layer's
    attention is gated, none becomes SDPA, and the steps match eager's."""
    report = decoder_report(level=2)
    records = [p for p in report.passes if p.name == "fuse_attention"]
    assert records and all(p.counts == {"gated": 2} for p in records)
    assert all("scaled_dot_product_attention" not in g.fused_ops for g in report.graphs)
