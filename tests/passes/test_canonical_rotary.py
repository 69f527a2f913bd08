"""canonicalize_rotary: the spellings of a rotary embedding come out in the forms
fuse_rotary matches, so q and k each become one `graphopt::rotary_embedding`, with
eager's values; what is not a rotation stays as it is."""

import pytest
import torch
from support import aot_graph, targets
from torch._subclasses.fake_tensor import FakeTensorMode

from graphopt._compat import patterns
from graphopt.config import tolerance
from graphopt.passes.canonical.rotary import canonicalize_rotary
from graphopt.passes.cleanup import cse
from graphopt.passes.fusion.rotary import fuse_rotary
from graphopt.passes.redundant import remove_redundant

aten = torch.ops.aten
ROTARY = torch.ops.graphopt.rotary_embedding.default
LEFT = {aten.neg.default, aten.cat.default, aten.stack.default, aten.split.Tensor, aten.mul.Tensor,
        aten.view_as_complex.default, aten.view_as_real.default, aten.split_with_sizes.default}
B, S, H, KV, D = 2, 5, 4, 2, 16


def angles(seed=0):
    """[S, D / 2] angles per position and pair."""
    return torch.rand(S, D // 2, generator=torch.Generator().manual_seed(seed)) * 6


def qk(heads_first=True, dtype=torch.float32, seed=1):
    """q and k as projections give them, [b, s, h, d], viewed as [b, h, s, d] when `heads_first`."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, S, n, D, generator=gen).to(dtype) for n in (H, KV))
    return (q.transpose(1, 2), k.transpose(1, 2)) if heads_first else (q, k)


def halves_table(dtype=torch.float32):
    """cos, sin [b, s, d], each angle repeated over the halves (transformers')."""
    emb = torch.cat((angles(), angles()), -1).expand(B, S, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def pairs_table():
    """cos, sin [s, d], each angle repeated over its pair of neighbours (GPT-J's)."""
    emb = angles().repeat_interleave(2, -1)
    return emb.cos(), emb.sin()


def by_chunk(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def by_split(x):
    x1, x2 = torch.split(x, x.shape[-1] // 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def by_negative_slices(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., -half:], x[..., :-half]), dim=-1)


def chunk_cos_first(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return cos * q + by_chunk(q) * sin, cos * k + by_chunk(k) * sin


def split_sin_first(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + sin * by_split(q), k * cos + sin * by_split(k)


def slices_all_flipped(q, k, cos, sin):
    """Every operand order flipped, the sum too; the halves by negative bounds; q, k
    [b, s, h, d] (a strided x's flipped sum would have another layout than the op's)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return sin * by_negative_slices(q) + cos * q, sin * by_negative_slices(k) + cos * k


def heads_last(q, k, cos, sin):
    """q, k [b, s, h, d], cos/sin unsqueezed at dim 2."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return cos * q + by_chunk(q) * sin, cos * k + by_chunk(k) * sin


def rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def gptj(q, k, cos, sin):
    """GPT-J: neighbouring channels paired; cos/sin [s, d] broadcast from the left."""
    return q * cos + rotate_every_two(q) * sin, k * cos + rotate_every_two(k) * sin


def gptj_flipped(q, k, cos, sin):
    return sin * rotate_every_two(q) + cos * q, sin * rotate_every_two(k) + cos * k


def meta(q, k, freqs_cis):
    """Meta's Llama: pairs as complex numbers, turned by a complex product. q, k [b, s, h, d]."""
    def turn(x):
        paired = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(paired * freqs_cis[None, :, None]).flatten(3).type_as(x)

    return turn(q), turn(k)


def meta_rows(q, k, freqs_cis):
    """Meta's form read as rows [b * s * h, d] (as a cache write reads it): cleanup merges
    the flatten after the product with this view, and the projection's view before it."""
    q, k = (x.reshape(B, S, -1).reshape(*x.shape) for x in (q, k))
    return tuple(x.reshape(-1, D) for x in meta(q, k, freqs_cis))


def meta_gathered(q, k, freqs_cis, positions):
    """Meta's form with each row's angles gathered from the whole table, as a decoder
    with a KV cache reads them: `freqs_cis[positions][:, :, None]`."""
    freqs = freqs_cis[positions][:, :, None]

    def turn(x):
        paired = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(paired * freqs).flatten(3).type_as(x)

    return turn(q), turn(k)


def cases():
    """The real spellings, rewritten (or, GPT-J's, matched as they are) at level 1."""
    cos, sin = halves_table()
    pcos, psin = pairs_table()
    return {"chunk, cos first": (chunk_cos_first, (*qk(), cos, sin)),
            "split, sin first": (split_sin_first, (*qk(), cos, sin)),
            "slices, all flipped": (slices_all_flipped, (*qk(heads_first=False), cos, sin)),
            "heads last": (heads_last, (*qk(heads_first=False), cos, sin)),
            "gptj": (gptj, (*qk(), pcos, psin)),
            "gptj, flipped": (gptj_flipped, (*qk(heads_first=False), pcos[:, None], psin[:, None]))}


def complex_cases(dtype=torch.float32):
    """Meta's complex products, rewritten at level 2."""
    freqs_cis = torch.polar(torch.ones(S, D // 2), angles())
    positions = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    table = torch.polar(torch.ones(2 * S, D // 2), torch.rand(2 * S, D // 2) * 6)
    return {"meta complex": (meta, (*qk(heads_first=False, dtype=dtype), freqs_cis)),
            "meta complex, views merged": (meta_rows, (*qk(heads_first=False, dtype=dtype), freqs_cis)),
            "meta complex, rows gathered": (meta_gathered, (*qk(heads_first=False, dtype=dtype), table, positions))}


def rewrite(fn, args):
    """`fn`'s ATen graph after CSE, remove_redundant, canonicalize_rotary and fuse_rotary: the graph and
    the two passes' counts. Outputs equal eager's."""
    graph = aot_graph(fn, *args)
    cse(graph.gm)
    remove_redundant(graph.gm)
    counts = [canonicalize_rotary(graph.gm).counts, fuse_rotary(graph.gm).counts]
    graph.gm.graph.lint()
    graph.gm.recompile()
    with torch.no_grad():
        expected, actual = fn(*args), graph(*args)
    for a, e in zip(actual, expected):
        atol, rtol = tolerance(e.dtype)
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol)
    return graph, counts


@pytest.mark.parametrize("name", list(cases()))
def test_each_spelling_becomes_one_op_for_q_and_k(name):
    fn, args = cases()[name]
    graph, (canonical, fused) = rewrite(fn, args)
    assert fused == {"rotary_embedding": 2}, (canonical, targets(graph))
    assert bool(canonical) == (name != "gptj"), canonical  # GPT-J's own form is the fused one
    assert not LEFT & set(targets(graph)), targets(graph)
    pairs = name.startswith("gptj")
    assert [n.args[3:] for n in graph.gm.graph.nodes if n.target is ROTARY] == [(True,) if pairs else ()] * 2


def level_2_graph(fn, args):
    """`fn`'s graph as Inductor decomposes it, after CSE, remove_redundant and
    canonicalize_rotary: the graph and the pass's counts. Outputs equal eager's."""
    mode = FakeTensorMode()
    with mode:
        gm = patterns.trace_forward(fn, [mode.from_tensor(a) for a in args], patterns.inductor_decompositions())
    gm.meta["graphopt_level"] = 2
    cse(gm)
    remove_redundant(gm)
    counts = canonicalize_rotary(gm).counts
    gm.graph.lint()
    gm.recompile()
    with torch.no_grad():
        for actual, expected in zip(gm(*args), fn(*args)):
            atol, rtol = tolerance(expected.dtype)
            torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    return gm, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(complex_cases()))
def test_level_2_makes_complex_products_real_math(name, dtype):
    """Inductor compiles real math into its kernels but leaves a complex product to
    ATen: at level 2 it becomes GPT-J's pairs (stacked as Inductor decomposes
    `stack`), cos and sin made once from freqs_cis for q and k."""
    gm, counts = level_2_graph(*complex_cases(dtype)[name])
    assert counts == {"complex_rotary": 2}
    left = targets(gm)
    assert not {aten.view_as_complex.default, aten.stack.default} & set(left), left
    assert left.count(aten.view_as_real.default) == 1, left
    # Only the table itself stays complex: a gather or view of it is made on its real pairs.
    complex_values = [n.name for n in gm.graph.nodes if n.op == "call_function"
                      and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_complex()]
    assert complex_values == [], complex_values


def test_level_2_leaves_real_spellings_to_inductor():
    """Inductor makes one kernel of any of them itself."""
    for name, (fn, args) in cases().items():
        assert level_2_graph(fn, args)[1] == {}, name


def test_level_1_keeps_complex_products():
    """A complex product is one ATen kernel, which the fused op does not beat."""
    fn, args = complex_cases()["meta complex"]
    graph = aot_graph(fn, *args)
    before = targets(graph)
    assert canonicalize_rotary(graph.gm).counts == {} and targets(graph) == before


def flipped_rotation(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return cos * x + torch.cat((x2, -x1), dim=-1) * sin


def unequal_halves(x, cos, sin):
    x1, x2 = torch.split(x, [6, 10], dim=-1)
    return cos * x + torch.cat((-x2, x1), dim=-1) * sin


def pairs_not_swapped(x, cos, sin):
    return sin * torch.stack((-x[..., ::2], x[..., 1::2]), dim=-1).flatten(-2) + cos * x


def another_tensor_rotated(x, cos, sin):
    return cos * x + by_chunk(x + 1) * sin


def rotation_read_elsewhere(x, cos, sin):
    turned = by_chunk(x)
    return cos * x + turned * sin, turned


def complex_left_complex(x, freqs):
    """The product's pairs are returned unflattened: no real [..., d] value to rewrite."""
    return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * freqs)


@pytest.mark.parametrize("fn", [flipped_rotation, unequal_halves, pairs_not_swapped, another_tensor_rotated,
                                rotation_read_elsewhere], ids=lambda f: f.__name__)
def test_what_is_not_a_rotary_embedding_is_left_alone(fn):
    x, _ = qk()
    cos, sin = halves_table()
    graph = aot_graph(fn, x, cos.unsqueeze(1), sin.unsqueeze(1))
    before = targets(graph)
    assert canonicalize_rotary(graph.gm).counts == {} and fuse_rotary(graph.gm).counts == {}
    assert targets(graph) == before


def test_complex_product_left_complex_is_left_alone():
    x, _ = qk()
    freqs_cis = torch.polar(torch.ones(S, D // 2), angles())[None, None]
    assert level_2_graph(complex_left_complex, (x, freqs_cis))[1] == {}
