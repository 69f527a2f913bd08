"""fuse_decode_attention: the reference decoder's attention over its slot cache and
transformers' attention over a StaticCache (eager and SDPA) become
graphopt::decode_attention at levels 1 and 2, with eager's outputs, also replayed in
host graphs across changing lengths; masks it cannot prove are `key <= position`
are left alone."""

import pytest
import torch
import torch.nn.functional as F
from support import aot_graph, targets, unexpected_fallbacks

import graphopt
from graphopt import _compat
from graphopt._compat import inductor
from graphopt.config import tolerance
from graphopt.models import Decoder, DecoderConfig
from graphopt.models.decoder import repeat_kv
from graphopt.passes.fusion.decode_attention import fuse_decode_attention

transformers = pytest.importorskip("transformers")

OP = torch.ops.graphopt.decode_attention.default
LEVEL_2 = pytest.mark.skipif(not inductor.inductor_available(), reason="level 2 needs a C++ compiler")
CONFIG = DecoderConfig.tiny()  # 2 layers, 4 heads over 2 kv heads, 128 positions, scratch slot 16
# (batch, positions, slots) per step: length 1, lengths that differ per row, the full
# cache, a padded batch (3 rows at capture size 4, the padded row on the scratch slot).
STEPS = [(2, [0, 0], [0, 1]), (2, [1, 1], [0, 1]), (3, [2, 0, 9], [0, 1, 2]), (1, [127], [3]),
         (4, [3, 1, 10, 5], [0, 1, 2, 4]), (3, [126, 4, 11], [3, 0, 2])]


def decoder_twins():
    torch.manual_seed(0)
    reference, model = Decoder(CONFIG).eval(), Decoder(CONFIG).eval()
    model.load_state_dict(reference.state_dict())
    return reference, model


def run_steps(opt, reference, dtype=torch.float32, shift=0):
    """STEPS through `opt` and eager, positions moved on by `shift` (kept in the cache)."""
    atol, rtol = tolerance(dtype)
    with torch.inference_mode():
        for batch, positions, slots in STEPS:
            ids = torch.randint(0, CONFIG.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
            positions = torch.tensor(positions).add(shift).clamp(max=CONFIG.max_seq_len - 1)
            inputs = (ids, positions, torch.tensor(slots))
            torch.testing.assert_close(opt(*[x.clone() for x in inputs]), reference(*inputs), atol=atol, rtol=rtol)


@pytest.mark.parametrize("level", [1, pytest.param(2, marks=LEVEL_2)])
def test_reference_decoder(level):
    reference, model = decoder_twins()
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=False))
    run_steps(opt, reference)
    report = opt.report()
    assert report.graphs and all(g.fused_ops.get("decode_attention") == CONFIG.num_layers for g in report.graphs)
    assert all("scaled_dot_product_attention" not in g.fused_ops for g in report.graphs)
    assert not unexpected_fallbacks(report)


def test_reference_decoder_in_host_graphs_across_lengths():
    """One captured graph per capture size serves every length: the op reads the
    positions from the static input buffer at each replay."""
    reference, model = decoder_twins()
    config = graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=True, cudagraph_capture_sizes=[1, 2, 4],
                                              cudagraph_num_of_warmups=1)
    opt = graphopt.optimize(model, config, pad_values={"slots": model.scratch_slot})
    for _ in range(2):  # warm-up and capture at every size
        run_steps(opt, reference)

    def counts():
        report = opt.report()
        return len(report.captures), sum(p.replays for pieces in report.pieces for p in pieces)

    captures, replays = counts()
    run_steps(opt, reference, shift=3)  # every length changes
    assert counts() == (captures, replays + len(STEPS))
    report = opt.report()
    assert all(g.fused_ops.get("decode_attention") == CONFIG.num_layers for g in report.graphs)
    assert not unexpected_fallbacks(report)


def test_bfloat16_decoder():
    torch.manual_seed(0)
    reference = Decoder(DecoderConfig.tiny(dtype=torch.bfloat16)).eval()
    model = Decoder(DecoderConfig.tiny(dtype=torch.bfloat16)).eval()
    model.load_state_dict(reference.state_dict())
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    run_steps(opt, reference, torch.bfloat16)
    assert opt.report().graphs[0].fused_ops.get("decode_attention") == CONFIG.num_layers


