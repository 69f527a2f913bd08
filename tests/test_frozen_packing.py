"""A packed GEMM weight of a stored level-2 graph made in one graph (backend/packing.py):
the fold's recipe and the template's packing composed, the copies between them left
out, and the result equal to the two graphs run one after the other."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graphopt.backend import packing

aten = torch.ops.aten


def fold(wq, wk, wv):
    """A fused QKV weight, stored transposed (constant_fold.py's recipe of it)."""
    return torch.cat([wq, wk, wv]).t().contiguous()


def pack(w):
    """The C++ GEMM template's blocking of a [k, n] weight (its tensor path, as traced)."""
    (k, n), block_n = w.shape, 32
    padded = torch.nn.functional.pad(w, (0, -n % block_n))
    blocked = padded.reshape(k, -1, block_n).transpose(0, 1).contiguous()
    return blocked.as_strided(blocked.shape, blocked.stride())


def weights(n=(64, 32, 32), k=48):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(rows, k, generator=generator) for rows in n]


def copies(gm: torch.fx.GraphModule) -> int:
    return sum(node.target in (aten.clone.default, aten.constant_pad_nd.default) for node in gm.graph.nodes)


def test_fold_and_pack_in_one_graph_copy_once_and_agree():
    ws = weights()
    recipe, packing_graph = make_fx(fold)(*ws), make_fx(pack)(fold(*ws))
    folded = recipe(*ws)
    geometry = (tuple(folded.shape), tuple(folded.stride()), 0)
    expected = packing_graph(folded.as_strided(*geometry))
    whole = packing.composed(recipe, geometry, packing_graph)
    assert copies(whole) == 3  # the fold's transpose, the packing's padding by nothing, its blocking
    simplified = packing.simplify(whole, ws)
    assert copies(simplified) == 1  # the blocking, read from the concatenation
    made = simplified(*ws)
    assert torch.equal(made, expected) and made.stride() == expected.stride()


def test_padding_that_pads_and_views_of_another_geometry_stay():
    ws = weights(n=(40, 20, 20))  # n = 80: padded to 96 for blocks of 32
    recipe = make_fx(fold)(*ws)
    folded = recipe(*ws)
    part = ((48, 40), (80, 1), 40)  # the template reading a view of the fold: its last 40 columns
    expected = pack(folded.as_strided(*part))
    packing_graph = make_fx(pack)(folded.as_strided(*part))
    simplified = packing.simplify(packing.composed(recipe, part, packing_graph), ws)
    targets = [node.target for node in simplified.graph.nodes]
    assert aten.constant_pad_nd.default in targets  # it pads 40 columns to 64
    assert targets.count(aten.as_strided.default) >= 1  # the view of part of the fold is no identity
    assert torch.equal(simplified(*ws), expected)
