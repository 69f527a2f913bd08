"""Capture safety: what a device graph cannot replay raises CaptureError at once,
naming the op and the user's line; check() collects every problem."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from support import assert_gradients_match, unexpected_fallbacks
from torch._subclasses.fake_tensor import FakeTensorMode

from graphopt import FallbackKind
from graphopt.runtime.analysis.safety import CaptureError, CaptureGuard, CaptureProblem, check, scan
from graphopt.runtime.host_graph import HostGraph

HERE = os.path.basename(__file__)


def next_line() -> int:
    """The caller's next line number: where the offending call is written."""
    return sys._getframe(1).f_lineno + 1


def assert_points_here(error: CaptureError | CaptureProblem, line: int) -> None:
    assert error.location == f"{__file__}:{line}"
    assert f"{HERE}:{line}" in error.message


@pytest.fixture
def graph():
    graph = HostGraph()
    graph.capture_begin()
    yield graph
    graph.reset()


def test_item_in_a_capture_raises_with_the_users_line(graph):
    x = torch.randn(3)
    with pytest.raises(CaptureError) as info:
        line = next_line()
        x.sum().item()
    assert info.value.op == "aten._local_scalar_dense"
    assert ".item()" in str(info.value) and "before the captured step" in str(info.value)
    assert_points_here(info.value, line)


def test_nonzero_in_a_capture_raises_with_the_users_line(graph):
    x = torch.tensor([0.0, 1.0, 2.0])
    with pytest.raises(CaptureError) as info:
        line = next_line()
        torch.nonzero(x)
    assert info.value.op == "aten.nonzero"
    assert "shape depends on the data" in str(info.value)
    assert_points_here(info.value, line)


def test_a_refused_op_is_not_recorded(graph):
    x = torch.tensor([0.0, 1.0, 2.0])
    y = x * 2
    with pytest.raises(CaptureError):
        x.nonzero()
    graph.capture_end([y])
    x.copy_(torch.tensor([3.0, 4.0, 5.0]))
    graph.replay()  # a recorded nonzero would raise here, outside the guard it would not
    assert y.tolist() == [6.0, 8.0, 10.0]


def three_problems(x):
    total = x.sum().item()
    picked = x[x > 0]
    flags = torch.unique(x)
    return total, picked, flags


def test_check_returns_every_problem_in_order():
    lines = [three_problems.__code__.co_firstlineno + k for k in (1, 2, 3)]
    problems = check(three_problems, torch.tensor([1.0, -2.0, 1.0]))
    assert [p.op for p in problems] == ["aten.item", "aten.index", "aten._unique2"]
    for problem, line in zip(problems, lines):
        assert isinstance(problem, CaptureProblem)
        assert_points_here(problem, line)
        assert "cannot be captured" in problem.message and "To fix:" in problem.message


def test_what_inductors_launcher_runs_while_it_tunes_is_not_the_steps():
    """Inductor times a Triton kernel of several configurations at its first launch,
    from its runtime module (reading timings back to the host), once per process: in
    a warm-up, never in a replay. The same op written by the step is found."""
    from graphopt._compat.autotune import _RUNTIME_DIR

    source = "def tune(x):\n    return x.nonzero()\n"
    found = {}
    for name, filename in (("launcher", os.path.join(_RUNTIME_DIR, "triton_heuristics.py")),
                           ("step", "model.py")):
        namespace = {}
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - a function as if defined there
        found[name] = [p.op for p in check(namespace["tune"], torch.tensor([0, 1, 2]))]
    assert found == {"launcher": [], "step": ["aten.nonzero"]}


def test_check_of_a_clean_function_is_empty(decoder):
    ids, positions, slots = torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([0, 1])
    assert check(decoder, ids, positions, slots) == []
    assert check(lambda x: (x @ x.t()).softmax(-1), torch.randn(3, 3)) == []


def test_collecting_guard_lets_the_op_run():
    guard = CaptureGuard(collect=True)
    with guard:
        found = torch.nonzero(torch.tensor([0.0, 3.0]))
    assert found.tolist() == [[1]]
    assert [p.op for p in guard.problems] == ["aten.nonzero"]


@pytest.mark.parametrize("fn, op", [
    (lambda x: torch.masked_select(x, x > 0), "aten.masked_select"),
    (lambda x: x.__setitem__(x > 0, torch.zeros(1)), "aten.index_put_"),  # (a float: masked_fill_ on torch >= 2.15)
    (lambda x: torch.repeat_interleave(x, torch.tensor([1, 2, 1])), "aten.repeat_interleave"),
    (lambda x: bool(x[0]), "aten.is_nonzero"),
    (lambda x: torch.equal(x, x), "aten.equal"),
    (lambda x: torch.argwhere(x), "aten.argwhere"),
    (lambda x: torch.unique_consecutive(x), "aten.unique_consecutive"),
])
def test_unsafe_ops_are_found(fn, op):
    assert [p.op for p in check(fn, torch.tensor([1.0, 0.0, 2.0]))] == [op]