# --- transformers' attention over a StaticCache -----------------------------------

def llama(attention):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=64, attn_implementation=attention)).eval()


@pytest.mark.parametrize("attention, level", [
    ("eager", 1), ("sdpa", 1), pytest.param("sdpa", 2, marks=LEVEL_2),
    pytest.param("eager", 2, marks=[LEVEL_2, pytest.mark.slow])])
def test_llama_static_cache(attention, level):
    """Decode steps after a prefill: the causal mask from the cache's position, keys
    and values the StaticCache tensors themselves (batch-indexed)."""
    torch.manual_seed(0)
    reference, model = llama(attention), llama(attention)
    model.load_state_dict(reference.state_dict())
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=False))
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    caches = [transformers.StaticCache(config=m.config, max_cache_len=16) for m in (reference, model)]
    with torch.inference_mode():
        for m, c in zip((reference, model), caches):
            m(ids[:, :5], cache=c, use_cache=True)  # the prefill, eager
        for step in range(3):
            token = ids[:, 5:6] if step == 0 else torch.full((2, 1), step)
            expected = reference(token, cache=caches[0], use_cache=True).logits
            torch.testing.assert_close(opt(token, cache=caches[1], use_cache=True).logits, expected,
                                       atol=1e-4, rtol=1e-4)
    fused = [g.fused_ops for g in opt.report().graphs]
    assert fused and all(f.get("decode_attention") == 2 and "scaled_dot_product_attention" not in f for f in fused)


# --- what is left alone ------------------------------------------------------------

def attention_over(keys_of, allowed_of, softmax=lambda scores: F.softmax(scores, dim=-1)):
    """The decoder's attention over a slot cache, its mask `allowed_of(key index, positions)`."""

    def attention(q, k_cache, v_cache, positions, slots):
        keys, values = (repeat_kv(keys_of(c, slots), 2) for c in (k_cache, v_cache))
        allowed = allowed_of(torch.arange(k_cache.shape[1]), positions[:, None, None])
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
        scores = torch.matmul(q, keys.transpose(2, 3)) * 0.25 + mask
        return torch.matmul(softmax(scores), values)

    return attention


def gathered(cache, slots):
    return cache[slots].transpose(1, 2)


def attention_args():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 16, generator=gen)
    k_cache, v_cache = (torch.randn(5, 32, 2, 16, generator=gen) for _ in range(2))
    return q, k_cache, v_cache, torch.tensor([0, 7, 31]), torch.tensor([4, 0, 2])


@pytest.mark.parametrize("allowed_of, reads", [
    (lambda key, pos: key <= pos, "positions"),
    (lambda key, pos: pos >= key, "positions"),
    (lambda key, pos: ~(key > pos), "positions"),
    (lambda key, pos: key < pos, "mask"),  # one key fewer: no length says it, the mask does
    (lambda key, pos: (key <= pos) & (key > pos - 4), "mask"),  # a sliding window
    (lambda key, pos: key <= pos.flip(0), "positions"),  # any integer tensor of positions
], ids=["le", "ge", "not-gt", "lt", "window", "flipped"])
def test_masks(allowed_of, reads):
    """A mask that is `key <= position` becomes the op's positions; any other boolean
    mask the same for every head is passed to it as `allowed`."""
    fn, args = attention_over(gathered, allowed_of), attention_args()
    graph = aot_graph(fn, *args)
    result = fuse_decode_attention(graph.gm)
    graph.gm.recompile()
    calls = [n for n in graph.gm.graph.nodes if n.target is OP]
    assert len(calls) == 1 and result.counts == {"decode_attention": 1}
    positions, allowed = calls[0].args[4], calls[0].args[6]
    assert (positions is not None, allowed is not None) == (reads == "positions", reads == "mask")
    assert aten_index_count(graph) == 0  # read in place: no gather left
    torch.testing.assert_close(graph(*args)[0], fn(*args), atol=1e-4, rtol=1e-4)


def online_softmax(scores):
    """A softmax as Inductor's post-grad pass leaves it on CUDA: max and sum from one
    `prims.prepare_softmax_online` (on the CPU it keeps amax, sub, exp, sum, div)."""
    top, total = _compat.patterns.online_softmax_op()(scores, -1)
    return (scores - top).exp() / total


