"""fuse_horizontal_linear: linears reading one input become one matmul on their
weights concatenated at optimize time (freeze_parameters=True only), then a split."""

import operator

import pytest
import torch
import torch.nn.functional as F
from support import aot_graph, decode_inputs, targets

import graphopt
from graphopt._compat import inductor
from graphopt.config import tolerance
from graphopt.models import DecoderConfig
from graphopt.passes.cleanup import cse
from graphopt.passes.constant_fold import FROZEN_INPUTS, refresh_folded_constants
from graphopt.passes.fusion.horizontal import fuse_horizontal_linear
from graphopt.passes.fusion.linear import recompose_linear

aten = torch.ops.aten
SPLIT = aten.split_with_sizes.default
LEVEL_2 = pytest.mark.skipif(not inductor.inductor_available(), reason="level 2 needs a C++ compiler")


def frozen_graph(fn, args, frozen):
    """The level-1 graph of `fn` after CSE (as the pipeline hands it over), with the
    arguments at positions `frozen` marked as frozen parameters."""
    graph = aot_graph(fn, *args)
    cse(graph.gm)
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    graph.gm.meta[FROZEN_INPUTS] = {p.name: args[i] for p, i in zip(placeholders, graph.order) if i in frozen}
    return graph


def run_pass(fn, args, frozen):
    graph = frozen_graph(fn, args, frozen)
    expected = graph(*args)
    before = targets(graph)
    result = fuse_horizontal_linear(graph.gm)
    graph.gm.graph.lint()
    graph.gm.recompile()
    return graph, expected, before, result


def assert_same(actual, expected):
    for a, b in zip(actual, expected):
        atol, rtol = tolerance(b.dtype)
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def qkv_no_bias(x, wq, wk, wv):  # Llama's projections, heads split off as attention does
    b, s, _ = x.shape
    q = F.linear(x, wq).view(b, s, -1, 4).transpose(1, 2)
    k = F.linear(x, wk).view(b, s, -1, 4).transpose(1, 2)
    v = F.linear(x, wv).view(b, s, -1, 4).transpose(1, 2)
    return q * 2 + k.sum(-1, keepdim=True), v.relu()


def qkv_bias(x, wq, wk, wv, bq, bk, bv):  # BERT's and Qwen2's
    return F.linear(x, wq, bq) * F.linear(x, wk, bk), F.linear(x, wv, bv).tanh()


def q_bias_only(x, wq, wk, wv, bq):
    return F.linear(x, wq, bq) + F.linear(x, wk) - F.linear(x, wv)


def gate_up_2d(x, wg, wu):  # an MLP on flattened tokens: no reshapes around the matmuls
    return F.silu(F.linear(x, wg)) * F.linear(x, wu)


def weights(*rows, k=8, dtype=torch.float32):
    return [torch.randn(n, k, dtype=dtype) for n in rows]


