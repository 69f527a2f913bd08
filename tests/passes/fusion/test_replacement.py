"""graphopt.register_replacement: the reference's own example (add + rms_norm ->
add_rms_norm) adapted to CPU ops, vetoes, registration errors, and match counts in
report()."""

import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import graphopt
from graphopt.passes.fusion.replacement import USER_PATTERNS
from support import aot_graph, targets

EPS = 1e-6


@torch.library.custom_op("graphopt_test::add_rms_norm", mutates_args=())
def add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x1 + x2
    return torch.rms_norm(x, (x.shape[-1],), gamma, EPS), x


@add_rms_norm.register_fake
def _(x1, x2, gamma):
    return torch.empty_like(x1), torch.empty_like(x1)


def search_fn(x1, x2, gamma):
    x_out = torch.add(x1, x2)
    y = torch.rms_norm(x_out, (x_out.shape[-1],), gamma, EPS)
    return y, x_out


def replace_fn(x1, x2, gamma):
    y, x_out = torch.ops.graphopt_test.add_rms_norm(x1, x2, gamma)
    return y, x_out


class Block(torch.nn.Module):
    """Two residual adds each followed by an RMSNorm, as a decoder layer writes them."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.norm1 = torch.nn.RMSNorm(width, eps=EPS)
        self.norm2 = torch.nn.RMSNorm(width, eps=EPS)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x, residual):
        h = x + residual
        y = self.proj(self.norm1(h))
        h2 = y + h
        return self.norm2(h2), h2


@pytest.fixture
def registered():
    made = []

    def register(*args, **kwargs):
        made.append(graphopt.register_replacement(*args, **kwargs))
        return made[-1]

    yield register
    for pattern in made:
        pattern.remove()


def fake_examples():
    # The reference builds its examples under a FakeTensorMode; that must work too.
    with FakeTensorMode():
        tensor = functools.partial(torch.empty, (1, 1, 2), dtype=torch.float32)
        return tensor(), tensor(), torch.empty(2)


def run_block(level=1, freeze=False):
    torch.manual_seed(0)
    model = Block().eval()
    x, residual = torch.randn(4, 16), torch.randn(4, 16)
    config = graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=False,
                                              freeze_parameters=freeze)
    opt = graphopt.optimize(model, config)
    with torch.no_grad():
        expected, got = model(x, residual), opt(x, residual)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    return opt


def test_reference_example_replaces_add_and_rms_norm(registered):
    registered(search_fn, replace_fn, fake_examples())
    report = run_block().report()
    assert report.graphs[0].fused_ops.get("add_rms_norm") is None  # another namespace: not graphopt's
    record = next(p for p in report.passes if p.name == "user_replacements")
    assert record.counts == {"search_fn": 2}


def test_replacement_removes_the_decomposed_ops(registered):
    registered(search_fn, replace_fn, [torch.randn(2, 8), torch.randn(2, 8), torch.randn(8)])
    args = (torch.randn(3, 8), torch.randn(3, 8), torch.randn(8))
    graph = aot_graph(search_fn, *args)
    before = targets(graph)
    assert torch.ops.aten.rsqrt.default in before
    expected = graph(*args)

    result = USER_PATTERNS(graph.gm)
    graph.gm.recompile()

    after = targets(graph)
    assert result.counts == {"search_fn": 1}
    assert torch.ops.graphopt_test.add_rms_norm.default in after
    assert torch.ops.aten.rsqrt.default not in after and torch.ops.aten.mean.dim not in after
    assert len(after) == 3  # the fused op and the two getitems
    for a, b in zip(graph(*args), expected):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_extra_check_sees_shapes_and_can_veto(registered):
    seen = []

    def only_width_7168(match):
        x1 = match.kwargs["x1"]
        seen.append(tuple(x1.meta["val"].shape))
        return x1.meta["val"].shape[-1] == 7168

    registered(search_fn, replace_fn, fake_examples(), extra_check=only_width_7168)
    record = next(p for p in run_block().report().passes if p.name == "user_replacements")
    assert seen and all(shape[-1] == 16 for shape in seen)
    assert record.counts == {} and not record.changed


def test_applies_at_level_2(registered):
    if not graphopt._compat.inductor_available():
        pytest.skip("level 2 needs a C++ compiler")
    registered(search_fn, replace_fn, fake_examples())
    record = next(p for p in run_block(level=2).report().passes if p.name == "user_replacements")
    assert record.counts == {"search_fn": 2}


def test_removed_pattern_stops_applying(registered):
    pattern = graphopt.register_replacement(search_fn, replace_fn, fake_examples())
    pattern.remove()
    record = next(p for p in run_block().report().passes if p.name == "user_replacements")
    assert record.counts == {}


def test_replace_fn_with_other_outputs_is_an_error_at_registration():
    def only_norm(x1, x2, gamma):
        return torch.ops.graphopt_test.add_rms_norm(x1, x2, gamma)[0]

    with pytest.raises(ValueError, match="replace_fn returns .* but search_fn returns"):
        graphopt.register_replacement(search_fn, only_norm, fake_examples())


def test_replace_fn_computing_other_values_is_an_error_at_registration():
    def wrong(x1, x2, gamma):
        y, x_out = torch.ops.graphopt_test.add_rms_norm(x1, x2, gamma)
        return y * 2, x_out

    with pytest.raises(ValueError, match="output 0 of replace_fn differs"):
        graphopt.register_replacement(search_fn, wrong, fake_examples())


def test_untraceable_search_fn_is_an_error_at_registration():
    def data_dependent(x1, x2, gamma):
        if (x1 > 0).all():
            return x1 + x2, x2
        return x1, x2

    with pytest.raises(ValueError, match="search_fn cannot be traced"):
        graphopt.register_replacement(data_dependent, replace_fn, [torch.randn(2), torch.randn(2), torch.randn(2)])


def test_wrong_number_of_example_inputs_is_an_error():
    with pytest.raises(ValueError, match="takes 3 argument"):
        graphopt.register_replacement(search_fn, replace_fn, [torch.randn(2)])
    assert not USER_PATTERNS.patterns
