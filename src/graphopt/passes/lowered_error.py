"""How far a graph in lower precision is from full precision, in the terms its user reads.

    a causal LM's graph (a result over the vocabulary of an embedding it reads: its logits)
        -> judged by the mean KL divergence of its next-token distributions from full precision's
        -> reported beside it: greedy-token agreement, the largest error over the logits' magnitude
    any other graph
        -> judged by the largest error of its worst result over that result's largest magnitude

Why KL for a language model: its user reads tokens drawn from softmax(logits), so what
matters is how far that distribution moved. The largest error of one logit over the largest
logit says little of it: on Gemma-3 270M, int8 weights moved the largest logit error to 0.06
of the largest logit while keeping the greedy tokens of float32; and a greedy-token count on
the handful of positions of one call is decided by near-ties. The KL divergence weighs every
token by its probability: a near-tie flipped costs almost nothing, a distribution moved costs
in proportion. It is llama.cpp's measure of a quantization (`--kl-divergence`).

The KV cache a causal LM's graph writes is not judged on its own: its error reaches the
user through the logits of later steps, which the decode graph's own measure covers.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.fx

from ..config import GraphOptimizationConfig
from ..report_text import bound_name
from .base import vocabularies
from .precision import AGREEMENT_STEPS, label

aten = torch.ops.aten


def logits(vocab: set[int], expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor],
           steps: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first result whose last dim is one of `vocab` (the logits), at full and at lower
    precision, as [batch, positions, vocab] over the first `steps` positions of each
    sequence; None where no result is."""
    for e, a in zip(expected, actual):
        if isinstance(e, torch.Tensor) and e.dtype.is_floating_point and e.dim() >= 2 and e.shape[-1] in vocab \
                and e.numel():
            return tuple(t.reshape(t.shape[0], -1, t.shape[-1])[:, :steps] for t in (e, a))
    return None


def mean_kl(expected: torch.Tensor, actual: torch.Tensor) -> float:
    """The mean over positions of KL(softmax(expected) || softmax(actual)), in nats."""
    p, q = (torch.log_softmax(t.double(), dim=-1) for t in (expected, actual))
    return float((p.exp() * (p - q)).sum(-1).mean())


def token_agreement(gm: torch.fx.GraphModule, expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor],
                    steps: int) -> tuple[int, int] | None:
    """(agreeing, compared): how many greedy tokens (argmax over the vocabulary) of the
    graph's logits in `actual` equal full precision's in `expected`, over the first `steps`
    positions of each sequence. Each position's token is the one predicted from the same
    inputs (teacher-forced), not from an earlier token this graph chose. None where the
    graph has no logits."""
    pair = logits(vocabularies(gm), expected, actual, steps)
    return None if pair is None else _agreeing(*pair)


def _agreeing(expected: torch.Tensor, actual: torch.Tensor) -> tuple[int, int]:
    """(agreeing, compared) greedy tokens of two [batch, positions, vocab] logits."""
    same = expected.argmax(-1) == actual.argmax(-1)
    return int(same.sum()), same.numel()


def worst_error(expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor]) -> tuple[float, float, float]:
    """(relative, max abs, mean abs error) of the result whose error is largest relative to
    its largest magnitude. Per result, since a KV cache the graph writes, mostly zeros,
    would drown a mean over all of them. An integer result that differs (an argmax that
    flipped) makes the relative error infinite."""
    worst = (0.0, 0.0, 0.0)
    for e, a in zip(expected, actual):
        if not e.dtype.is_floating_point:
            worst = worst if torch.equal(e, a) else max(worst, (float("inf"), 0.0, 0.0))
        elif e.numel():
            diff = (e.double() - a.double()).abs()
            magnitude, largest = e.double().abs().max().item(), diff.max().item()
            relative = largest / magnitude if magnitude > 0 else (0.0 if largest == 0 else float("inf"))
            worst = max(worst, (relative, largest, diff.mean().item()))
    return worst


