"""Inductor's own caches at level 2 when graphopt's cache has no entry for a graph
(a new graphopt cache directory beside a warm Inductor one): the graph is compiled once,
its passes run and are reported, and no code loaded from Inductor's cache is kept."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import graphopt
from graphopt._compat import inductor


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def compiled_once(model: torch.nn.Module, x: torch.Tensor, cache_dir, frozen: bool) -> tuple:
    torch._dynamo.reset()
    step = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=2, freeze_parameters=frozen, use_cudagraph=False, cache_dir=str(cache_dir)))
    with torch.no_grad():
        return step(x), step.report()


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "unfrozen"])
def test_a_graph_new_to_graphopts_cache_is_compiled_once_with_its_passes(tmp_path, monkeypatch, frozen):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(4, 32)
    expected = model(x)
    first, first_report = compiled_once(model, x, tmp_path / "first", frozen)
    compiles = []
    compile_once = inductor.inductor_compile
    monkeypatch.setattr(inductor, "inductor_compile", lambda *args: compiles.append(args) or compile_once(*args))
    counters.clear()
    second, second_report = compiled_once(model, x, tmp_path / "second", frozen)
    assert len(compiles) == 1
    assert counters["inductor"]["fxgraph_cache_hit"] == 0 and counters["aot_autograd"]["autograd_cache_hit"] == 0
    assert second_report.cache_misses == 1 and second_report.cache_hits == 0
    assert [p.name for p in second_report.passes] == [p.name for p in first_report.passes] != []
    torch.testing.assert_close(second, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(first, expected, rtol=1e-4, atol=1e-5)
