"""freeze_parameters=True without refresh(): a weight changed in place, loaded, reassigned,
or replaced with its module is noticed before the next call, which then equals eager's
output on the changed model; an unchanged model never refreshes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._dynamo

import graphopt
from graphopt.config import tolerance


class Scaled(torch.nn.Module):
    """Values folded from the weights at level 1: `w * scale` and conv + batch norm."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.rand(8) + 0.5)
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.nn.functional.linear(x, self.lin.weight * self.scale, self.lin.bias), self.bn(self.conv(img))


def inputs():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(2, 8, generator=generator), torch.randn(1, 3, 8, 8, generator=generator)


def optimized(model, level=1, cache_dir=None):
    torch._dynamo.reset()
    config = graphopt.GraphOptimizationConfig(graph_opt_level=level, freeze_parameters=True, cache_dir=cache_dir)
    return graphopt.optimize(model, config)


def assert_like_eager(step, model):
    args, (atol, rtol) = inputs(), tolerance(torch.float32)
    with torch.no_grad():
        for got, want in zip(step(*args), model(*args)):
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def in_place(model):
    with torch.no_grad():
        model.scale.mul_(3)
        model.bn.running_var.add_(1)


def loaded(model):
    model.load_state_dict({k: torch.rand_like(v) + 0.5 if v.is_floating_point() else v
                           for k, v in model.state_dict().items()})


def reassigned(model):
    model.scale = torch.nn.Parameter(torch.rand(8) + 2)


def replaced(model):
    model.bn = torch.nn.BatchNorm2d(4).eval()
    with torch.no_grad():
        model.bn.running_mean.fill_(0.7)


@pytest.mark.parametrize("change, why", [(in_place, "updated in place: scale, bn.running_var"),
                                         (loaded, "updated in place: lin.weight"),
                                         (reassigned, "reassigned: scale"),
                                         (replaced, "reassigned: bn.")])
def test_a_changed_weight_is_refreshed_before_the_next_call(change, why):
    torch.manual_seed(0)
    model = Scaled().eval()
    step = optimized(model)
    assert_like_eager(step, model)
    assert any(n.op == "get_attr" for n in step.graphs()[0].graph.nodes)  # values were folded
    change(model)
    assert_like_eager(step, model)
    refreshes = step.report().weight_refreshes
    assert sum(refreshes.values()) == 1 and next(iter(refreshes)).startswith(why)
    assert "frozen weights changed, refreshed 1 time(s)" in str(step.report())
    assert_like_eager(step, model)  # nothing changed since: no second refresh
    assert sum(step.report().weight_refreshes.values()) == 1