def error_record(dtype: str, expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor],
                 tolerance: float | None, vocab: set[int] = frozenset(), steps: int = 0,
                 slack: float = 1.0) -> dict[str, Any]:
    """The report's record of a lowering's error (`dtype`: what lowered it): `worst_error`'s
    figures; where a result is logits over one of `vocab`, their mean KL divergence from
    full precision's and the greedy-token agreement over `steps` positions; and whether the
    judged figure (the KL, else the relative error) is past `tolerance`, `slack` times
    precision_tolerance (precision.tolerance)."""
    relative, largest, mean = worst_error(expected, actual)
    record = {"dtype": dtype, "max_abs_error": largest, "mean_abs_error": mean, "relative_error": relative,
              "tolerance": tolerance, "slack": slack}
    pair = logits(vocab, expected, actual, steps) if vocab else None
    if pair is not None:
        agreeing, compared = _agreeing(*pair)
        record.update(logits_kl=mean_kl(*pair), token_agreement=agreeing / compared, tokens_compared=compared)
    judged = record.get("logits_kl", relative)
    record["fell_back"] = tolerance is not None and not judged <= tolerance
    return record


def measured_error(gm: torch.fx.GraphModule, expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor],
                   tolerance: float | None, slack: float = 1.0) -> dict[str, Any]:
    """How far `actual` (the lowered graph's results) is from `expected` (full precision's),
    as `error_record` judges it, with `gm`'s vocabularies and token_agreement_steps."""
    steps = gm.meta.get(AGREEMENT_STEPS, GraphOptimizationConfig.token_agreement_steps)
    return error_record(label(gm), expected, actual, tolerance, vocabularies(gm), steps, slack)


def over_tolerance(name: str, error: dict[str, Any]) -> str:
    """The fallback message of pass `name`'s error past its tolerance."""
    if "logits_kl" in error:
        figure = (f"the mean KL divergence of its next-token distributions from full precision's, "
                  f"{error['logits_kl']:.3g} nats (greedy tokens agree on {100 * error['token_agreement']:.3g}% of "
                  f"{error['tokens_compared']}),")
    else:
        figure = (f"the graph's error against full precision, max abs {error['max_abs_error']:.3g} (mean "
                  f"{error['mean_abs_error']:.3g}), is {error['relative_error']:.3g} of its output's largest "
                  "magnitude,")
    judged = error.get("logits_kl", error["relative_error"]) / error.get("slack", 1.0)
    return (f"{name} ({error['dtype']}): {figure} over {bound_name(error)}; the pass is undone for this graph "
            f"(precision_tolerance={_rounded_up(judged):g} or more would keep it)")


def _rounded_up(value: float) -> float:
    """`value` rounded up to two significant digits: a bound at least `value`."""
    if not 0 < value < float("inf"):
        return value
    step = 10.0 ** (math.floor(math.log10(value)) - 1)
    return round(math.ceil(value / step) * step, 12)


class Bound:
    """precision_tolerance over a graph's outputs as a whole (a level or an engine against
    eager), judged as `error_record` judges a pass: by the logits' KL where the graph has
    logits over one of `vocab`, else by the relative error."""

    def __init__(self, tolerance: float, vocab: set[int], steps: int, factor: float = 1.0):
        """`tolerance`: `factor` times precision_tolerance (int4's 3x, the level choice's 4x)."""
        self.tolerance, self.vocab, self.steps, self.factor = tolerance, vocab, steps, factor
        self.name = "precision_tolerance" if factor == 1.0 else f"{factor:g}x precision_tolerance"

    def times(self, factor: float) -> Bound:
        """This bound loosened `factor` times."""
        return Bound(self.tolerance * factor, self.vocab, self.steps, self.factor * factor)

    def past(self, expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor],
             reference: str = "eager") -> str | None:
        """Why `actual` is past the bound from `expected` (`reference`'s results), or None."""
        error = error_record("", expected, actual, self.tolerance, self.vocab, self.steps)
        if not error["fell_back"]:
            return None
        if "logits_kl" in error:
            return (f"has logits whose next-token distributions are {error['logits_kl']:.3g} nats (mean KL) from "
                    f"{reference}'s, over {self.name}={self.tolerance:g}")
        return f"has an error of {error['relative_error']:.3g} of an output's largest magnitude against " \
               f"{reference}'s, over {self.name}={self.tolerance:g}"
