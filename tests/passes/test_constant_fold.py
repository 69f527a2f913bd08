"""fold_constants and refresh_folded_constants."""

import pytest
import torch
import torch.nn.functional as F
from support import targets
from torch.fx.experimental.proxy_tensor import make_fx

import graphopt
from graphopt._compat import inductor
from graphopt.passes.constant_fold import (
    FOLDED_RECIPES,
    FROZEN_INPUTS,
    fold_constants,
    fold_node,
    refresh_folded_constants,
)

aten = torch.ops.aten


def frozen_graph(fn, *args, frozen=()):
    """The ATen graph of `fn`, with the arguments at positions `frozen` marked as
    frozen parameters, as the backend marks them with freeze_parameters=True."""
    gm = make_fx(fn)(*args)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    gm.meta[FROZEN_INPUTS] = {placeholders[i].name: args[i] for i in frozen}
    return gm


def fold(gm, *args):
    expected = gm(*args)
    result = fold_constants(gm)
    gm.graph.lint()
    gm.recompile()
    torch.testing.assert_close(gm(*args), expected, atol=0, rtol=0)
    return result


def folded_attributes(gm):
    return [n.target for n in gm.graph.nodes if n.op == "get_attr"]


def test_a_subgraph_of_factories_and_scalars_is_folded():
    def fn(x):
        table = (torch.arange(8) * 0.5 + 1).cos()
        return x * table

    gm = frozen_graph(fn, torch.randn(3, 8))
    assert fold(gm, torch.randn(3, 8)).counts == {"folded": 1}
    assert targets(gm) == [aten.mul.Tensor]
    assert folded_attributes(gm) == ["_folded_0"]
    attr = next(n for n in gm.graph.nodes if n.op == "get_attr")
    assert attr.meta["val"].shape == (8,)
    assert gm.meta[FOLDED_RECIPES] == {}  # nothing in it depends on a parameter


def test_parameters_stay_live_without_freezing():
    def fn(x, w):
        return x @ (w * 0.5).t()

    gm = frozen_graph(fn, torch.randn(3, 4), torch.randn(5, 4))  # nothing frozen
    assert not fold_constants(gm).changed


def test_frozen_parameters_fold_scale_weight_and_weight_casts():
    def fn(x, w, b):
        return x @ (w * 0.5).t() + b.to(torch.float16).to(torch.float32)

    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    gm = frozen_graph(fn, x, w, b, frozen=(1, 2))
    assert fold(gm, x, w, b).counts == {"folded": 2}
    assert aten._to_copy.default not in targets(gm)
    # the transpose of the folded weight is a view: it stays, for recompose_linear
    assert targets(gm) == [aten.t.default, aten.mm.default, aten.add.Tensor]
    assert list(gm.meta[FOLDED_RECIPES]) == ["_folded_0", "_folded_1"]


def test_a_materialised_weight_transpose_is_folded():
    def fn(x, w):
        return x @ w.t().contiguous()

    x, w = torch.randn(3, 4), torch.randn(5, 4)
    gm = frozen_graph(fn, x, w, frozen=(1,))
    assert fold(gm, x, w).counts == {"folded": 1}
    assert targets(gm) == [aten.mm.default]
    assert getattr(gm, "_folded_0").shape == (4, 5)


def test_a_rotary_table_from_a_frozen_buffer_is_folded():
    def fn(q, inv_freq):
        freqs = torch.arange(16).float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return q * emb.cos() + q * emb.sin()

    q, inv_freq = torch.randn(2, 16, 8), 1.0 / (10000 ** (torch.arange(0, 8, 2) / 8))
    gm = frozen_graph(fn, q, inv_freq, frozen=(1,))
    assert fold(gm, q, inv_freq).counts == {"folded": 2}
    assert aten.cos.default not in targets(gm) and aten.cat.default not in targets(gm)


def test_a_value_the_graph_writes_is_not_folded():
    def fn(x, slot, cache, w):
        cache.index_copy_(0, slot, x)   # a KV-cache write
        return cache.sum(0) * (w * 2)

    x, slot, cache, w = torch.randn(1, 4), torch.tensor([1]), torch.zeros(3, 4), torch.randn(4)
    gm = frozen_graph(fn, x, slot, cache, w, frozen=(2, 3))
    assert fold(gm, x, slot, cache.clone(), w).counts == {"folded": 1}  # only w * 2
    assert aten.sum.dim_IntList in targets(gm)