class ZeroScaled(torch.nn.Module):
    """`x * (1 + scale)` with `scale` zero, as norms like Gemma's start: folded, all ones."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.zeros(64))
        self.weight = torch.nn.Parameter(torch.randn(64, 32))

    def forward(self, x):
        return (x * (1 + self.scale)) @ self.weight


@pytest.mark.parametrize("level", [1, 2])
def test_a_value_folded_as_ones_is_not_simplified_away(level):
    """A product with a value folded from weights that happen to be all ones keeps it:
    the weights may change (a checkpoint loaded after the first call), and the refreshed
    value must still be multiplied in."""
    torch.manual_seed(0)
    model, x = ZeroScaled().eval(), torch.randn(4, 64)
    step = optimized(model, level=level)
    with torch.no_grad():
        step(x)
        model.scale.fill_(0.5)
        torch.testing.assert_close(step(x), model(x), atol=1e-5, rtol=1e-5)


def test_an_unchanged_model_never_refreshes():
    torch.manual_seed(0)
    model = Scaled().eval()
    step = optimized(model)
    for _ in range(3):
        assert_like_eager(step, model)
    torch.nn.Linear(2, 2)  # an assignment elsewhere in the process: checked, not refreshed
    assert_like_eager(step, model)
    assert not step.report().weight_refreshes and step.report().to_dict()["weight_refreshes"] == {}


def test_a_buffer_the_graph_writes_is_not_a_frozen_weight():
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("calls", torch.zeros(1))

        def forward(self, x):
            self.calls.add_(1)
            return self.lin(x) * 2 + self.calls

    model = Counting().eval()
    step = optimized(model)
    with torch.no_grad():
        for _ in range(3):
            step(torch.ones(2, 4))
    assert model.calls.item() == 3 and not step.report().weight_refreshes


def test_refresh_by_hand_is_not_repeated_at_the_next_call():
    model = Scaled().eval()
    step = optimized(model)
    assert_like_eager(step, model)
    in_place(model)
    assert step.refresh() > 0
    assert_like_eager(step, model)
    assert not step.report().weight_refreshes


def test_with_the_compile_cache_and_its_traces(tmp_path):
    for _ in range(2):  # the second start loads the graph from the cache (same weights)
        torch.manual_seed(0)
        model = Scaled().eval()
        step = optimized(model, cache_dir=str(tmp_path))
        assert_like_eager(step, model)
        reassigned(model)
        assert_like_eager(step, model)
        in_place(model)
        assert_like_eager(step, model)
        assert sum(step.report().weight_refreshes.values()) == 2
    assert step.report().cache_hits >= 1


def test_level_2_reassigned_weight():
    torch.manual_seed(0)
    model = Scaled().eval()
    step = optimized(model, level=2)
    assert_like_eager(step, model)
    reassigned(model)
    assert_like_eager(step, model)
    assert list(step.report().weight_refreshes) == ["reassigned: scale"]


def test_the_report_notes_a_graph_that_could_have_been_frozen():
    model = Scaled().eval()
    torch._dynamo.reset()
    step = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, cache_dir=None, use_cudagraph=False))
    assert_like_eager(step, model)  # under no_grad: inference
    notes = [n for n in step.report().notes if n.startswith("freeze_parameters=False")]
    assert len(notes) == 1 and "would fold and pack them" in notes[0] and "notes:" in str(step.report())
    assert not step._step.backend.frozen_watches

    torch._dynamo.reset()
    training = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, cache_dir=None, use_cudagraph=False))
    training(*inputs())[0].sum().backward()  # records autograd: freezing would not apply
    assert not any(n.startswith("freeze_parameters=False") for n in training.report().notes)


class Sliced(torch.nn.Module):
    """A forward that builds a module as it runs (`self.layers[:n]`, as transformers' decoders do)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:2]:
            x = layer(x)
        return x


def test_a_module_built_inside_a_compiled_forward_does_not_recompile_it():
    frozen = optimized(Scaled().eval())  # the process now counts assignments
    with torch.no_grad():
        frozen(*inputs())
        model = Sliced().eval()
        step = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
        x, (atol, rtol) = inputs()[0], tolerance(torch.float32)
        for _ in range(3):
            torch.testing.assert_close(step(x), model(x), atol=atol, rtol=rtol)
    assert len(step.report().graphs) == 1


START = textwrap.dedent('''
    import json, sys, torch, graphopt
    sys.path.insert(0, sys.argv[2])
    from test_frozen_changes import Sliced
    torch.manual_seed(0)
    model = Sliced().eval()
    step = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, cache_dir=sys.argv[1], use_cudagraph=False, freeze_parameters=True))
    same = True
    with torch.no_grad():
        for length in map(int, sys.argv[3:]):  # a new length: a trace of its own
            x = torch.randn(4, length, 8)
            same = same and torch.allclose(step(x), model(x), atol=1e-5)
    report = step.report()
    print(json.dumps({"same": same, "stored": report.traces_stored, "used": report.traces_used,
                      "fallbacks": list(report.fallbacks)}))
''')


def test_a_forward_that_builds_a_module_loads_its_stored_trace_in_a_later_process(tmp_path):
    """Dynamo guards on the module registration hooks where a forward builds a module.
    The frozen watch's hooks are in place before the first trace, so every trace sees
    the same ones: the first start's second trace, made after a graph was compiled, is
    used by a later process that calls that length first, before it builds any graph."""
    starts = []
    for lengths in (["5", "7"], ["7"]):
        done = subprocess.run([sys.executable, "-c", START, str(tmp_path), os.path.dirname(__file__), *lengths],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        starts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = starts
    assert first["same"] and second["same"]
    assert (first["stored"], second["used"], second["fallbacks"]) == (2, 1, []), starts
