"""canonicalize_attention and canonicalize_norms: the spellings they rewrite come out
in the form the fusions match, with eager's values; math that is not the same stays
as it is (or, rewritten, stays unfused)."""

import math

import pytest
import torch
from support import AtenGraph, aot_graph, targets
from torch._subclasses.fake_tensor import FakeTensorMode

from graphopt._compat import patterns
from graphopt.config import tolerance
from graphopt.passes.canonical.attention import canonicalize_attention
from graphopt.passes.canonical.norm import canonicalize_norms
from graphopt.passes.cleanup import cse
from graphopt.passes.fusion.attention import fuse_attention
from graphopt.passes.fusion.norm import fuse_norms

aten, ops = torch.ops.aten, torch.ops.graphopt
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
B, H, KV, T, S, D = 2, 4, 2, 3, 8, 16
G = H // KV


def qkv(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=gen), torch.randn(B, KV, S, D, generator=gen),
            torch.randn(B, KV, S, D, generator=gen))


def allowed():
    """[B, T, S]: each query sees a prefix of the keys, of another length per row."""
    return torch.arange(S) <= (torch.arange(T) + 4 + torch.arange(B)[:, None])[:, :, None]


def rewrite(fn, args, passes, level=1):
    """`fn`'s ATen graph (level 1: AOTAutograd's; level 2: as Inductor decomposes it)
    after CSE and `passes`: (graph, each pass's counts). Outputs equal eager's."""
    if level == 1:
        graph = aot_graph(fn, *args)
    else:
        mode = FakeTensorMode()
        with mode:
            gm = patterns.trace_forward(fn, [mode.from_tensor(a) for a in args], patterns.inductor_decompositions())
        gm.meta["graphopt_level"] = 2
        graph = AtenGraph(gm, list(range(len(args))))
    cse(graph.gm)
    counts = [p(graph.gm).counts for p in passes]
    graph.gm.graph.lint()
    graph.gm.recompile()
    with torch.no_grad():
        expected, actual = fn(*args), graph(*args)
    atol, rtol = tolerance(expected.dtype)
    torch.testing.assert_close(actual[0] if isinstance(actual, (tuple, list)) else actual, expected,
                               atol=atol, rtol=rtol)
    return graph, counts


def gqa_sdpa(graph):
    """The one SDPA of the graph, which reads the kv heads unrepeated."""
    sdpa = [n for n in graph.gm.graph.nodes if n.target is SDPA]
    assert len(sdpa) == 1, targets(graph)
    assert sdpa[0].args[1].meta["val"].shape[1] == KV
    return sdpa[0]


# --- attention ------------------------------------------------------------------------

def tiled(q, k, v, keep):
    """`repeat`: query head x reads kv head x % KV."""
    scores = q @ k.repeat(1, G, 1, 1).transpose(-2, -1) / math.sqrt(D)
    probs = torch.softmax(scores.masked_fill(~keep[:, None], float("-inf")), dim=-1)
    return probs @ v.repeat(1, G, 1, 1)


def interleaved(q, k, v, keep):
    scores = q @ k.repeat_interleave(G, dim=1).transpose(-2, -1) / math.sqrt(D)
    probs = torch.softmax(scores.masked_fill(~keep[:, None], float("-inf")), dim=-1)
    return probs @ v.repeat_interleave(G, dim=1)


def test_kv_heads_tiled_by_repeat_read_the_kv_head_they_read_in_eager():
    args = (*qkv(), allowed())
    assert not torch.allclose(tiled(*args), interleaved(*args), atol=1e-3)  # the mapping matters
    graph, counts = rewrite(tiled, args, [canonicalize_attention, fuse_attention])
    assert counts == [{"attention": 1}, {"scaled_dot_product_attention": 1}]
    gqa_sdpa(graph)


def baddbmm_3d(q, k, v, keep):
    """Heads flattened into the batch: baddbmm over `repeat`ed keys, a finfo.min bias."""
    bias = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    bias = bias[:, None].expand(B, H, T, S).reshape(B * H, T, S)
    keys = k.repeat(1, G, 1, 1).reshape(B * H, S, D)
    scores = torch.baddbmm(bias, q.reshape(B * H, T, D), keys.transpose(1, 2), alpha=D**-0.5)
    out = torch.bmm(torch.softmax(scores, dim=-1), v.repeat(1, G, 1, 1).reshape(B * H, S, D))
    return out.view(B, H, T, D)


@pytest.mark.parametrize("level", [1, 2])
def test_3d_baddbmm_over_flattened_heads(level):
    graph, counts = rewrite(baddbmm_3d, (*qkv(), allowed()), [canonicalize_attention, fuse_attention], level)
    assert counts == [{"attention": 1}, {"scaled_dot_product_attention": 1}]
    assert aten.baddbmm.default not in targets(graph) and aten.repeat.default not in targets(graph)
    gqa_sdpa(graph)


def grouped_5d(q, k, v, keep, split=(KV, G), at=2):
    """Queries split into [b, KV, G] (or [b, G, KV] with the keys unsqueezed at 1)
    against keys broadcast along the group: no repeat at all."""
    grouped = q.reshape(B, *split, T, D)
    scores = torch.matmul(grouped, k.unsqueeze(at).transpose(-2, -1)) * D**-0.5
    scores = torch.where(keep[:, None, None], scores, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.unsqueeze(at)).reshape(B, H, T, D)


