"""The Backends `backend="graphopt"` makes (registry.py): one per torch.compile call,
shared by that call's graphs, alive while the call is, and gone with it, giving back
its graphs and its share of Dynamo's recompile limit."""

from __future__ import annotations

import gc
import weakref

import torch

import graphopt
from graphopt._compat import recompile as compat_recompile
from graphopt.backend.backend import RECOMPILE_BUDGET
from graphopt.config import tolerance

ATOL, RTOL = tolerance(torch.float32)
OPTIONS = {"graph_opt_level": 1, "use_cudagraph": False}


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) + 1


def _broken(x: torch.Tensor) -> torch.Tensor:
    y = torch.tanh(x) * 2
    torch._dynamo.graph_break()
    return torch.sigmoid(y) + 1


def _compile_and_run(model: torch.nn.Module, options: dict = OPTIONS,
                     calls: int = 1) -> tuple[torch.nn.Module, graphopt.Backend]:
    earlier = graphopt.backends()  # held: the registry lists live Backends only
    compiled = torch.compile(model, backend="graphopt", options=options, dynamic=False)
    with torch.inference_mode():
        for _ in range(calls):
            x = torch.randn(4, 8)
            torch.testing.assert_close(compiled(x), model(x), atol=ATOL, rtol=RTOL)
    made = graphopt.backends()[len(earlier):]
    assert len(made) == 1
    return compiled, made[0]


def test_a_calls_graphs_share_one_backend_and_two_calls_get_two() -> None:
    torch.compiler.reset()
    earlier = graphopt.backends()
    first = torch.compile(_broken, backend="graphopt", options=OPTIONS, dynamic=False)
    second = torch.compile(lambda x: torch.cos(x) - 1, backend="graphopt", options=OPTIONS)
    for rows in (3, 5):  # a second size: a recompile of each graph, in the same call
        x = torch.randn(rows, 4)
        torch.testing.assert_close(first(x), _broken(x), atol=ATOL, rtol=RTOL)
        second(x)
    made = graphopt.backends()[len(earlier):]
    assert len(made) == 2, [str(b.report()) for b in made]
    assert len(made[0].report().graphs) == 4 and made[0].report().recompiles == 2, str(made[0].report())


def test_a_backend_lives_while_its_compiled_model_does() -> None:
    torch.compiler.reset()
    model = _Model()
    compiled, backend = _compile_and_run(model)
    ref = weakref.ref(backend)
    del backend
    gc.collect()
    assert ref() is not None and ref() in graphopt.backends()
    with torch.inference_mode():  # a new size compiles into the same Backend
        compiled(torch.randn(5, 8))
    assert len(ref().report().graphs) == 2 and ref() is graphopt.backends()[-1]


def test_a_dropped_compiled_model_frees_its_backend_its_graphs_and_its_recompile_budget(monkeypatch) -> None:
    handed = []  # the runtimes the Backend hands Dynamo: its host graphs inside

    def compile_and_keep(backend, gm, example_inputs):
        runtime, spec = compile(backend, gm, example_inputs)
        handed.append(weakref.ref(runtime))
        return runtime, spec

    compile = graphopt.Backend.compile
    monkeypatch.setattr(graphopt.Backend, "compile", compile_and_keep)
    torch.compiler.reset()
    gc.collect()
    limit = compat_recompile.recompile_limit()
    model = _Model()
    compiled, backend = _compile_and_run(model, {"use_cudagraph": True}, calls=4)
    assert backend.report().replays > 0 and handed and all(ref() is not None for ref in handed)
    assert compat_recompile.recompile_limit() == limit + RECOMPILE_BUDGET
    refs = [weakref.ref(backend), weakref.ref(backend.report()), *map(weakref.ref, backend.graph_modules), *handed]
    assert backend in graphopt.backends()
    del compiled, model, backend
    # torch keeps each torch.compile call, and the graphs Dynamo cached for a module's
    # forward, until it is reset: that, not the registry, is what holds them now.
    torch.compiler.reset()
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)
    assert compat_recompile.recompile_limit() == limit


def test_outside_torch_compile_one_backend_per_options_dict() -> None:
    gm = torch.fx.symbolic_trace(lambda x: (torch.relu(x) * 3,))  # a tuple, as Dynamo's graphs return
    options = dict(OPTIONS)
    earlier = graphopt.backends()
    with torch.inference_mode():
        x = torch.randn(2, 3)
        for opts in (options, options, dict(OPTIONS)):  # the same dict twice, then an equal one
            compiled = graphopt.graphopt_backend(gm, [x], options=opts)
            torch.testing.assert_close(compiled(x)[0], torch.relu(x) * 3, atol=ATOL, rtol=RTOL)
    made = graphopt.backends()[len(earlier):]
    assert len(made) == 2 and len(made[0].report().graphs) == 2 and len(made[1].report().graphs) == 1

