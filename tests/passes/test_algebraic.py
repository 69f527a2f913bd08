"""simplify_algebra: each identity, and the cases where it must not fire."""

import math

import pytest
import torch
from support import aot_graph, targets
from torch.fx.experimental.proxy_tensor import make_fx

from graphopt.passes.algebraic import simplify_algebra
from graphopt.passes.constant_fold import fold_constants

aten = torch.ops.aten

SPECIALS = torch.tensor([1.5, -2.0, 0.0, -0.0, math.inf, -math.inf, math.nan])


def simplified(fn, *args):
    """The graph of `fn` after simplify_algebra, checked to compute what it did."""
    gm = make_fx(fn)(*args)
    expected = gm(*args)
    result = simplify_algebra(gm)
    gm.graph.lint()
    gm.recompile()
    actual = gm(*args)
    for e, a in zip(expected, actual) if isinstance(expected, tuple) else [(expected, actual)]:
        torch.testing.assert_close(a, e, atol=0, rtol=0, equal_nan=True)
    return gm, result


@pytest.mark.parametrize("name, fn", [
    ("x*1", lambda x: x * 1),
    ("1*x", lambda x: 1 * x),
    ("x/1", lambda x: x / 1),
    ("x**1", lambda x: x ** 1),
    ("x+0", lambda x: x + 0),
    ("0+x", lambda x: 0 + x),
    ("x-0", lambda x: x - 0),
    ("x-0 with alpha", lambda x: torch.sub(x, 0, alpha=3)),
    ("x*ones", lambda x: x * torch.ones(7)),
    ("x+zeros", lambda x: x + torch.zeros(7)),
    ("x*full(1)", lambda x: x * torch.full((7,), 1.0)),
    ("where(c, x, x)", lambda x: torch.where(x > 0, x, x)),
])
def test_identities_are_removed_for_every_float(name, fn):
    gm, result = simplified(lambda x: fn(x).relu(), SPECIALS.clone())
    assert result.counts == {"identities": 1}, name
    assert targets(gm)[-1] is aten.relu.default
    assert [n for n in gm.graph.nodes if n.target is aten.relu.default][0].args[0].op == "placeholder"


def test_a_chain_of_identities_goes_in_one_pass():
    gm, result = simplified(lambda x: ((x * 1 + 0) ** 1 / 1).exp(), SPECIALS.clone())
    assert result.counts == {"identities": 4}
    assert targets(gm) == [aten.exp.default]


def test_an_identity_that_would_promote_the_dtype_stays():
    """int * 1.0 is a float tensor: dropping the multiplication would change the dtype."""
    gm, result = simplified(lambda i: (i * 1.0).sum(), torch.arange(5))
    assert not result.changed
    assert aten.mul.Tensor in targets(gm)


def test_an_identity_that_would_drop_a_broadcast_stays():
    gm, result = simplified(lambda x: (x * torch.ones(3, 4)).sum(0), torch.randn(4))
    assert not result.changed


def test_add_with_a_non_unit_alpha_on_the_left_zero_stays():
    """0 + 2*x is not x."""
    gm, result = simplified(lambda x: torch.add(torch.zeros(3), x, alpha=2), torch.randn(3))
    assert not result.changed


def test_division_with_a_rounding_mode_stays():
    gm, result = simplified(lambda x: torch.div(x, 1, rounding_mode="floor"), torch.randn(4) * 10)
    assert not result.changed


def test_float_times_zero_stays():
    """NaN*0 and inf*0 are NaN and -1*0 is -0.0: x*0 is not zeros for floats."""
    gm, result = simplified(lambda x: (x.log() * 0).sum(), torch.tensor([-1.0, 0.0, 2.0]))
    assert not result.changed
    assert aten.mul.Tensor in targets(gm)


def test_integer_times_zero_is_zeros_and_its_sum_is_folded():
    def fn(i, x):
        return x + (i * 0).sum(), x * (i * 0)

    i, x = torch.arange(6).view(2, 3), torch.randn(2, 3)
    gm, result = simplified(fn, i, x)
    assert result.counts == {"zeros": 3}  # two products, then the sum of zeros
    assert aten.sum.default not in targets(gm)
    assert targets(gm).count(aten.zeros_like.default) == 1  # the second product

    assert fold_constants(gm).counts == {"folded": 1}  # zeros([]) becomes an attribute
    gm.recompile()
    torch.testing.assert_close(gm(i, x), fn(i, x))


def test_an_identity_on_a_value_written_later_stays():
    def fn(x):
        y = x * 2
        z = y * 1        # a copy of y taken before the write below
        y.add_(1)
        return z, y

    gm, result = simplified(fn, torch.randn(3))
    assert not result.changed


def test_an_output_never_becomes_the_input():
    graph = aot_graph(lambda x: x * 1, torch.randn(3))
    assert not simplify_algebra(graph.gm).changed
    assert targets(graph) == [aten.mul.Tensor]