def test_an_expand_into_a_big_tensor_is_not_folded():
    """A folded value is at most max(the bytes it is computed from, 64 KiB)."""
    def fn(x, w):
        small = w.expand(2, 8).contiguous()          # 64 bytes: folded
        big = w.expand(4096, 8).contiguous()         # 128 KiB from 32 bytes: not
        return x * small.sum(0) + big.sum(0)

    x, w = torch.randn(3, 8), torch.randn(8)
    gm = frozen_graph(fn, x, w, frozen=(1,))
    fold(gm, x, w)
    assert len(folded_attributes(gm)) == 1
    assert aten.clone.default in targets(gm)
    assert getattr(gm, "_folded_0").numel() == 8  # small.sum(0)


def test_random_ops_and_outputs_are_not_folded():
    gm = frozen_graph(lambda x: (x + torch.rand(4) * 2, torch.arange(4) * 2), torch.randn(4))
    assert fold_constants(gm).counts == {"folded": 1}  # arange only
    gm.recompile()
    assert targets(gm) == [aten.rand.default, aten.mul.Tensor, aten.add.Tensor, aten.mul.Tensor]
    (noise_a, first), (noise_b, second) = gm(torch.zeros(4)), gm(torch.zeros(4))
    assert not torch.equal(noise_a, noise_b)  # the random draw still happens at every call
    assert first.data_ptr() != second.data_ptr()  # a fresh output tensor each call


def test_a_one_element_value_from_frozen_parameters_stays():
    """Inductor would inline it into its kernels, out of refresh's reach."""
    gm = frozen_graph(lambda x, w: x * w.abs().max(), torch.randn(4), torch.randn(4), frozen=(1,))
    assert not fold_constants(gm).changed


def test_refresh_recomputes_folded_values_in_place():
    def fn(x, w):
        return x * (w * 0.5).exp()

    x, w = torch.randn(3, 4), torch.randn(4)
    gm = frozen_graph(fn, x, w, frozen=(1,))
    fold(gm, x, w)
    buffer = getattr(gm, "_folded_0")
    address = buffer.data_ptr()

    w.mul_(3)  # an in-place weight update, as load_state_dict makes
    torch.testing.assert_close(gm(x, w), x * (w / 3 * 0.5).exp())  # still the old weight
    assert refresh_folded_constants(gm) == 1
    torch.testing.assert_close(gm(x, w), x * (w * 0.5).exp())
    assert getattr(gm, "_folded_0").data_ptr() == address


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 4))
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight * self.scale)


def optimized(model, **config):
    return graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, use_cudagraph=False, **config))


def test_frozen_model_folds_and_refreshes_after_load_state_dict():
    model = Scaled().eval()
    opt = optimized(model, freeze_parameters=True)
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        (gm,) = opt.graphs()
        assert aten.mul.Tensor not in targets(gm) and aten.linear.default in targets(gm)

        model.load_state_dict({"weight": torch.randn(6, 4), "scale": torch.tensor(2.0)})
        assert refresh_folded_constants(gm) == 1
        torch.testing.assert_close(opt(x), model(x))


def test_unfrozen_model_sees_load_state_dict_without_refresh():
    model = Scaled().eval()
    opt = optimized(model)
    x = torch.randn(3, 4)
    with torch.no_grad():
        opt(x)
        assert not folded_attributes(opt.graphs()[0])
        model.load_state_dict({"weight": torch.randn(6, 4), "scale": torch.tensor(2.0)})
        torch.testing.assert_close(opt(x), model(x))


# ---- data node conversion: casts and layout conversions of constants ----

def test_a_widening_cast_of_a_frozen_weight_becomes_a_buffer_of_the_cast_value():
    def fn(x, w):
        return x @ w.to(torch.float32).t()

    x, w = torch.randn(3, 4), torch.randn(5, 4).half()
    gm = frozen_graph(fn, x, w, frozen=(1,))
    assert fold(gm, x, w).counts == {"folded": 1}
    assert aten._to_copy.default not in targets(gm)
    assert getattr(gm, "_folded_0").dtype == torch.float32
    w.copy_(torch.randn(5, 4))  # the recipe recomputes the cast from the new weight
    assert refresh_folded_constants(gm) == 1
    torch.testing.assert_close(gm(x, w), fn(x, w), atol=0, rtol=0)


