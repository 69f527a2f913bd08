"""The host graph: a recorded ATen tape replayed on the same buffers, with its memory
in a pool arena planned by lifetime."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from support import decode_inputs
from torch.utils._python_dispatch import TorchDispatchMode

import graphopt
from graphopt import FallbackKind
from graphopt._compat.ops import current_dispatch_mode
from graphopt.config import tolerance
from graphopt.models import Decoder, DecoderConfig
from graphopt.runtime import native_tape
from graphopt.runtime.analysis.safety import CaptureError
from graphopt.runtime.host_arena import HostPool
from graphopt.runtime.host_graph import HostGraph


@pytest.fixture
def decoder() -> Decoder:
    """One layer: the tests that compile it do so afresh for each tape."""
    torch.manual_seed(0)
    return Decoder(DecoderConfig.tiny(num_layers=1)).eval()


@pytest.fixture(autouse=True, params=["native", "python"])
def replay_from(request, monkeypatch):
    """Every test runs on both tapes: C++ (the default) and the Python fallback."""
    monkeypatch.setattr(native_tape, "ENABLED", request.param == "native")
    return request.param


class OpLog(TorchDispatchMode):
    """Every ATen op that runs while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[torch._ops.OpOverload] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def capture(fn, *args, outputs=True, pool=None):
    """`fn(*args)` captured as a host graph; returns (graph, captured outputs)."""
    graph = HostGraph(pool)
    graph.capture_begin()
    try:
        out = fn(*args)
    except BaseException:
        graph.reset()  # abort the capture, so no recording mode outlives the test
        raise
    graph.capture_end(out if outputs else None)
    return graph, out


def test_reference_example_output_follows_input():
    x = torch.tensor([1.0])  # allocated before capture_begin
    graph = HostGraph()
    graph.capture_begin()
    y = x + 10
    graph.capture_end([y])
    graph.replay()
    assert y.tolist() == [11.0]
    for value in (2.0, -7.5):
        x.copy_(torch.tensor([value]))
        graph.replay()
        assert y.tolist() == [value + 10]
    graph.reset()
    with pytest.raises(RuntimeError, match="reset"):
        graph.replay()


def mixed(a, b, buf, idx):
    """matmul, add, relu, views, softmax, an in-place add_ and an index_put_ into a buffer."""
    h = torch.relu(a @ b + 1)
    row = h.view(-1)[: b.shape[1]].unsqueeze(0)
    probs = torch.softmax(h.t(), dim=-1)
    probs.add_(row.t())
    buf.index_put_((idx,), probs[:, 0])
    return probs * 2, row.transpose(0, 1)


def mixed_inputs():
    return torch.randn(4, 5), torch.randn(5, 6), torch.zeros(10), torch.tensor([1, 3, 5, 7, 8, 9])


@pytest.mark.parametrize("grad_context", [torch.inference_mode, torch.no_grad])
def test_replay_equals_eager_on_new_inputs(grad_context):
    torch.manual_seed(0)
    a, b, buf, idx = mixed_inputs()
    with grad_context():
        graph, outs = capture(mixed, a, b, buf, idx)
    ptrs = [o.data_ptr() for o in outs]
    for step in range(3):
        a.copy_(torch.randn(4, 5))
        b.copy_(torch.randn(5, 6))
        idx.copy_(torch.randperm(10)[:6])
        expected_buf = buf.clone()
        expected = mixed(a, b, expected_buf, idx)
        graph.replay()
        for got, want in zip(outs, expected):
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(buf, expected_buf)
        assert [o.data_ptr() for o in outs] == ptrs
    assert graph.copy_replays == 0


def test_replay_only_writes_through_out_and_in_place_forms():
    a, b, buf, idx = mixed_inputs()
    with torch.inference_mode():
        graph, _ = capture(mixed, a, b, buf, idx)
    log = OpLog()
    with log:
        graph.replay()
    assert log.ops, "the replay ran no ops"
    functional = [op for op in log.ops if not op._schema.is_mutable]
    assert functional == [], f"ops that allocate their result: {functional}"


def test_views_are_not_replayed():
    x = torch.randn(3, 4)
    graph, _ = capture(lambda t: (t * 2).view(12).unsqueeze(0)[0].view(3, 4).t()[1:], x)
    log = OpLog()
    with log:
        graph.replay()
    assert [op.overloadpacket for op in log.ops] == [torch.ops.aten.mul]


