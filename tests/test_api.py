from typing import Annotated

import pytest
import torch
from support import decode_inputs

import graphopt
from graphopt.config import tolerance
from graphopt.models import Decoder, DecoderConfig, generate

aten = torch.ops.aten
ATOL, RTOL = tolerance(torch.float32)
# One layer: each test compiles its decoder afresh, and one layer shows every rule here.
CONFIG = DecoderConfig.tiny(num_layers=1)


def config(level=1, **kw):
    return graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=False, **kw)


@pytest.fixture
def decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder(CONFIG).eval()


def twin_decoders():
    """Two decoders with the same weights and caches: one eager, one to optimize."""
    torch.manual_seed(0)
    eager = Decoder(CONFIG).eval()
    other = Decoder(CONFIG).eval()
    other.load_state_dict(eager.state_dict())
    return eager, other


def caches(model):
    return [b for name, b in model.named_buffers() if "cache" in name]


@pytest.mark.parametrize("level", [0, 1, 2])
def test_decode_steps_match_eager_logits_and_caches(level):
    eager, model = twin_decoders()
    opt = graphopt.optimize(model, config(level))
    with torch.inference_mode():
        for step, batch in enumerate([3, 5, 2]):
            inputs = decode_inputs(batch, position=step)
            torch.testing.assert_close(opt(*inputs), eager(*inputs), atol=ATOL, rtol=RTOL)
    for ours, theirs in zip(caches(model), caches(eager)):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)


def test_one_graph_serves_every_batch_size(decoder):
    opt = graphopt.optimize(decoder, config())
    with torch.inference_mode():
        for batch in range(1, 8):
            opt(*decode_inputs(batch))
    # batch 1 is specialised by Dynamo (0/1 specialisation); 2..7 share one graph
    assert len(opt.report().graphs) <= 2
    assert len(opt.graphs()) == len(opt.report().graphs)


def test_kv_cache_is_written_in_place_inside_the_graph(decoder):
    opt = graphopt.optimize(decoder, config())
    addresses = [c.data_ptr() for c in caches(decoder)]
    with torch.inference_mode():
        opt(*decode_inputs(4))
    (graph,) = opt.graphs()
    ops = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert aten.copy_.default not in ops
    assert aten.index_put.default not in ops
    assert ops.count(aten.index_put_.default) == 2 * CONFIG.num_layers
    assert [c.data_ptr() for c in caches(decoder)] == addresses


def test_greedy_generation_matches_eager():
    eager, model = twin_decoders()
    prompt = torch.randint(0, DecoderConfig.tiny().vocab_size, (4, 6), generator=torch.Generator().manual_seed(1))
    expected = generate(eager, prompt, 12)
    tokens = generate(model, prompt, 12, step=graphopt.optimize(model, config()))
    assert torch.equal(tokens, expected)


def test_in_place_weight_updates_are_seen(decoder):
    opt = graphopt.optimize(decoder, config())
    inputs = decode_inputs(3)
    with torch.inference_mode():
        before = opt(*inputs)
        decoder.lm_head.weight.mul_(2)
        after = opt(*inputs)
        torch.testing.assert_close(after, decoder(*inputs), atol=ATOL, rtol=RTOL)
    assert not torch.allclose(before, after)


def test_state_dict_has_each_weight_once(decoder):
    opt = graphopt.optimize(decoder, config())
    assert list(opt.state_dict()) == [f"model.{k}" for k in decoder.state_dict()]


def pair(x, y):
    return {"sum": x + y, "both": (x * y, y.relu())}


def test_functions_and_nested_outputs():
    opt = graphopt.optimize(pair, config())
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    out = opt(x, y=y)
    expected = pair(x, y)
    assert isinstance(out, dict) and isinstance(out["both"], tuple)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    assert opt.graphs()


def test_level_0_is_the_model_itself(decoder):
    opt = graphopt.optimize(decoder, config(0))
    inputs = decode_inputs(2)
    with torch.inference_mode():
        assert torch.equal(opt(*inputs), decoder(*inputs))
    assert opt.graphs() == [] and opt.report().graphs == []


def test_report_lists_graphs_passes_and_fallbacks(decoder):
    opt = graphopt.optimize(decoder, config(1))
    with torch.inference_mode():
        opt(*decode_inputs(3))
    report = opt.report().to_dict()
    assert report["level"] == 1
    assert report["graphs"][0]["nodes_after"] < report["graphs"][0]["nodes_before"]
    assert report["compile_seconds"] > 0
    assert {p["name"] for p in report["passes"]} >= {"dce", "reinplace_input_mutations"}
    assert report["fallbacks"] == {} and report["fallback_counts"] == {}
    text = str(opt.report())
    assert "graph_opt_level=1" in text and "reinplace_input_mutations" in text


def seq_model(x, mask):
    return (x * mask).sum(-1)


def test_explicit_dynamic_dims():
    opt = graphopt.optimize(seq_model, config(), dynamic_dims={"x": 1, "mask": graphopt.DynamicDims(1)})
    for length in (3, 4, 5, 6):
        x, mask = torch.randn(2, length, 4), torch.ones(2, length, 4)
        torch.testing.assert_close(opt(x, mask), seq_model(x, mask))
    assert len(opt.report().graphs) == 1


class Annotated2(torch.nn.Module):
    def forward(self, x: Annotated[torch.Tensor, graphopt.DynamicDims(1)]):
        return x.cumsum(1)


