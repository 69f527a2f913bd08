"""A level 2 started after its graph's first call (level_choice="background" on the CPU):
traced and measured on the state the first call saw, not on where the model has run
on to since; compiled in the child on models from outside the project."""

import pytest
import torch

import graphopt
from graphopt._compat import mkldnn
from graphopt.backend import tiers
from graphopt.config import tolerance


class CountedCache(torch.nn.Module):
    """A static cache's two pieces of state: its rows, and a length counter that says
    where the next row goes (transformers' StaticCache keeps one per layer)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.register_buffer("rows", torch.zeros(4, 16))
        self.register_buffer("length", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.rows.index_copy_(0, self.length.view(1), self.proj(x)[None])
        self.length.add_(1)
        return self.rows.sum(0)

    def reset(self):
        self.rows.zero_()
        self.length.zero_()


def test_wait_for_background_measures_a_deferred_level_2_on_the_first_calls_state(monkeypatch):
    """generate() runs a graph once (its prefill), then other graphs advance the cache's
    counter to its end; wait_for_background() then starts the prefill's level 2. Measured
    on the counter as it is now, the lowered graph indexed past the cache ("index 4 is out
    of bounds"), and level 2 failed for good. bfloat16 is lowered whatever the CPU (one
    without native bfloat16 would refuse it, and the lowered path would not run)."""
    monkeypatch.setattr(mkldnn, "cpu_has_native_bf16", lambda: True)
    torch.manual_seed(0)
    model, x = CountedCache().eval(), torch.randn(16)
    config = graphopt.GraphOptimizationConfig(graph_opt_level="auto", level_choice="background", cache_dir=None,
                                              use_cudagraph=False, compute_dtype="bfloat16")
    with torch.no_grad():
        expected = model(x)
        model.reset()
        optimized = graphopt.optimize(model, config)
        torch.testing.assert_close(optimized(x), expected, atol=0.05, rtol=0.05)
        model.length.fill_(4)  # run on to the cache's end by the other graphs
        assert tiers.wait_for_background(timeout=600)
        model.reset()
        torch.testing.assert_close(optimized(x), expected, atol=0.05, rtol=0.05)  # the choice
    [choice] = optimized.report().level_choices
    assert set(choice["seconds"]) == {"1", "2"}, choice
    assert not optimized.report().fallbacks


def test_a_deferred_level_2_keeps_the_sizes_dynamo_traced_as_static():
    """Dynamo forgets each input's symbolic context when the compile of a registered
    backend ends; a level 2 traced after that made every size a symbol, the weights'
    too, so Inductor never packed a GEMM weight for its template."""
    torch.manual_seed(0)
    model, x = CountedCache().eval(), torch.randn(16)
    options = dict(graph_opt_level="auto", level_choice="background", cache_dir=None, use_cudagraph=False)
    model.forward = torch.compile(model.forward, backend="graphopt", options=options)
    with torch.no_grad():
        model(x)
        model(x)  # starts level 2
        assert graphopt.wait_for_background(timeout=600)
    level_1, level_2 = graphopt.backends()[-1].graph_modules
    sizes = [[tuple(n.meta["val"].shape) for n in gm.graph.find_nodes(op="placeholder")] for gm in (level_1, level_2)]
    assert sizes[0] == sizes[1] == [(4, 16), (), (16, 16), (16,), (16,)]


def test_a_timm_cnns_level_2_compiles_in_the_child_and_is_chosen_by_the_clock():
    """The child path on a model from outside the project: PyTorch's harness met a
    child-only failure on timm's CNNs ("Exponent must be non-negative"). mobilenetv3's
    hardswish, squeeze-excite and depthwise convolutions, at timm's smallest width."""
    from graphopt.bench import zoo

    try:
        timm = zoo.import_timm()
    except zoo.ZooUnavailable as why:
        pytest.skip(f"timm cannot be imported here: {why}")
    torch.manual_seed(0)
    model, x = timm.create_model("mobilenetv3_small_050", pretrained=False).eval(), torch.randn(2, 3, 64, 64)
    config = graphopt.GraphOptimizationConfig(level_choice="background", cache_dir=None)
    atol, rtol = tolerance(torch.float32)
    with torch.inference_mode():
        expected = model(x)
        optimized = graphopt.optimize(model, config)
        for _ in range(2):
            torch.testing.assert_close(optimized(x), expected, atol=atol, rtol=rtol)
        assert graphopt.wait_for_background(timeout=600)
        torch.testing.assert_close(optimized(x), expected, atol=atol, rtol=rtol)  # the choice
    report = optimized.report()
    assert [set(c["seconds"]) for c in report.level_choices] == [{"1", "2"}], report.level_choices
    assert not report.fallbacks, report.fallbacks