def test_op_without_out_form_is_recomputed_and_copied():
    x = torch.randn(8)
    with torch.inference_mode():  # under inference mode selu reaches the recorder undecomposed: no out= form
        graph, y = capture(torch.selu, x)
    assert graph.copy_replays == 1
    x.copy_(torch.randn(8))
    ptr = y.data_ptr()
    graph.replay()
    torch.testing.assert_close(y, torch.selu(x))
    assert y.data_ptr() == ptr


def test_random_ops_draw_fresh_numbers_at_each_replay():
    graph, r = capture(lambda: torch.rand(5) * 2)
    torch.manual_seed(1)
    graph.replay()
    first = r.clone()
    graph.replay()
    assert not torch.equal(first, r)
    torch.manual_seed(1)
    torch.testing.assert_close(first, torch.rand(5) * 2)  # the same draws eager makes


def step_buffers(batch: int, slots: list[int]):
    ids, positions, _ = decode_inputs(batch)
    return ids.clone(), positions.clone(), torch.tensor(slots)


def test_decoder_step_follows_eager_step_by_step(decoder):
    reference = copy.deepcopy(decoder)
    ids, positions, slots = step_buffers(4, [3, 0, 12, 7])  # distinct cache rows
    atol, rtol = tolerance(torch.float32)
    generator = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        graph, logits = capture(decoder, ids, positions, slots)
        torch.testing.assert_close(logits, reference(ids, positions, slots), atol=atol, rtol=rtol)
        for step in range(1, 5):
            ids.copy_(torch.randint(0, decoder.config.vocab_size, (4,), generator=generator))
            positions.add_(1)
            graph.replay()
            torch.testing.assert_close(logits, reference(ids, positions, slots), atol=atol, rtol=rtol)
            for mine, theirs in zip(decoder.buffers(), reference.buffers()):
                torch.testing.assert_close(mine, theirs, atol=atol, rtol=rtol)
    assert graph.copy_replays == 0