FORMS = {
    # name: (fn, args, frozen positions, group size, with bias)
    "qkv_no_bias": (qkv_no_bias, lambda d: (torch.randn(2, 5, 8, dtype=d), *weights(8, 4, 4, dtype=d)),
                    (1, 2, 3), 3, False),
    "qkv_bias": (qkv_bias, lambda d: (torch.randn(2, 5, 8, dtype=d), *weights(6, 6, 6, dtype=d),
                                      *(torch.randn(6, dtype=d) for _ in range(3))), (1, 2, 3, 4, 5, 6), 3, True),
    "q_bias_only": (q_bias_only, lambda d: (torch.randn(2, 5, 8, dtype=d), *weights(6, 6, 6, dtype=d),
                                            torch.randn(6, dtype=d)), (1, 2, 3, 4), 3, True),
    "gate_up_2d": (gate_up_2d, lambda d: (torch.randn(7, 8, dtype=d), *weights(12, 12, dtype=d)), (1, 2), 2, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_each_written_form_becomes_one_matmul_and_a_split(form, dtype):
    fn, make_args, frozen, n, with_bias = FORMS[form]
    args = make_args(dtype)
    graph, expected, before, result = run_pass(fn, args, frozen)
    matmul = aten.addmm.default if with_bias else aten.mm.default

    after = targets(graph)
    assert result.counts == {"groups": 1, "linears": n}
    assert after.count(aten.mm.default) + after.count(aten.addmm.default) == 1 and matmul in after
    assert after.count(aten.t.default) == 1 and after.count(SPLIT) == 1
    assert after.count(operator.getitem) == n
    # Per linear t, mm and a view back (or t and mm on a 2-D input); after: one of
    # each, the split and its n pieces.
    per_linear = 3 if form != "gate_up_2d" else 2
    assert len(after) == len(before) - per_linear * n + (per_linear + 1 + n)
    assert_same(graph(*args), expected)
    # The weights are concatenated once, into a constant: a get_attr, no cat.
    assert aten.cat.default not in after
    assert [n.op for n in graph.gm.graph.nodes].count("get_attr") == (2 if with_bias else 1)


def test_result_after_recompose_linear_is_one_linear_and_a_split():
    args = FORMS["qkv_no_bias"][1](torch.float32)
    graph, expected, _, _ = run_pass(qkv_no_bias, args, (1, 2, 3))
    recompose_linear(graph.gm)
    graph.gm.recompile()
    after = targets(graph)
    assert after.count(aten.linear.default) == 1 and aten.mm.default not in after
    linear = next(n for n in graph.gm.graph.nodes if n.target is aten.linear.default)
    assert next(iter(linear.users)).target is SPLIT
    assert_same(graph(*args), expected)


def test_missing_biases_are_zeros():
    x, wq, wk, wv, bq = FORMS["q_bias_only"][1](torch.float32)
    graph, *_ = run_pass(q_bias_only, (x, wq, wk, wv, bq), (1, 2, 3, 4))
    addmm = next(n for n in graph.gm.graph.nodes if n.target is aten.addmm.default)
    bias = getattr(graph.gm, addmm.args[0].target)
    torch.testing.assert_close(bias, torch.cat([bq, torch.zeros(12)]), atol=0, rtol=0)


def test_refresh_recomputes_the_concatenated_weights_in_place():
    args = FORMS["qkv_bias"][1](torch.float32)
    graph, *_ = run_pass(qkv_bias, args, (1, 2, 3, 4, 5, 6))
    args[2].mul_(3)  # an in-place update of wk, as load_state_dict makes
    args[6].add_(1)  # and of bv
    assert refresh_folded_constants(graph.gm) == 2
    assert_same(graph(*args), qkv_bias(*args))


def test_parameters_not_frozen_are_not_fused():
    args = FORMS["qkv_no_bias"][1](torch.float32)
    graph, _, _, result = run_pass(qkv_no_bias, args, frozen=())
    assert not result.changed and targets(graph).count(aten.mm.default) == 3


def test_some_weights_not_frozen_leaves_those_out():
    args = FORMS["qkv_no_bias"][1](torch.float32)
    graph, expected, _, result = run_pass(qkv_no_bias, args, frozen=(1, 2))
    assert result.counts == {"groups": 1, "linears": 2}
    assert targets(graph).count(aten.mm.default) == 2
    assert_same(graph(*args), expected)


def test_linears_on_different_inputs_are_not_fused():
    def two_inputs(x, y, w1, w2):
        return F.linear(x, w1) * F.linear(y, w2)

    graph, _, _, result = run_pass(two_inputs, (torch.randn(2, 5, 8), torch.randn(2, 5, 8), *weights(6, 6)),
                                   frozen=(2, 3))
    assert not result.changed


def test_linears_in_different_dtypes_are_not_fused():
    """mm needs one dtype: linears of the same x in two dtypes read two inputs (x and its cast)."""
    def two_dtypes(x, w1, w2):
        return F.linear(x, w1).float() + F.linear(x.to(torch.bfloat16), w2).float()

    args = (torch.randn(2, 5, 8), torch.randn(6, 8), torch.randn(6, 8, dtype=torch.bfloat16))
    graph, _, _, result = run_pass(two_dtypes, args, frozen=(1, 2))
    assert not result.changed


def test_a_weight_also_used_elsewhere_is_fused_and_kept_there():
    def also_read(x, w1, w2):
        return F.linear(x, w1) - F.linear(x, w2), w1.sum()

    args = (torch.randn(2, 5, 8), *weights(6, 6))
    graph, expected, _, result = run_pass(also_read, args, frozen=(1, 2))
    assert result.counts == {"groups": 1, "linears": 2}
    assert aten.sum.default in targets(graph)
    assert_same(graph(*args), expected)


def test_linears_whose_results_are_returned_are_not_fused():
    """A split piece is a strided view; eager returns contiguous tensors."""
    graph, _, _, result = run_pass(lambda x, w1, w2: (F.linear(x, w1), F.linear(x, w2)),
                                   (torch.randn(2, 5, 8), *weights(6, 6)), frozen=(1, 2))
    assert not result.changed


def test_a_view_that_needs_contiguous_memory_blocks_the_group():
    def flattened(x, w1, w2):
        return F.linear(x, w1).view(-1) * 2, F.linear(x, w2) * 3

    graph, _, _, result = run_pass(flattened, (torch.randn(2, 5, 8), *weights(6, 6)), frozen=(1, 2))
    assert not result.changed


class Block(torch.nn.Module):
    """Attention projections and a gated MLP, as Llama writes them."""

    def __init__(self, width=16, bias=False):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(width, n, bias=bias) for n in (16, 8, 8))
        self.gate_proj, self.up_proj = (torch.nn.Linear(width, 32, bias=False) for _ in range(2))
        self.down_proj = torch.nn.Linear(32, width, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, 4, 4).transpose(1, 2)
        k = self.k_proj(x).view(b, s, 2, 4).transpose(1, 2).repeat_interleave(2, dim=1)
        v = self.v_proj(x).view(b, s, 2, 4).transpose(1, 2).repeat_interleave(2, dim=1)
        attn = torch.softmax(q @ k.transpose(-1, -2).contiguous() * 0.5, dim=-1) @ v
        h = x + attn.transpose(1, 2).reshape(b, s, -1)
        return h + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def optimize(model, freeze=True, level=1, **config):
    config = graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=False,
                                              freeze_parameters=freeze, **config)
    return graphopt.optimize(model, config)


