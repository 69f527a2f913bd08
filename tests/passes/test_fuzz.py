"""Differential fuzzing of the level-1 pipeline: random programs against eager.

A program is ~30 operations over a pool of values, all with the batch as dim 0
(dynamic): elementwise ops, matmuls against parameters, reductions, views and
reshapes, transposes, cat/split, softmax, where, written-out norms (Gemma's residual
add + RMSNorm scaled by `1 + w` too), in-place ops on fresh values, constants built
from factories, integer arithmetic, and identities and duplicates put there on
purpose for the cleanup passes to find. Each program runs through `graphopt.optimize`
at level 1 (parameters frozen or not) at two batch sizes, and must match eager within
`graphopt.config.tolerance` with no fallback (no pass undone).

The default suite runs a fast profile; `pytest -m slow` runs the long one.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_memory_plan import check_plan

import graphopt
from graphopt.config import tolerance

BATCHES = (3, 5)
WIDTHS = (2, 4, 6, 8)
MAX_WIDTH = 16


@dataclass(frozen=True)
class Op:
    """One operation: the pool values it reads (a letter each: `f` a float value, `b`
    a float that broadcasts against the first, `s` a float of the same width as the
    first, `i` an integer value); `run(*values, k, w)`, which computes its results
    from them, a drawn integer `k` and its own parameter `w` (None unless `weight`
    gives the parameter's shape); and the kinds and widths of its results."""

    operands: str
    run: Callable
    outputs: Callable[[list[int], int], list[tuple[str, int]]] = lambda widths, k: [("f", widths[0])]
    weight: Callable[[list[int], int], tuple[int, ...]] | None = None


def _inplace(x, b):
    y = x * 1.5                 # a fresh value, written in place twice
    y.add_(b)
    return (y.mul_(0.5),)


def _slice_write(x, k):
    y = x.clone()
    y[:, : k % x.shape[1] + 1] = 0.25
    return (y,)


def _aliased_clone(x):
    c = x.clone()
    before = c * 1              # must keep the value from before the write
    c.add_(1)
    return before, c


def _layer_norm(x, w):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return ((x - mean) * torch.rsqrt(var + 1e-5) * w + 0.1,)


def _rms_norm(x, w):
    x32 = x.to(torch.float32)
    return (w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)),)


def _offset_rms_norm(x, r, w):
    """Gemma's block: a residual add, an RMSNorm scaled by `1 + w` (computed after the
    norm, so it comes after the add in the graph), and the residual read again."""
    h = x + r
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    return normed, normed + h


def _split(x, k):
    first = k % (x.shape[1] - 1) + 1
    return tuple(torch.split(x, [first, x.shape[1] - first], dim=-1))


def _split_widths(widths, k):
    first = k % (widths[0] - 1) + 1
    return [("f", first), ("f", widths[0] - first)]


def _projected(widths, k):
    return [("f", WIDTHS[k % len(WIDTHS)])]


def _row(widths, k):
    return (widths[0],)


def _out_in(widths, k):
    return (WIDTHS[k % len(WIDTHS)], widths[0])


def _column(widths, k):
    return [("f", 1)]


def _half(x):
    return x.view(x.shape[0], 2, -1)