def test_level1_module_step_replays_the_compiled_graph(decoder):
    reference = copy.deepcopy(decoder)
    opt = graphopt.optimize(decoder, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    ids, positions, slots = step_buffers(2, [5, 9])
    with torch.inference_mode():
        for _ in range(2):  # warm-ups: compile outside the capture
            opt(ids, positions, slots)
            reference(ids, positions, slots)
        graph, logits = capture(opt, ids, positions, slots)
        reference(ids, positions, slots)
        for _ in range(3):
            ids.copy_(torch.randint(0, decoder.config.vocab_size, (2,)))
            positions.add_(1)
            graph.replay()
            torch.testing.assert_close(logits, reference(ids, positions, slots), atol=1e-4, rtol=1e-4)
    # Only the two fused attention calls: the CPU flash-attention op has no out= overload.
    assert graph.copy_replays == decoder.config.num_layers


def decoder_step_graph(decoder, batch: int, pool: HostPool | None) -> HostGraph:
    ids, positions, slots = step_buffers(batch, list(range(batch)))
    with torch.inference_mode():
        graph, _ = capture(decoder, ids, positions, slots, pool=pool)
    return graph


def test_shared_pool_is_the_largest_need_not_the_sum(decoder):
    shared = HostPool()
    big, small = decoder_step_graph(decoder, 8, shared), decoder_step_graph(decoder, 2, shared)
    assert shared.nbytes == max(big.nbytes, small.nbytes)
    assert shared.nbytes < 0.85 * (big.nbytes + small.nbytes)
    pools = [HostPool(), HostPool()]
    big, small = decoder_step_graph(decoder, 8, pools[0]), decoder_step_graph(decoder, 2, pools[1])
    assert sum(p.nbytes for p in pools) == big.nbytes + small.nbytes


def test_graphs_in_one_pool_replay_correctly_in_turn():
    pool = HostPool()
    x = torch.randn(1000)
    g1, y1 = capture(lambda t: (t + 1) * 2, x, pool=pool)
    g2, y2 = capture(lambda t: (t - 1) * 3, x[:100], pool=pool)
    for _ in range(2):
        x.copy_(torch.randn(1000))
        g1.replay()
        torch.testing.assert_close(y1, (x + 1) * 2)
        g2.replay()  # may overwrite y1: graphs of one pool share memory, as CUDA graphs do
        torch.testing.assert_close(y2, (x[:100] - 1) * 3)


def test_reset_gives_back_the_graphs_share_of_the_pool():
    pool = HostPool()
    x = torch.randn(4096)
    big, held = capture(lambda t: t.exp() + 1, x, pool=pool)
    small, y = capture(lambda t: t[:16] * 2, x, pool=pool)
    assert pool.nbytes == big.nbytes > small.nbytes
    big.reset()
    assert pool.nbytes == small.nbytes
    assert held.sum().isfinite()  # still readable: the old arena lives while referenced
    x.copy_(torch.randn(4096))
    small.replay()
    torch.testing.assert_close(y, x[:16] * 2)
    small.reset()
    assert pool.nbytes == 0 and small.nbytes == 0


def chain(x):
    for _ in range(10):
        x = torch.sin(x) + 0.5
    return x


def test_lifetimes_let_intermediates_share_memory():
    x = torch.randn(1 << 18)
    graph, y = capture(chain, x)
    assert graph.nbytes <= 3 * x.nbytes  # twenty ops, but at most input-to-output pairs alive at once
    x.copy_(torch.randn(1 << 18))
    graph.replay()
    torch.testing.assert_close(y, chain(x))
    escaping, _ = capture(chain, x, outputs=False)  # without outputs nothing may share
    assert escaping.nbytes >= 20 * x.nbytes


def test_outputs_hold_the_captured_values_after_capture_end():
    x = torch.randn(64)
    graph, (a, b) = capture(lambda t: (t.exp(), t * 3), x)
    torch.testing.assert_close(a, x.exp())
    torch.testing.assert_close(b, x * 3)


def test_capture_error_aborts_with_reset_and_leaves_no_mode_behind():
    graph = HostGraph()
    graph.capture_begin()
    with pytest.raises(CaptureError):
        torch.tensor([1.0, 2.0]).sum().item()
    graph.reset()
    assert current_dispatch_mode() is None
    with pytest.raises(RuntimeError, match="nothing is captured"):
        graph.replay()


def test_misuse_is_reported():
    graph = HostGraph()
    with pytest.raises(RuntimeError, match="no capture in progress"):
        graph.capture_end()
    graph.capture_begin()
    with pytest.raises(RuntimeError, match="already capturing"):
        graph.capture_begin()
    with pytest.raises(RuntimeError, match="capture is still in progress"):
        graph.replay()
    graph.capture_end([])
    assert graph.nbytes == 0


def test_a_graph_reading_another_graphs_output_in_the_same_pool_is_placed_after_it():
    """The pieces of a split graph share a pool: the second reads the first's
    output from the arena, so its own memory must not overlap that output."""
    pool = HostPool()
    x = torch.randn(4, 8)
    first, (h,) = capture(lambda a: ((a * 2).relu(),), x, pool=pool)
    second, (y,) = capture(lambda a: ((a + 1) * (a - 1),), h, pool=pool)
    for _ in range(3):
        x.copy_(torch.randn(4, 8))
        first.replay()
        second.replay()
        expected = (x * 2).relu()
        torch.testing.assert_close(h, expected)
        torch.testing.assert_close(y, (expected + 1) * (expected - 1))
    assert pool.nbytes >= first.nbytes + 4 * 8 * 4


def python_calls_during(fn) -> int:
    """Python-level calls (Python functions and builtins) made while `fn` runs."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_native_replay_makes_no_python_call_per_op(decoder, replay_from):
    ids, positions, slots = step_buffers(4, [3, 0, 12, 7])
    reference = copy.deepcopy(decoder)
    with torch.inference_mode():
        graph, logits = capture(decoder, ids, positions, slots)
        ops = len(graph._tape)
        calls = python_calls_during(graph.replay)
        torch.testing.assert_close(logits, reference(ids, positions, slots), atol=1e-4, rtol=1e-4)
    assert ops > 50
    if replay_from == "native":
        assert graph.replays_natively, f"no native tape: {native_tape.unavailable()}"
        assert graph.python_entries == 0
        assert calls <= 5, f"{calls} Python calls replaying {ops} ops"  # replay(), its checks, the C++ call
    else:
        assert not graph.replays_natively and graph.python_entries == ops
        assert calls >= ops


def test_without_the_extension_host_graphs_replay_from_python_and_say_why(decoder, monkeypatch, caplog):
    monkeypatch.setattr(native_tape, "ENABLED", True)
    monkeypatch.setattr(native_tape, "_module", lambda: (None, "the native tape could not be built (no compiler)"))
    reference = copy.deepcopy(decoder)
    opt = graphopt.optimize(decoder, graphopt.GraphOptimizationConfig(graph_opt_level=1, max_num_seqs=4))
    ids, positions, slots = step_buffers(2, [5, 9])
    with torch.inference_mode():
        for _ in range(4):
            torch.testing.assert_close(opt(ids, positions, slots), reference(ids, positions, slots),
                                       atol=1e-4, rtol=1e-4)
            positions.add_(1)
    report = opt.report()
    assert report.replays >= 1
    assert report.fallback_counts[FallbackKind.SLOW_REPLAY] == len(report.captures)