def pass_counts(opt, name):
    return next(p for p in opt.report().passes if p.name == name).counts


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_end_to_end_qkv_and_gate_up(bias):
    torch.manual_seed(0)
    model = Block(bias=bias).eval()
    opt = optimize(model)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert_same([opt(x)], [model(x)])
        assert_same([opt(x[:1])], [model(x[:1])])  # one graph serves every batch size
    assert pass_counts(opt, "fuse_horizontal_linear") == {"groups": 2, "linears": 5}
    graph = opt.report().graphs[0]
    assert graph.fused_ops.get("horizontal_linear") == 2
    ops = targets(opt.graphs()[0])
    assert ops.count(aten.linear.default) == 3 and ops.count(SPLIT) == 2  # qkv, gate_up, down


def test_end_to_end_without_freezing_nothing_is_fused():
    model = Block().eval()
    opt = optimize(model, freeze=False)
    with torch.no_grad():
        opt(torch.randn(2, 5, 16))
    assert pass_counts(opt, "fuse_horizontal_linear") == {}
    assert targets(opt.graphs()[0]).count(aten.linear.default) == 6


def test_reference_decoder_fuses_qkv_and_gate_up_and_refreshes(decoder):
    opt = optimize(decoder)
    ids, positions, slots = decode_inputs(3)
    with torch.no_grad():
        decoder.reset_cache()
        expected = decoder(ids, positions, slots)
        decoder.reset_cache()
        assert_same([opt(ids, positions, slots)], [expected])
        layers = DecoderConfig.tiny().num_layers
        assert opt.report().graphs[0].fused_ops["horizontal_linear"] == 2 * layers

        for layer in decoder.layers:  # an in-place weight update
            layer.self_attn.k_proj.weight.mul_(-1)
            layer.mlp.up_proj.weight.mul_(2)
        decoder.reset_cache()
        expected = decoder(ids, positions, slots)
        decoder.reset_cache()
        opt.refresh()
        assert_same([opt(ids, positions, slots)], [expected])


def test_transformers_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)).eval()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    opt = optimize(model)
    with torch.no_grad():
        assert_same([opt(input_ids=ids, use_cache=False).logits], [model(input_ids=ids, use_cache=False).logits])
    assert pass_counts(opt, "fuse_horizontal_linear") == {"groups": 4, "linears": 10}


@LEVEL_2
def test_level_2_fuses_both_linear_fusions():
    torch.manual_seed(0)
    model = Block().eval()
    # ATen's GEMMs: the fusions are graphopt's, decided before Inductor; timing the C++
    # template for each GEMM would only make the compile longer.
    opt = optimize(model, level=2, inductor_compile_config={"max_autotune_gemm": False})
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert_same([opt(x)], [model(x)])
    assert pass_counts(opt, "fuse_horizontal_linear") == {"groups": 2, "linears": 5}
    assert pass_counts(opt, "fuse_matmul_transpose") == {"copies_removed": 1}


class GatedMLP(torch.nn.Module):
    """gate and up large enough (64 x 128 each) that their concatenation is not kept
    for a pass to read (constant_fold.may_be_read)."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = (torch.nn.Linear(128, 64, bias=False) for _ in range(2))
        self.down_proj = torch.nn.Linear(64, 128, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@LEVEL_2
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])  # serving engines call under either
def test_level_2_stores_the_fused_weight_as_its_gemm_reads_it_and_refreshes(monkeypatch, mode):
    from graphopt.passes import transposed_weights

    in_place = []
    transpose = transposed_weights._Scratch.transposed_in_place
    monkeypatch.setattr(transposed_weights._Scratch, "transposed_in_place",
                        lambda self, value: in_place.append(value.shape) or transpose(self, value))
    torch.manual_seed(0)
    model = GatedMLP().eval()
    opt = optimize(model, level=2, cache_dir=None)  # each case runs the passes, not the other's cache entry
    x = torch.randn(2, 5, 128)
    with mode():
        assert_same([opt(x)], [model(x)])
        assert pass_counts(opt, "store_transposed_weights") == {"stored": 1}
        assert not opt.report().fallbacks
        # The concatenation, read by nothing else, took its own transpose: no new memory.
        assert in_place == [torch.Size([128, 128])]
        (gm,) = opt.graphs()
        # The GEMM reads the folded [in, out] constant itself: what Inductor's template packs and frees.
        assert not [n for n in gm.graph.nodes if n.target is aten.permute.default and n.args[0].op == "get_attr"]
        model.up_proj.weight.mul_(-2)
        opt.refresh()
        assert_same([opt(x)], [model(x)])
