"""Candidates for running one graph, compared on the same inputs: first their outputs
against eager's, then their time side by side. The executors' race (an engine against
graphopt's code) and graph_opt_level="auto" (level 1 against level 2) both choose this way."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Hashable, Sequence, TypeVar

import torch

from ..config import tolerance

Name = TypeVar("Name", bound=Hashable)
# From this many rounds on, a race whose candidates' rounds stay this far apart is
# decided: the rounds left would only run the slow candidate again (on a 0.85B Llama,
# level 2 at 0.27 s a call beside level 1's 0.09 s: 3 s more of a call that stalls serving).
DECIDED_AFTER, DECIDED_BY = 3, 1.5


def first_unequal(got: Sequence[Any], expected: Sequence[Any], equal_nan: bool = False) -> int | None:
    """The index of the first tensor of `got` that is not eager's (`expected`) within
    config.py's tolerances (its shape, dtype or values), or None."""
    for i, (a, b) in enumerate(zip(got, expected)):
        if not isinstance(b, torch.Tensor):
            continue
        atol, rtol = tolerance(b.dtype)
        if a.shape != b.shape or a.dtype != b.dtype or not torch.allclose(a, b, atol=atol, rtol=rtol,
                                                                          equal_nan=equal_nan):
            return i
    return None


def how_unequal(got: torch.Tensor, expected: torch.Tensor) -> str:
    """How `got` differs from eager's `expected`, with the tolerance it is held to:
    "differs from eager's by up to 3.1e-03 (at |eager| = 0.52), beyond float32's |diff| <= 1e-04 + 1e-04 x |eager|"."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return (f"is {got.dtype} {tuple(got.shape)} where eager's is {expected.dtype} {tuple(expected.shape)}")
    atol, rtol = tolerance(expected.dtype)
    diff, scale = (got.double() - expected.double()).abs().flatten(), expected.double().abs().flatten()
    worst = int((diff - rtol * scale).nan_to_num(float("inf")).argmax())  # the element furthest past rtol
    name = str(expected.dtype).removeprefix("torch.")
    return (f"differs from eager's by up to {diff[worst].item():.2g} (at |eager| = {scale[worst].item():.2g}), "
            f"beyond {name}'s |diff| <= {atol:g} + {rtol:g} x |eager| (config.TOLERANCES)")


def median_seconds(candidates: dict[Name, Callable], args: Sequence[Any], rounds: int, round_seconds: float,
                   before_run: Callable[[], None] = lambda: None,
                   clock: Callable[[], float] = time.perf_counter) -> dict[Name, float]:
    """Each candidate's median seconds per call on `args`, over `rounds` interleaved rounds
    of at least `round_seconds` each (the machine's load falls on all alike), after one
    warm-up call each (captures and first-call costs are not the steady state).
    `before_run` runs untimed before every call (putting back what the last one wrote).
    Each call runs while the candidate's previous result is still held, as a caller that
    keeps its results (a benchmark, a list of embeddings) holds them: a candidate whose
    outputs live in its graph pool pays for copying the held one out, as it would then.
    Fewer rounds where the race is decided early (`_decided`)."""
    per_call: dict[Name, list[float]] = {name: [] for name in candidates}
    held: dict[Name, Any] = {}
    for name, fn in candidates.items():
        before_run()
        held[name] = fn(*args)  # as Dynamo calls what a backend returns
    for done in range(1, rounds + 1):
        for name, fn in candidates.items():
            spent, calls = 0.0, 0
            while spent < round_seconds or calls < 2:
                before_run()
                start = clock()
                held[name] = fn(*args)
                spent += clock() - start
                calls += 1
            per_call[name].append(spent / calls)
        if done >= DECIDED_AFTER and _decided(per_call):
            break
    return {name: statistics.median(times) for name, times in per_call.items()}


def _decided(per_call: dict[Name, list[float]]) -> bool:
    """The fastest candidate's slowest round is DECIDED_BY times faster than every other
    candidate's fastest round."""
    best = min(per_call, key=lambda name: statistics.median(per_call[name]))
    return all(max(per_call[best]) * DECIDED_BY < min(times) for name, times in per_call.items() if name != best)
