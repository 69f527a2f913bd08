"""graphopt.register_replacement: the reference's own example (add + rms_norm ->
add_rms_norm) adapted to CPU ops, vetoes, registration errors, match counts in
report(), and the fingerprint the compile cache keys user patterns by."""

import dataclasses
import functools
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from support import aot_graph, targets
from torch._subclasses.fake_tensor import FakeTensorMode

import graphopt
from graphopt import FallbackKind
from graphopt._compat import inductor
from graphopt.passes.fusion.replacement import USER_PATTERNS

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
    if not inductor.inductor_available():
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


# What an extra_check may read besides the match; the fingerprint must follow each
# (issue #25: a later process with another veto loaded the graph an earlier one made).
FLAG = True
settings = types.ModuleType("graphopt_test_settings")
settings.FLAG = True


def width(match) -> int:
    return match.kwargs["x1"].meta["val"].shape[-1]


def decide(flag: bool) -> bool:
    return flag


def reads_a_global(match):
    return FLAG


def calls_a_helper(match):
    return decide(True)


def has_a_default(match, limit=16):
    return width(match) <= limit


def has_a_keyword_default(match, *, limit=16):
    return width(match) <= limit


def reads_a_module(match):
    return settings.FLAG


def closing_over(check):
    def closure(match):
        return check(match)

    return closure


def flag_and_width(limit, match):
    return FLAG and width(match) <= limit


@dataclasses.dataclass
class Limit:
    """An extra_check as an object: its repr shows its state, never its code."""

    limit: int

    def __call__(self, match):
        return FLAG and width(match) <= self.limit

    def check(self, match):
        return FLAG and width(match) <= self.limit


def _change(monkeypatch, target, name, value):
    return lambda: monkeypatch.setattr(target, name, value)


MODULE = sys.modules[__name__]
CHANGES = {
    "a global's value": (lambda: reads_a_global, (MODULE, "FLAG", False)),
    "a helper's code": (lambda: calls_a_helper, (MODULE, "decide", lambda flag: not flag)),
    "a default argument": (lambda: has_a_default, (has_a_default, "__defaults__", (8,))),
    "a keyword default": (lambda: has_a_keyword_default, (has_a_keyword_default, "__kwdefaults__", {"limit": 8})),
    "a module's attribute": (lambda: reads_a_module, (settings, "FLAG", False)),
    "what a captured function reads": (lambda: closing_over(reads_a_global), (MODULE, "FLAG", False)),
    "what a partial's function reads": (lambda: functools.partial(flag_and_width, 16), (MODULE, "FLAG", False)),
    "what a bound method reads": (lambda: Limit(16).check, (MODULE, "FLAG", False)),
    "what a callable object reads": (lambda: Limit(16), (MODULE, "FLAG", False)),
}


@pytest.mark.parametrize("change", CHANGES)
def test_the_fingerprint_follows_what_an_extra_check_reads(registered, monkeypatch, change):
    make_check, (target, name, value) = CHANGES[change]
    registered(search_fn, replace_fn, fake_examples(), extra_check=make_check())
    before = USER_PATTERNS.fingerprint()
    assert USER_PATTERNS.fingerprint() == before
    monkeypatch.setattr(target, name, value)
    assert USER_PATTERNS.fingerprint() != before


@pytest.mark.fresh_cache
def test_an_extra_check_no_key_can_capture_is_applied_but_not_stored(registered):
    """A lock's only description is its address, which a later process may give
    another lock: the graphs it shapes are compiled every time, never stored."""
    lock = threading.Lock()

    def unlocked(match):
        return not lock.locked()

    registered(search_fn, replace_fn, fake_examples(), extra_check=unlocked)
    backend = graphopt.Backend(graphopt.GraphOptimizationConfig(graph_opt_level=2))
    # Inductor's FX graph cache does not keep them either
    assert backend.cache.pass_uuid(2, backend.cache.fingerprint()) == ""
    opt = run_block()
    report = opt.report()
    assert next(p for p in report.passes if p.name == "user_replacements").counts == {"search_fn": 2}
    # The builtin search patterns are stored (patterns/) when this is the process's first level 2.
    root = Path(opt.config.cache_dir)
    stored = [p for p in root.rglob("*") if p.is_file() and p.relative_to(root).parts[0] != "patterns"]
    assert report.cache_misses == 0 and not stored
    assert any("register_replacement(search_fn)" in reason for reason in report.reasons(FallbackKind.CACHE_OFF))
