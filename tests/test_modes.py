"""torch.compile's own door (registry.py, config.with_mode): `mode=`, one Backend per
torch.compile call, and Backends that survive the copies engines make of them."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import graphopt
from graphopt._compat import inductor
from graphopt.config import tolerance, with_mode

ATOL, RTOL = tolerance(torch.float32)


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w) * 2 + 1


@pytest.mark.parametrize("mode, level, graphs, autotune", [
    ("default", "auto", True, None),
    ("reduce-overhead", "auto", True, None),
    ("max-autotune-no-cudagraphs", 2, False, True),
    ("max-autotune", 2, True, True),
])
def test_each_mode_names_configuration_keys(mode: str, level: int | str, graphs: bool,
                                            autotune: bool | None) -> None:
    config, kept = with_mode(graphopt.GraphOptimizationConfig(), mode)
    assert (config.graph_opt_level, config.use_cudagraph) == (level, graphs)
    assert config.inductor_compile_config.get("max_autotune") == autotune
    assert kept == []


def test_keys_the_user_set_win_over_the_mode_and_the_report_says_so() -> None:
    given = graphopt.GraphOptimizationConfig(use_cudagraph=False, inductor_compile_config={"max_autotune": False})
    config, kept = with_mode(given, "max-autotune")
    assert config.graph_opt_level == 2 and config.use_cudagraph is False
    assert config.inductor_compile_config == {"max_autotune": False}
    assert kept == ["mode='max-autotune' sets use_cudagraph=True, the config's False is used",
                    "mode='max-autotune' sets inductor_compile_config['max_autotune']=True, the config's "
                    "False is used"]
    backend = graphopt.Backend(given, mode="max-autotune")
    assert backend.report().notes == kept and "notes:" in str(backend.report())


def test_an_unknown_mode_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown torch.compile mode 'fast'.*'reduce-overhead'.*'max-autotune'"):
        graphopt.Backend(mode="fast")
    compiled = torch.compile(_step, backend="graphopt", mode="fastest")
    with pytest.raises(Exception, match="unknown torch.compile mode 'fastest'"):
        compiled(torch.randn(2, 4), torch.randn(4, 4))


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_torch_compile_by_name_with_a_mode(mode: str) -> None:
    if mode.startswith("max-autotune") and not inductor.inductor_available():
        pytest.skip("level 2 needs a C++ compiler for Inductor on CPU")
    torch._dynamo.reset()
    compiled = torch.compile(_step, backend="graphopt", mode=mode, dynamic=False)
    w = torch.randn(8, 8)
    with torch.inference_mode():
        for _ in range(4):
            x = torch.randn(4, 8)
            torch.testing.assert_close(compiled(x, w), _step(x, w), atol=ATOL, rtol=RTOL)
    backend = graphopt.backends()[-1]
    report = backend.report()
    if mode == "reduce-overhead":  # graphopt's default level, with device graphs on: level 1 serves first
        assert backend.mode == mode and report.level == "auto" and len(report.level_choices) == 1
        assert report.replays > 0, str(report)
    else:
        assert backend.mode == mode and report.level == 2 and report.replays == 0, str(report)


def test_a_backend_object_takes_the_mode_torch_compile_passes() -> None:
    torch._dynamo.reset()
    backend = graphopt.Backend(graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    compiled = torch.compile(_step, backend=backend, mode="reduce-overhead")
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    torch.testing.assert_close(compiled(x, w), _step(x, w), atol=ATOL, rtol=RTOL)
    assert backend.mode == "reduce-overhead" and backend.config.use_cudagraph is False
    assert backend.report().notes == ["mode='reduce-overhead' sets use_cudagraph=True, the config's False is used"]


def test_one_backend_per_torch_compile_call_without_options() -> None:
    torch._dynamo.reset()
    earlier = graphopt.backends()  # held: the registry lists live Backends only
    first = torch.compile(lambda x: torch.tanh(x) + 1, backend="graphopt")
    second = torch.compile(lambda x: torch.sigmoid(x) * 2, backend="graphopt")
    x = torch.randn(3, 4)
    for _ in range(3):
        first(x), second(x)
    made = graphopt.backends()[len(earlier):]
    # graphopt's defaults: level "auto", one level choice per graph
    assert len(made) == 2 and all(len(b.report().level_choices) == 1 for b in made), [str(b.report()) for b in made]


def test_a_backend_survives_the_copies_engines_make() -> None:
    backend = graphopt.Backend(graphopt.GraphOptimizationConfig(graph_opt_level=1, max_num_seqs=8),
                               dynamic_dims={"x": 0}, pad_values={"x": 0.0}, mode="reduce-overhead")
    assert copy.deepcopy(backend) is backend
    assert copy.deepcopy({"backend": backend})["backend"] is backend
    again = pickle.loads(pickle.dumps(backend))
    assert again is not backend and again.report() is not backend.report()
    assert (again.config, again.mode, again.dynamic_dims, again.pad_values) == \
        (backend.config, backend.mode, backend.dynamic_dims, backend.pad_values)
