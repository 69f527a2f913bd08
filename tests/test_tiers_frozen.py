"""graph_opt_level="auto" with freeze_parameters=True: level 2 compiles in a child process
while level 1 serves, as for a graph with live weights."""

import pathlib

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir

import graphopt
from graphopt.backend import tiers
from graphopt.config import tolerance


class Projections(torch.nn.Module):
    """Three linears of one input: with frozen weights the passes fold their weights into
    one concatenated constant (horizontal_linear), which Inductor's GEMM template packs."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(32, 48) for _ in range(3))
        self.out = torch.nn.Linear(48, 16)

    def forward(self, x):
        return self.out(torch.nn.functional.silu(self.q(x)) * self.k(x) + self.v(x))


def frozen_auto(**fields):
    torch.manual_seed(0)
    model = Projections().eval()
    config = graphopt.GraphOptimizationConfig(graph_opt_level="auto", level_choice="background",
                                              freeze_parameters=True, cache_dir=None, use_cudagraph=False, **fields)
    return model, graphopt.optimize(model, config)


def assert_eager(optimized, model, x, mode=torch.no_grad):
    atol, rtol = tolerance(torch.float32)
    with mode():
        torch.testing.assert_close(optimized(x), model(x), atol=atol, rtol=rtol)


# Serving engines call under either; level 2 compiles later, in the mode of the first call.
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_frozen_graph_serves_level_1_while_level_2_compiles_in_a_child_then_refreshes(monkeypatch, mode):
    monkeypatch.setattr(tiers, "MARGIN", 1e6)  # level 2 wins the timing whatever the clock says
    inductor_dir = pathlib.Path(cache_dir())
    throwaway = set(inductor_dir.glob("tmp*"))  # what Inductor's force_disable_caches leaves behind
    model, optimized = frozen_auto()
    x = torch.randn(4, 32)
    assert_eager(optimized, model, x, mode)  # level 1's result; level 2 starts at the next call
    report = optimized.report()
    [choice] = report.level_choices
    assert "level" not in choice and len(report.graphs) == 1  # the first call compiled level 1 alone
    assert graphopt.wait_for_background(timeout=600)  # starts level 2, then waits for the child
    assert report.graphs[1].fused_ops.get("horizontal_linear") == 1, str(report)  # folded here, sent to the child
    assert_eager(optimized, model, x, mode)  # the choice: each level checked against eager, then timed
    assert choice["level"] == 2 and set(choice["seconds"]) == {"1", "2"}, choice
    gemms = report.graphs[1].gemms  # timed in the child, reported here
    assert gemms and all(v.split(" ")[0] in ("ATen", "C++") and " us" in v for v in gemms.values()), gemms
    assert not report.fallbacks, report.fallbacks  # compiled in the child, not in the first call
    assert report.repacks == 0  # the timed runs' restores are no weight update

    with torch.no_grad():
        model.k.weight.mul_(2)  # noticed: level 2 compiled again from the new weights
    assert_eager(optimized, model, x, mode)
    assert report.repacks == 1 and report.weight_refreshes == {"updated in place: k.weight": 1}
    with torch.no_grad():
        model.q.weight.data.add_(0.5)  # not noticed: refresh() after it
    optimized.refresh()
    assert_eager(optimized, model, x, mode)
    assert report.repacks == 2
    assert set(inductor_dir.glob("tmp*")) == throwaway  # the child's compile and refresh()'s kept the cache


@pytest.mark.fresh_cache
def test_a_frozen_level_2_that_fails_in_the_child_leaves_level_1_serving_and_refreshing():
    # A compiler that cannot run: level 2 fails in the child, then in this process.
    model, optimized = frozen_auto(inductor_compile_config={"cpp.cxx": "/nonexistent/c++"})
    x = torch.randn(4, 32)
    assert_eager(optimized, model, x)
    assert tiers.wait_for_background(timeout=600)
    assert_eager(optimized, model, x)
    report = optimized.report()
    [choice] = report.level_choices
    assert choice["level"] == 1 and choice["reason"].startswith("level 2 failed to compile in the background (")
    assert "No working C++ compiler" in choice["reason"] and ", and in this process (" in choice["reason"]
    assert list(report.fallbacks) == [f"graph_opt_level='auto': {choice['reason']}; level 1 serves graph 0"]
    with torch.no_grad():
        model.v.bias.add_(1.0)
    assert_eager(optimized, model, x)  # level 1's folded constants refreshed; the failed level 2 is not compiled
    assert report.repacks == 0 and report.weight_refreshes == {"updated in place: v.bias": 1}


@pytest.mark.parametrize("written", [False, True])
def test_the_timed_runs_put_back_only_what_a_run_wrote(written):
    """A buffer no run writes is not written by the restore either: a frozen graph's watch
    would take the write for a weight update and compile level 2 again."""
    cache, constant = torch.zeros(3), torch.ones(3)
    state = tiers._State([cache, constant])
    if written:
        cache.add_(1)
    versions = (cache._version, constant._version)
    state.restore()
    assert torch.equal(cache, torch.zeros(3)) and constant._version == versions[1]
    assert (cache._version > versions[0]) == written