OPS: dict[str, Op] = {
    # elementwise
    "relu": Op("f", lambda x, k, w: (torch.relu(x),)),
    "tanh": Op("f", lambda x, k, w: (torch.tanh(x),)),
    "sigmoid": Op("f", lambda x, k, w: (torch.sigmoid(x),)),
    "sin": Op("f", lambda x, k, w: (torch.sin(x) * 2,)),
    "sqrt_abs": Op("f", lambda x, k, w: (x.abs().sqrt(),)),
    "log": Op("f", lambda x, k, w: (x.log(),)),        # NaN and -inf, on purpose
    "add": Op("fb", lambda x, y, k, w: (x + y,)),
    "sub": Op("fb", lambda x, y, k, w: (x - y,)),
    "mul": Op("fb", lambda x, y, k, w: (x * y,)),
    "div": Op("fb", lambda x, y, k, w: (x / (y.abs() + 1),)),
    "maximum": Op("fs", lambda x, y, k, w: (torch.maximum(x, y),)),
    "where": Op("fs", lambda x, y, k, w: (torch.where(x > y, x, y),)),
    # matmuls against parameters
    "linear": Op("f", lambda x, k, w: (F.linear(x, w),), _projected, _out_in),
    "matmul_tt": Op("f", lambda x, k, w: (x @ w.t().t().t(),), _projected, _out_in),
    "scaled_weight": Op("f", lambda x, k, w: (x @ (w * 0.5).t(),), _projected, _out_in),
    # reductions, softmax, written-out norms
    "sum": Op("f", lambda x, k, w: (x.sum(-1, keepdim=True),), _column),
    "mean": Op("f", lambda x, k, w: (x.mean(-1, keepdim=True),), _column),
    "amax": Op("f", lambda x, k, w: (x.amax(-1, keepdim=True),), _column),
    "softmax": Op("f", lambda x, k, w: (torch.softmax(x, -1),)),
    "layer_norm": Op("f", lambda x, k, w: _layer_norm(x, w), weight=_row),
    "rms_norm": Op("f", lambda x, k, w: _rms_norm(x, w), weight=_row),
    "offset_rms_norm": Op("fs", lambda x, r, k, w: _offset_rms_norm(x, r, w),
                          lambda widths, k: [("f", widths[0])] * 2, weight=_row),
    # views, reshapes, transposes, cat/split (the view ops need an even width)
    "swap_halves": Op("f", lambda x, k, w: (_half(x).transpose(1, 2).reshape(x.shape[0], -1),)),
    "view_chain": Op("f", lambda x, k, w: (_half(x).view(x.shape[0], -1, 1).view(x.shape[0], -1) + 1,)),
    "transpose_twice": Op("f", lambda x, k, w: (_half(x).transpose(1, 2).transpose(1, 2).reshape(x.shape[0], -1),)),
    "permute_cancel": Op("f", lambda x, k, w: (x[:, None].permute(2, 0, 1).permute(1, 2, 0)[:, 0] * 2,)),
    "contiguous_t": Op("f", lambda x, k, w: (x.t().contiguous().t() - 1,)),
    "cat": Op("ff", lambda x, y, k, w: (torch.cat([x, y], -1),),
              lambda widths, k: [("f", widths[0] + widths[1])]),
    "split": Op("f", lambda x, k, w: _split(x, k), _split_widths),
    "cat_split": Op("ff", lambda x, y, k, w: tuple(torch.cat([x, y * 2], -1).split([x.shape[1], y.shape[1]], -1)),
                    lambda widths, k: [("f", widths[0]), ("f", widths[1])]),
    # in-place ops on fresh values
    "inplace": Op("fb", lambda x, y, k, w: _inplace(x, y)),
    "slice_write": Op("f", lambda x, k, w: _slice_write(x, k)),
    "aliased_clone": Op("f", lambda x, k, w: _aliased_clone(x), lambda widths, k: [("f", widths[0])] * 2),
    # constants (folded), and identities the cleanup passes must remove, or keep
    "cos_table": Op("f", lambda x, k, w: (x * (torch.arange(x.shape[1]) * 0.1 + k).cos(),)),
    "ones": Op("f", lambda x, k, w: (x * torch.ones(x.shape[1]) + torch.zeros(x.shape[1]),)),
    "identities": Op("f", lambda x, k, w: ((x * 1 + 0 - 0) / 1 ** 1,)),
    "pow_one": Op("f", lambda x, k, w: (x ** 1,)),
    "times_zero": Op("f", lambda x, k, w: (x * 0,)),    # NaN for NaN and inf: must stay
    "neg_neg": Op("f", lambda x, k, w: (-(-x),)),
    "same_views": Op("f", lambda x, k, w: (x[:, :].view(x.shape).expand(x.shape).clone(),)),
    "cat_one": Op("f", lambda x, k, w: (torch.cat([x], -1),)),
    "exact_casts": Op("f", lambda x, k, w: (x.to(torch.float64).to(torch.float32),)),
    "lossy_casts": Op("f", lambda x, k, w: (x.to(torch.float16).to(torch.float32),)),
    "where_same": Op("f", lambda x, k, w: (torch.where(x > 0, x, x),)),
    # integers
    "to_int": Op("f", lambda x, k, w: ((x > 0).to(torch.int64) * (k + 2) - 1,), lambda widths, k: [("i", widths[0])]),
    "int_identities": Op("i", lambda i, k, w: (i * 1 + 0 - i * 0,), lambda widths, k: [("i", widths[0])]),
    "int_zero_sum": Op("i", lambda i, k, w: (i + (i * 0).sum(),), lambda widths, k: [("i", widths[0])]),
    "int_to_float": Op("is", lambda i, x, k, w: (i.to(torch.float32) * x,)),
}
_NEEDS_EVEN_WIDTH = ("swap_halves", "view_chain", "transpose_twice")


@dataclass(frozen=True)
class Program:
    widths: tuple[int, ...]                               # of every pool value, inputs first
    steps: tuple[tuple[str, tuple[int, ...], int], ...]   # (op, pool indices read, k)
    freeze: bool

    def __repr__(self) -> str:
        lines = [f"Program(freeze_parameters={self.freeze}, x: [b, {self.widths[0]}], y: [b, {self.widths[1]}])"]
        lines += [f"  {name}({', '.join(f'v{a}' for a in args)}, k={k})" for name, args, k in self.steps]
        return "\n".join(lines)


