"""quantize_weights keeps a product's float weight where its int8 or int4 kernel is slower
at the traced rows (quantize_timing.py): on all-MiniLM-L6-v2 at batch 16 int8 weights
made the encoder 1.9x slower than float32 eager."""

import pytest
import torch

import graphopt
from graphopt.passes import quantize_timing

aten = torch.ops.aten


class Wide(torch.nn.Module):
    """Two linears whose weights (256 x 256) are large enough to be timed, and one too
    small to be (64 x 256)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def quantized(fmt, x):
    torch.manual_seed(0)
    model = Wide().eval()
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, use_cudagraph=False, cache_dir=None, freeze_parameters=True, weight_quantization=fmt,
        precision_tolerance=0.2))
    with torch.no_grad():
        out, expected = opt(x), model(x)
    return opt, out, expected


@pytest.fixture
def weight_only_slower(monkeypatch):
    """A clock on which every weight-only kernel takes 2 s a call and a float GEMM 1 s."""
    monkeypatch.setattr(quantize_timing, "_LOSES", {})
    monkeypatch.setattr(quantize_timing, "_seconds", lambda fn: 2.0 if fn.__name__ == "weight_only" else 1.0)


# The small one is not timed; under int4 it is the MLP's output projection, in int8 (roles.py).
@pytest.mark.parametrize("fmt, small", [("int8", "quantized"), ("int4", "int8 by role")])
def test_a_kernel_slower_than_the_float_gemm_keeps_the_float_weight(fmt, small, weight_only_slower):
    opt, out, expected = quantized(fmt, torch.randn(4, 256))
    counts = {p.name: p.counts for p in opt.report().passes}["quantize_weights"]
    assert counts == {"slower": 2, small: 1}
    torch.testing.assert_close(out, expected, atol=0.05, rtol=0.05)


def test_a_faster_kernel_is_kept_and_each_shape_is_timed_once(monkeypatch):
    monkeypatch.setattr(quantize_timing, "_LOSES", {})
    timed = []

    def seconds(fn):
        timed.append(fn)
        return 1.0 if fn.__name__ == "weight_only" else 2.0

    monkeypatch.setattr(quantize_timing, "_seconds", seconds)
    opt, out, expected = quantized("int8", torch.randn(4, 256))
    assert {p.name: p.counts for p in opt.report().passes}["quantize_weights"] == {"quantized": 3}
    assert len(quantize_timing._LOSES) == 1  # a and b share a shape; c is too small to time
    # The weight-only kernel and each float GEMM, in interleaved rounds.
    sides = 1 + len(quantize_timing._float_gemms(torch.randn(4, 256), torch.randn(256, 256)))
    assert len({id(fn) for fn in timed}) == sides and len(timed) == sides * quantize_timing._ROUNDS
    assert [fn.__name__ for fn in timed[:sides]] == ["weight_only"] + ["<lambda>"] * (sides - 1)


def test_the_timing_runs_each_kernel_at_the_traced_rows():
    """No clock faked: the kernels and the float GEMMs run, and the answer is remembered."""
    quantize_timing._LOSES.clear()
    first = quantize_timing.loses("int8", 8, 512, 256, torch.float32)
    assert quantize_timing.loses("int8", 8, 512, 256, torch.float32) is first
    assert list(quantize_timing._LOSES) == [("int8", 8, 512, 256, torch.float32, torch.get_num_threads())]
    assert quantize_timing.loses("int4", 8, 64, 256, torch.float32) is False  # too small to time


def test_each_side_is_timed_over_copies_read_from_memory_not_from_the_cache():
    """A weight timed alone stays in the cache between calls, where a model's step reads
    its weights from memory: the float side's 4x bytes would go unpaid."""
    weight = torch.randn(640, 2048)
    copies = quantize_timing._copies(weight)
    assert sum(c.nbytes for c in copies) >= quantize_timing.COLD_BYTES
    assert len({c.data_ptr() for c in copies}) == len(copies) and all(torch.equal(c, weight) for c in copies)
    assert len(quantize_timing._copies(torch.empty(quantize_timing.COLD_BYTES // 4 + 1))) == 1