def test_a_cast_of_a_tensor_attribute_is_folded():
    table = torch.linspace(0, 1, 8, dtype=torch.float64)
    gm = make_fx(lambda x: x * table.to(torch.float32))(torch.randn(2, 8))
    assert aten._to_copy.default in targets(gm)
    assert fold(gm, torch.randn(2, 8)).counts == {"folded": 1}
    assert targets(gm) == [aten.mul.Tensor]
    assert getattr(gm, "_folded_0").dtype == torch.float32
    assert gm.meta[FOLDED_RECIPES] == {}  # a tensor attribute never changes: no recipe


def test_fold_node_converts_a_frozen_weight_once_and_leaves_live_inputs():
    def fn(x, w):
        nhwc = torch.channels_last
        return torch.conv2d(x.contiguous(memory_format=nhwc), w.contiguous(memory_format=nhwc))

    x, w = torch.randn(2, 3, 4, 4), torch.randn(5, 3, 3, 3)
    gm = frozen_graph(fn, x, w, frozen=(1,))
    input_clone, weight_clone = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    attr = fold_node(gm, weight_clone)
    gm.recompile()
    assert attr.op == "get_attr"
    assert getattr(gm, attr.target).is_contiguous(memory_format=torch.channels_last)
    assert list(gm.meta[FOLDED_RECIPES]) == [attr.target]
    assert fold_node(gm, input_clone) is None
    assert targets(gm) == [aten.clone.default, aten.convolution.default]
    torch.testing.assert_close(gm(x, w), fn(x, w), atol=0, rtol=0)


def test_a_folded_value_a_later_fold_replaces_is_freed_and_its_recipe_moves_into_the_new_one():
    """As the weight quantization pass does: a concatenation of frozen weights folded,
    then a value computed from it folded in its place; the concatenation is then read by
    nothing, so its buffer and recipe go, and the new recipe computes from the weights."""
    def fn(x, w1, w2):
        return x @ torch.cat([w1, w2]).t()

    # Large enough that no pass reads its values (a small one's digest keys a stored graph).
    x, w1, w2 = torch.randn(3, 4), torch.randn(1500, 4), torch.randn(1600, 4)
    gm = frozen_graph(fn, x, w1, w2, frozen=(1, 2))
    fold(gm, x, w1, w2)
    [concat] = gm.graph.find_nodes(op="get_attr", target="_folded_0")
    [transpose] = concat.users
    with gm.graph.inserting_before(transpose):
        doubled = gm.graph.call_function(aten.mul.Tensor, (concat, 2.0))
    doubled.meta["val"] = concat.meta["val"] * 2.0
    transpose.replace_input_with(concat, doubled)
    attr = fold_node(gm, doubled)
    gm.graph.lint()
    gm.recompile()
    assert not hasattr(gm, "_folded_0") and folded_attributes(gm) == [attr.target]
    assert list(gm.meta[FOLDED_RECIPES]) == [attr.target]
    assert not gm.meta[FOLDED_RECIPES][attr.target].graph.find_nodes(op="get_attr")
    torch.testing.assert_close(gm(x, w1, w2), x @ (torch.cat([w1, w2]) * 2).t())

    w1.mul_(3)
    assert refresh_folded_constants(gm) == 1
    torch.testing.assert_close(gm(x, w1, w2), x @ (torch.cat([w1, w2]) * 2).t())


@pytest.mark.skipif(not inductor.inductor_available(), reason="Inductor needs a C++ compiler")
def test_at_level_2_a_library_kernel_reads_a_folded_constant():
    """Inductor calls SDPA on CPU as a library kernel and hands it a constant as the
    real tensor, under the compile's fake mode (Qwen3's causal mask at batch 1)."""
    def attend(q):
        mask = torch.zeros(8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    q = torch.randn(1, 2, 8, 16)
    opt = graphopt.optimize(attend, graphopt.GraphOptimizationConfig(graph_opt_level=2, use_cudagraph=False))
    with torch.inference_mode():
        torch.testing.assert_close(opt(q), attend(q))
    (gm,) = opt.graphs()
    (sdpa,) = gm.graph.find_nodes(op="call_function", target=aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert sdpa.kwargs["attn_mask"].op == "get_attr"