def test_dynamic_dims_from_annotations():
    opt = graphopt.optimize(Annotated2(), config())
    assert opt.dynamic_dims == {"x": 1}
    for length in (3, 4, 5):
        x = torch.randn(2, length)
        torch.testing.assert_close(opt(x), x.cumsum(1))
    assert len(opt.report().graphs) == 1


def test_dynamic_dims_errors(decoder):
    names = r"dynamic_dims names \['ids'\].*its arguments are \['input_ids', 'positions', 'slots'\]"
    with pytest.raises(ValueError, match=names):
        graphopt.optimize(decoder, config(), dynamic_dims={"ids": 0})
    with pytest.raises(TypeError, match=r"dynamic_dims\['input_ids'\] must be an int, DynamicDims\(k\) or None"):
        graphopt.optimize(decoder, config(), dynamic_dims={"input_ids": "0"})
    with pytest.raises(TypeError, match="DynamicDims takes an int"):
        graphopt.DynamicDims(1.5)
    opt = graphopt.optimize(decoder, config(), dynamic_dims={"input_ids": 1})
    with pytest.raises(ValueError, match=r"dynamic dim 1 of argument 'input_ids' is out of range for its shape \(3,\)"):
        opt(*decode_inputs(3))


def test_bad_arguments(decoder):
    with pytest.raises(ValueError, match=r"pad_values names \['slot'\]"):
        graphopt.optimize(decoder, config(), pad_values={"slot": 16})
    with pytest.raises(TypeError, match="config must be a GraphOptimizationConfig"):
        graphopt.optimize(decoder, {"graph_opt_level": 1})
    with pytest.raises(TypeError, match="takes an nn.Module or a function"):
        graphopt.optimize(42)


@graphopt.support_graph_optimization
class Tiny(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.register_buffer("count", torch.zeros(()), persistent=False)

    def forward(self, x: Annotated[torch.Tensor, graphopt.DynamicDims(0)]):
        self.count.add_(1)
        return torch.relu(self.proj(x))


class Plain(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.register_buffer("count", torch.zeros(()), persistent=False)

    def forward(self, x):
        self.count.add_(1)
        return torch.relu(self.proj(x))


def test_decorated_class_without_config_is_unchanged():
    torch.manual_seed(0)
    plain = Plain(8)
    torch.manual_seed(0)
    tiny = Tiny(8)
    x = torch.randn(3, 8)
    assert isinstance(tiny, Tiny) and isinstance(tiny, torch.nn.Module)
    assert list(tiny.state_dict()) == list(plain.state_dict())
    assert torch.equal(tiny(x), plain(x))
    assert not hasattr(tiny, "graph_opt_module")
    assert "forward" not in vars(tiny)


def test_decorated_class_with_config_runs_optimized():
    torch.manual_seed(0)
    plain = Plain(8)
    torch.manual_seed(0)
    tiny = Tiny(8, graph_opt_config=config())
    assert list(tiny.state_dict()) == list(plain.state_dict())
    for batch in (2, 3, 5):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(tiny(x), plain(x), atol=ATOL, rtol=RTOL)
    assert tiny.count.item() == 3  # the buffer mutation happened in place, once per call
    report = tiny.graph_opt_module.report()
    assert len(report.graphs) == 1 and report.passes
    assert "Tiny" in repr(tiny)


def test_decorator_rejects_non_modules():
    with pytest.raises(TypeError, match="decorates an nn.Module subclass"):
        graphopt.support_graph_optimization(lambda x: x)


class HalfScaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x @ (self.weight * 0.5).t()


@pytest.mark.parametrize("device_graphs", [False, True])
def test_refresh_recomputes_folded_weights(device_graphs):
    torch.manual_seed(0)
    model = HalfScaled()
    cfg = graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=device_graphs, freeze_parameters=True,
                                           cudagraph_capture_sizes=[4])
    opt = graphopt.optimize(model, cfg)
    x = torch.randn(3, 4)
    with torch.inference_mode():
        for _ in range(4):  # warm-ups and the capture, with device graphs
            before = opt(x).clone()
        model.weight.data.mul_(2)
        # frozen: a write through .data is not noticed, so the folded `weight * 0.5` stays until refresh()
        torch.testing.assert_close(opt(x), before)
        assert opt.refresh() >= 1
        torch.testing.assert_close(opt(x), model(x), atol=ATOL, rtol=RTOL)
        with torch.no_grad():
            model.weight.mul_(2)  # noticed: the call refreshes first
        torch.testing.assert_close(opt(x), model(x), atol=ATOL, rtol=RTOL)
        assert sum(opt.report().weight_refreshes.values()) == 1


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, x):
        return self.linear(x) * self.scale


def test_optimized_bound_method_replaces_forward():
    """The transformers / gpt-fast idiom: `m.forward = optimize(m.forward, cfg)`."""
    torch.manual_seed(0)
    model = Scaled().eval()
    x = torch.randn(3, 8)
    with torch.inference_mode():
        expected = model(x)
        model.forward = graphopt.optimize(model.forward, config())
        torch.testing.assert_close(model(x), expected, atol=ATOL, rtol=RTOL)
    assert isinstance(model.forward, graphopt.OptimizedFunction)
    assert len(model.forward.report().graphs) == 1  # it really ran compiled


def test_an_optimized_module_assigned_to_forward_is_an_error():
    model = Scaled()
    with pytest.raises(TypeError, match=r"assigning an OptimizedModule to Scaled.forward would be ignored.*"
                                        r"m.forward = graphopt.optimize\(m.forward, config\)"):
        model.forward = graphopt.optimize(Scaled(), config())