def test_the_softmax_inductor_leaves_on_cuda_is_fused():
    """Level 2 on CUDA: graphopt's passes run after Inductor's, which folded the
    softmax's max and sum into one op; the attention still becomes the op."""
    fn, args = attention_over(gathered, lambda key, pos: key <= pos, online_softmax), attention_args()
    graph = aot_graph(fn, *args)
    assert patterns_online_softmax_count(graph) == 1
    assert fuse_decode_attention(graph.gm).counts == {"decode_attention": 1}
    graph.gm.recompile()
    assert patterns_online_softmax_count(graph) == 0 and aten_index_count(graph) == 0
    expected = attention_over(gathered, lambda key, pos: key <= pos)(*args)
    torch.testing.assert_close(graph(*args)[0], expected, atol=1e-4, rtol=1e-4)


def patterns_online_softmax_count(graph):
    return targets(graph).count(_compat.patterns.online_softmax_op())


def test_a_mask_passed_in_is_read_as_allowed():
    """transformers' generate() builds its mask outside the model: a [b, 1, t, s]
    boolean input made additive with `where(mask, 0, finfo.min)`; GQA through SDPA."""

    def fn(q, keys, values, mask):
        additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
        return F.scaled_dot_product_attention(q, repeat_kv(keys, 2), repeat_kv(values, 2), attn_mask=additive,
                                              scale=0.25)

    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(3, 1, 1, 32, generator=gen) > 0.4
    mask[:, 0, 0, 0] = True  # every row keeps a key: a fully masked row is eager's NaN or a uniform average
    args = (torch.randn(3, 4, 1, 16, generator=gen), torch.randn(3, 2, 32, 16, generator=gen),
            torch.randn(3, 2, 32, 16, generator=gen), mask)
    graph = aot_graph(fn, *args)
    assert fuse_decode_attention(graph.gm).counts == {"decode_attention": 1}
    graph.gm.recompile()
    torch.testing.assert_close(graph(*args)[0], fn(*args), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mask_of, shape", [
    (lambda allowed: torch.where(allowed, 0.0, -1.0), (3, 1, 1, 32)),  # not a mask: a bias
    (lambda allowed: torch.where(allowed, 0.0, float("-inf")), (3, 4, 1, 32)),  # a mask per head
], ids=["bias", "per-head"])
def test_float_masks_that_are_not_a_boolean_mask_are_left_alone(mask_of, shape):
    def fn(q, keys, values, allowed):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask_of(allowed))

    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(3, 4, 1, 16, generator=gen), torch.randn(3, 4, 32, 16, generator=gen),
            torch.randn(3, 4, 32, 16, generator=gen), torch.rand(*shape, generator=gen) > 0.4)
    graph = aot_graph(fn, *args)
    assert not fuse_decode_attention(graph.gm).changed


def aten_index_count(graph):
    return targets(graph).count(torch.ops.aten.index.Tensor)


def test_positions_that_vary_across_heads_are_left_alone():
    def fn(q, k_cache, v_cache, positions, slots):
        keys, values = (repeat_kv(gathered(c, slots), 2) for c in (k_cache, v_cache))
        per_head = positions[:, None, None, None] + torch.arange(4)[None, :, None, None]  # [b, h, 1, 1]
        mask = torch.zeros(3, 4, 1, 32).masked_fill(torch.arange(32) > per_head, float("-inf"))
        return torch.matmul(F.softmax(torch.matmul(q, keys.transpose(2, 3)) * 0.25 + mask, dim=-1), values)

    graph = aot_graph(fn, *attention_args())
    assert not fuse_decode_attention(graph.gm).changed


def test_prefill_is_gated():
    """Queries of several tokens are left to fuse_attention (SDPA reads the keys once
    for all of them) and counted."""

    def fn(q, k, v, positions):
        allowed = torch.arange(16) <= positions[None, :, None]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[:, None]
        return torch.matmul(F.softmax(torch.matmul(q, k.transpose(2, 3)) + mask, dim=-1), v)

    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 4, 3, 8, generator=gen), torch.randn(2, 4, 16, 8, generator=gen),
            torch.randn(2, 4, 16, 8, generator=gen), torch.tensor([5, 6, 7]))
    graph = aot_graph(fn, *args)
    result = fuse_decode_attention(graph.gm)
    assert not result.changed and result.counts == {"gated": 1}