@pytest.mark.parametrize("fn", [
    lambda x: torch.repeat_interleave(x, torch.tensor([1, 2, 1]), output_size=4),  # static shape
    lambda x: x.masked_fill(x > 0, 0.0),
    lambda x: torch.where(x > 0, x, 0.0),
    lambda x: x[torch.tensor([0, 2])],  # integer indexing has a fixed shape
    lambda x: torch.nonzero_static(x, size=3),
    lambda x: x.cpu() + torch.rand(3),  # a CPU tensor's .cpu() is no copy; random ops replay
])
def test_safe_ops_pass(fn):
    assert check(fn, torch.tensor([1.0, 0.0, 2.0])) == []


# The device rules read only the devices of an op's arguments: fake CUDA tensors
# exercise them on a machine without a GPU.

@pytest.mark.parametrize("move, op", [
    (lambda cuda, host: cuda.cpu(), "aten._to_copy"),
    (lambda cuda, host: cuda.to("cpu"), "aten._to_copy"),
    (lambda cuda, host: host.copy_(cuda), "aten.copy_"),
    (lambda cuda, host: host.to(cuda), "aten._to_copy"),  # from pageable host memory
])
def test_device_transfers_are_refused_from_their_arguments(move, op):
    with FakeTensorMode():
        cuda, host = torch.empty(3, device="cuda"), torch.empty(3)
        with pytest.raises(CaptureError) as info, CaptureGuard():
            move(cuda, host)
    assert info.value.op == op
    assert ("device to the host" in str(info.value)) != ("pageable" in str(info.value))


def test_device_arithmetic_is_not_a_transfer():
    with FakeTensorMode():
        cuda = torch.empty(3, device="cuda")
        guard = CaptureGuard(collect=True)
        with guard:
            (cuda + 1).relu_()
    assert guard.problems == []


@pytest.mark.cuda
def test_cuda_to_host_copy_is_refused():
    x = torch.randn(3, device="cuda")
    with pytest.raises(CaptureError, match="to the host") as info, CaptureGuard():
        line = next_line()
        x.cpu()
    assert_points_here(info.value, line)


@pytest.mark.cuda
def test_cuda_pageable_copy_is_refused_and_pinned_is_not():
    device_buffer = torch.empty(3, device="cuda")
    with pytest.raises(CaptureError, match="pageable"), CaptureGuard():
        device_buffer.copy_(torch.randn(3))
    pinned = torch.randn(3).pin_memory()
    with CaptureGuard():
        device_buffer.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(device_buffer.cpu(), pinned)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("level", [0, 1])
def test_a_step_that_records_autograd_is_not_captured_and_its_gradients_stay_right(device, level):
    """A replay would hand out the captured outputs, whose grad_fn reads saved
    activations the next replay overwrites: such a step runs uncaptured, says why,
    and its gradients are eager's; the same step under no_grad is captured."""
    import graphopt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(device)
    config = graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=True,
                                              cudagraph_capture_sizes=[2, 4], cudagraph_num_of_warmups=1)
    opt = graphopt.optimize(model, config)
    for _ in range(4):
        assert_gradients_match(opt, model, torch.randn(3, 8, device=device))
    report = opt.report()
    assert report.replays == 0
    assert unexpected_fallbacks(report) == {FallbackKind.CAPTURE_REFUSED: 1}
    (reason,) = report.reasons(FallbackKind.CAPTURE_REFUSED)  # the message users read: it names the fix
    assert "records autograd history" in reason and "torch.no_grad()" in reason
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 8, device=device)
            torch.testing.assert_close(opt(x), model(x))
    assert opt.report().replays > 0


def test_scan_runs_the_step_once_and_says_why_a_device_graph_must_never_capture_it():
    w = torch.ones(3)
    safe = scan(lambda x: x * w, (torch.ones(3),))
    torch.testing.assert_close(safe.outputs, torch.ones(3))
    assert safe.refusal is None and safe.groups == []
    synced = scan(lambda x: x * w.sum().item(), (torch.ones(3),))
    torch.testing.assert_close(synced.outputs, torch.full((3,), 3.0))  # it ran, whole
    assert synced.refusal.startswith("aten._local_scalar_dense at ")
    grad = scan(lambda x: x * torch.ones(3, requires_grad=True), (torch.ones(3),))
    assert "records autograd history" in grad.refusal