@pytest.mark.parametrize("split, at", [((KV, G), 2), ((G, KV), 1)])
def test_5d_grouped_broadcast(split, at):
    def fn(q, k, v, keep):
        return grouped_5d(q, k, v, keep, split, at)

    graph, counts = rewrite(fn, (*qkv(), allowed()), [canonicalize_attention, fuse_attention])
    assert counts == [{"attention": 1}, {"scaled_dot_product_attention": 1}]
    gqa_sdpa(graph)


def repeated_before_the_heads_move(q, k, v, keep, tile=False):
    """Cache rows [b, s, KV, d] repeated along dim 2, then transposed to [b, h, s, d]."""
    rows = (k.transpose(1, 2), v.transpose(1, 2))
    keys, values = (r.repeat(1, 1, G, 1) if tile else r.repeat_interleave(G, dim=2) for r in rows)
    scores = q @ keys.transpose(1, 2).transpose(-2, -1) / math.sqrt(D)
    probs = torch.softmax(scores.masked_fill(~keep[:, None], float("-inf")), dim=-1)
    return probs @ values.transpose(1, 2)


@pytest.mark.parametrize("tile", [False, True])
def test_kv_heads_repeated_before_they_move_to_dim_1(tile):
    def fn(q, k, v, keep):
        return repeated_before_the_heads_move(q, k, v, keep, tile)

    graph, counts = rewrite(fn, (*qkv(), allowed()), [canonicalize_attention, fuse_attention])
    assert counts == [{"attention": 1}, {"scaled_dot_product_attention": 1}]
    gqa_sdpa(graph)


def test_repeat_kv_form_is_left_as_it_is():
    graph = aot_graph(interleaved, *qkv(), allowed())
    before = targets(graph)
    assert canonicalize_attention(graph.gm).counts == {}
    assert targets(graph) == before


def keys_tiled_values_repeated(q, k, v, keep):
    """Not GQA: the keys' head mapping differs from the values'."""
    scores = q @ k.repeat(1, G, 1, 1).transpose(-2, -1) / math.sqrt(D)
    probs = torch.softmax(scores.masked_fill(~keep[:, None], float("-inf")), dim=-1)
    return probs @ v.repeat_interleave(G, dim=1)


def weights_returned(q, k, v, keep):
    probs = torch.softmax(q.reshape(B, KV, G, T, D) @ k[:, :, None].transpose(-2, -1), dim=-1)
    return (probs @ v[:, :, None]).reshape(B, H, T, D), probs


def test_mixed_head_mappings_and_returned_weights_are_not_rewritten():
    for fn in (keys_tiled_values_repeated, weights_returned):
        graph = aot_graph(fn, *qkv(), allowed())
        before = targets(graph)
        assert canonicalize_attention(graph.gm).counts == {}, fn.__name__
        assert targets(graph) == before


def other_fill(q, k, v, keep):
    scores = torch.matmul(q.reshape(B, KV, G, T, D), k[:, :, None].transpose(-2, -1)) * D**-0.5
    scores = torch.where(keep[:, None, None], scores, -1e4)
    return torch.matmul(torch.softmax(scores, dim=-1), v[:, :, None]).reshape(B, H, T, D)


def test_a_fill_sdpa_cannot_reproduce_is_rewritten_but_not_fused():
    graph, counts = rewrite(other_fill, (*qkv(), allowed()), [canonicalize_attention, fuse_attention])
    assert counts == [{"attention": 1}, {}]
    assert SDPA not in targets(graph)


# --- RMSNorm ----------------------------------------------------------------------------

X = torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(1))
W = torch.rand(64, generator=torch.Generator().manual_seed(2)) + 0.5


def vector_norm_form(x, w):
    squares = torch.linalg.vector_norm(x, dim=-1, keepdim=True).pow(2) / x.shape[-1]
    return w * (x * torch.rsqrt(squares + 1e-6))


def tensor_norm_form(x, w):
    return x * torch.rsqrt(x.norm(dim=-1, keepdim=True) ** 2 * (1 / x.shape[-1]) + 1e-6) * w


def divided_by_root(x, w):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


@pytest.mark.parametrize("fn, rewrote", [(vector_norm_form, "mean_of_squares"), (tensor_norm_form, "mean_of_squares"),
                                         (divided_by_root, "rsqrt")])
def test_rms_norm_spellings_fuse(fn, rewrote):
    graph, counts = rewrite(fn, (X, W), [canonicalize_norms, fuse_norms])
    assert counts[0] == {rewrote: 1} and counts[1] == {"rms_norm": 1}
    left = targets(graph)
    assert left.count(ops.rms_norm.default) == 1
    assert not {aten.linalg_vector_norm.default, aten.sqrt.default, aten.div.Tensor} & set(left), left


def eps_outside_the_root(x, w):  # another norm: x / (rms + eps), not x / sqrt(ms + eps)
    return w * x / (torch.linalg.vector_norm(x, dim=-1, keepdim=True) / x.shape[-1] ** 0.5 + 1e-6)


def wrong_divisor(x, w):
    squares = torch.linalg.vector_norm(x, dim=-1, keepdim=True).pow(2) / (x.shape[-1] + 1)
    return w * (x * torch.rsqrt(squares + 1e-6))


def root_of_abs_mean(x, w):
    return x / torch.sqrt(x.abs().mean(-1, keepdim=True) + 1e-6) * w


@pytest.mark.parametrize("fn, rewritten", [(eps_outside_the_root, {}), (wrong_divisor, {}),
                                           (root_of_abs_mean, {"rsqrt": 1})])
def test_other_norms_stay_unfused(fn, rewritten):
    graph, counts = rewrite(fn, (X, W), [canonicalize_norms, fuse_norms])
    assert counts == [rewritten, {}]
    assert ops.rms_norm.default not in targets(graph)
