"""fuse_rotary: `x * cos + rotate_half(x) * sin` -> graphopt::rotary_embedding, in
transformers' Llama form, the reference Decoder's and the swapped sum, float32 and
bfloat16, prefill and decode shapes; GPT-J's interleaved pairs; and the op against
its definition. The other spellings: tests/passes/test_canonical_rotary.py."""

import pytest
import torch
from support import aot_graph, targets

import graphopt
from graphopt.config import tolerance
from graphopt.models import decoder
from graphopt.passes.fusion.rotary import fuse_rotary

aten = torch.ops.aten
transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

ROTARY = torch.ops.graphopt.rotary_embedding.default
GONE = [aten.slice.Tensor, aten.neg.default, aten.cat.default, aten.add.Tensor]
DTYPES = [torch.float32, torch.bfloat16]
B, H, KV, D = 2, 4, 2, 16


def inputs(dtype, seq=8, transposed=True, seed=0):
    """q and k as the projections give them ([b, s, h, d] viewed as [b, h, s, d]),
    cos and sin per position ([b, s, d], unsqueezed over heads by the model)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, seq, heads, D, generator=gen).to(dtype) for heads in (H, KV))
    if transposed:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    else:
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    angles = torch.rand(B, seq, D // 2, generator=gen).repeat(1, 1, 2) * 6
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def check(fn, args, count, removed):
    """Fuse `fn`'s ATen graph: `count` rotary ops, `removed` nodes fewer, the
    decomposed ops gone, and the same values as eager `fn`."""
    with torch.no_grad():
        expected = fn(*args)
    graph = aot_graph(fn, *args)
    before = len(targets(graph))

    result = fuse_rotary(graph.gm)
    graph.gm.graph.lint()
    graph.gm.recompile()

    after = targets(graph)
    assert result.counts == {"rotary_embedding": count}
    assert after.count(ROTARY) == count
    for op in GONE:
        assert op not in after, op
    assert len(after) == before - removed
    for actual, wanted in zip(graph(*args), expected):
        atol, rtol = tolerance(wanted.dtype)
        torch.testing.assert_close(actual, wanted, atol=atol, rtol=rtol)


def unchanged(fn, *args, level=1):
    graph = aot_graph(fn, *args)
    graph.gm.meta["graphopt_level"] = level
    before = targets(graph)
    result = fuse_rotary(graph.gm)
    assert not result.changed and result.counts == {}
    assert targets(graph) == before


def llama(q, k, cos, sin):
    return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)


def reference_decoder(q, k, cos, sin):
    return decoder.apply_rotary_pos_emb(q, k, cos, sin)


def swapped_sum(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return decoder.rotate_half(q) * sin + q * cos, decoder.rotate_half(k) * sin + k * cos


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq", [8, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("fn", [llama, reference_decoder])
def test_q_and_k_each_become_one_op(fn, seq, dtype):
    """7 ops each (2 slices, neg, cat, 2 muls, add) -> 1; cos/sin stay unsqueezed, shared."""
    check(fn, inputs(dtype, seq), 2, 12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swapped_sum(dtype):
    check(swapped_sum, inputs(dtype, transposed=False), 2, 12)


def test_swapped_sum_of_a_strided_x_is_left_alone():
    """Its sum takes the layout of rotate_half(x) * sin (contiguous), the op that of
    x (transposed): views traced after the sum would not fit."""
    unchanged(swapped_sum, *inputs(torch.float32))


def test_float32_cos_sin_with_bfloat16_x():
    """Type promotion as eager's: the result is float32."""
    q, k, cos, sin = inputs(torch.bfloat16)
    check(llama, (q, k, cos.float(), sin.float()), 2, 12)


def flipped_rotation(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], -x[..., :half]), dim=-1) * sin


def test_what_is_not_rotate_half_is_left_alone():
    q, _, cos, sin = inputs(torch.float32)
    unchanged(flipped_rotation, q, cos.unsqueeze(1), sin.unsqueeze(1))


def test_odd_head_dim_is_left_alone():
    """rotate_half of an odd dim concatenates unequal halves: not a rotation."""
    x, cos, sin = torch.randn(2, 4, 8, 15), torch.randn(2, 1, 8, 15), torch.randn(2, 1, 8, 15)
    unchanged(decoder.apply_rotary_pos_emb, x, x.clone(), cos[:, 0], sin[:, 0])


def test_cos_wider_than_x_is_left_alone():
    """The sum broadcasts x up to cos's shape: the op's result would be x's shape."""
    x, cos, sin = torch.randn(2, 1, 8, 16), torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    unchanged(lambda x, cos, sin: x * cos + decoder.rotate_half(x) * sin, x, cos, sin)


def test_level2_is_left_to_inductor():
    unchanged(llama, *inputs(torch.float32), level=2)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [True, False], ids=["strided", "contiguous"])
def test_op_matches_its_definition(transposed, dtype, interleaved):
    q, _, cos, sin = inputs(dtype, transposed=transposed)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    expected = q * cos + (rotate_every_two(q) if interleaved else decoder.rotate_half(q)) * sin
    actual = torch.ops.graphopt.rotary_embedding(q, cos, sin, interleaved)
    assert actual.dtype == expected.dtype and actual.stride() == expected.stride()
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    torch.library.opcheck(torch.ops.graphopt.rotary_embedding, (q, cos, sin, interleaved),
                          test_utils=("test_schema", "test_faketensor"))


def test_llama_end_to_end():
    """A tiny transformers Llama with eager attention: q and k of its layer each
    become one rotary op (and its attention one SDPA), with eager's logits."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=H, num_key_value_heads=KV,
        intermediate_size=128, max_position_embeddings=64, attn_implementation="eager")).eval()
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(opt(input_ids=ids, use_cache=False).logits,
                                   model(input_ids=ids, use_cache=False).logits, atol=1e-4, rtol=1e-4)
    fused = opt.report().graphs[0].fused_ops
    assert fused["rotary_embedding"] == 2 and fused["scaled_dot_product_attention"] == 1


def test_gptj_end_to_end():
    """transformers' GPT-J pairs neighbouring channels (`rotate_every_two`) over the first
    `rotary_dim` of each head's: q and k each become one interleaved rotary op."""
    torch.manual_seed(0)
    model = transformers.GPTJForCausalLM(transformers.GPTJConfig(
        vocab_size=128, n_embd=64, n_layer=1, n_head=H, rotary_dim=8, n_positions=64, bos_token_id=0,
        eos_token_id=0)).eval()
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(opt(input_ids=ids, use_cache=False).logits,
                                   model(input_ids=ids, use_cache=False).logits, atol=1e-4, rtol=1e-4)
    assert opt.report().graphs[0].fused_ops["rotary_embedding"] == 2