@st.composite
def programs(draw, min_ops: int = 20, max_ops: int = 34) -> Program:
    pool: list[tuple[str, int]] = [("f", draw(st.sampled_from(WIDTHS))), ("f", draw(st.sampled_from(WIDTHS)))]
    steps: list[tuple[str, tuple[int, ...], int]] = []
    length = draw(st.integers(min_ops, max_ops))
    while len(steps) < length:
        if steps and draw(st.integers(0, 7)) == 0:
            step = draw(st.sampled_from(steps))       # a duplicate, on purpose, for CSE
        else:
            name = draw(st.sampled_from(sorted(OPS)))
            args = _operands(draw, OPS[name].operands, pool)
            if args is None or (name in _NEEDS_EVEN_WIDTH and pool[args[0]][1] % 2):
                continue
            step = (name, args, draw(st.integers(0, 7)))
        name, args, k = step
        outputs = OPS[name].outputs([pool[a][1] for a in args], k)
        if all(width <= MAX_WIDTH for _, width in outputs):
            pool.extend(outputs)
            steps.append(step)
    return Program(tuple(width for _, width in pool), tuple(steps), draw(st.booleans()))


def _operands(draw, kinds: str, pool: list[tuple[str, int]]) -> tuple[int, ...] | None:
    chosen: list[int] = []
    for kind in kinds:
        first = pool[chosen[0]][1] if chosen else None
        fits = [i for i, (k, width) in enumerate(pool)
                if k == ("i" if kind == "i" else "f")
                and (kind != "s" or width == first) and (kind != "b" or width in (first, 1))
                and (chosen or width > 1)]            # the first operand is a real row
        if not fits:
            return None
        chosen.append(draw(st.sampled_from(fits)))
    return tuple(chosen)


class ProgramModule(torch.nn.Module):
    """Runs a Program as straight-line code (what Dynamo traces fastest). Each step
    with a `weight` has its own parameter `w<step>`."""

    def __init__(self, program: Program):
        super().__init__()
        generator = torch.Generator().manual_seed(len(program.steps))
        lines, results, read = ["def forward(self, x, y):", "    v0, v1 = x, y"], 2, set()
        for index, (name, args, k) in enumerate(program.steps):
            op, widths = OPS[name], [program.widths[a] for a in args]
            weight = "None"
            if op.weight is not None:
                shape = op.weight(widths, k)
                weight = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
                setattr(self, f"w{index}", torch.nn.Parameter(weight))
                weight = f"self.w{index}"
            count = len(op.outputs(widths, k))
            outputs = "".join(f"v{results + i}, " for i in range(count))
            lines.append(f"    {outputs}= OPS[{name!r}].run({''.join(f'v{a}, ' for a in args)}{k}, {weight})")
            results += count
            read.update(args)
        lines.append(f"    return ({''.join(f'v{i}, ' for i in range(results) if i not in read)})")
        self.source = "\n".join(lines)   # every value nobody read is returned
        namespace: dict = {"OPS": OPS}
        exec(self.source, namespace)  # noqa: S102 - the program is ours
        self.forward = types.MethodType(namespace["forward"], self)


def check_program(program: Program) -> None:
    torch._dynamo.reset()  # a fresh start: every program is a new graph for the same code
    model = ProgramModule(program).eval()
    # No compile cache: the examples share one test's directory, and a program whose
    # graph another one stored would skip the passes this test is about.
    config = graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False,
                                              freeze_parameters=program.freeze, cache_dir=None)
    optimized = graphopt.optimize(model, config)
    with torch.no_grad():
        for batch in BATCHES:
            generator = torch.Generator().manual_seed(batch)
            x = torch.randn(batch, program.widths[0], generator=generator)
            y = torch.randn(batch, program.widths[1], generator=generator)
            expected, actual = model(x, y), optimized(x, y)
            assert len(actual) == len(expected)
            for i, (e, a) in enumerate(zip(expected, actual)):
                atol, rtol = tolerance(e.dtype)
                assert a.shape == e.shape and a.dtype == e.dtype, f"output {i} at batch {batch}"
                torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=True,
                                           msg=lambda m: f"output {i} at batch {batch}: {m}")
    report = optimized.report()
    assert report.graphs, "nothing was compiled"
    assert not report.fallbacks, f"fallbacks (a pass undone?): {dict(report.fallbacks)}"
    for gm in optimized.graphs():  # buffers alive at once never share arena bytes
        check_plan(gm, gm.meta["graphopt_memory"])


FUZZ = settings(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@settings(FUZZ, max_examples=50)
@given(programs())
def test_optimized_programs_match_eager(program):
    check_program(program)


@pytest.mark.slow
@settings(FUZZ, max_examples=2000, derandomize=False)
@given(programs())
def test_optimized_programs_match_eager_long(program):
    check_program(program)
