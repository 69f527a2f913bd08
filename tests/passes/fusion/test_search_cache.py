"""Traced search patterns kept between processes: a pattern set registering its
patterns loads each traced search from the compile cache instead of tracing it, and
what it loads is the pattern it would have traced."""

import pytest
import torch
from support import aot_graph, targets
from torch._inductor import pattern_matcher

from graphopt._compat import patterns
from graphopt.passes.fusion import activation, eltwise, norm, replacement, rotary
from graphopt.passes.fusion.replacement import Pattern, PatternSet, searches_cached_in
from graphopt.report import Report

aten = torch.ops.aten


def relu_of_sum(x, y):
    return torch.relu(x + y)


def clamped_sum(x, y):
    return torch.clamp_min(x + y, 0.0)


def double_then_add(x, y):
    return x * 2 + y


def add_twice(x, y):
    return x + x + y


def pattern_set() -> PatternSet:
    examples = [torch.empty(4, 8), torch.empty(4, 8)]
    found = PatternSet("test_search_cache")
    found.add(Pattern("relu_of_sum", relu_of_sum, clamped_sum, examples, levels=(1,)))
    found.add(Pattern("double_then_add", double_then_add, add_twice, examples, levels=(1,)))
    return found


def graph():
    return aot_graph(lambda x, y: (torch.relu(x + y), x * 2 + y), torch.randn(4, 8), torch.randn(4, 8)).gm


@pytest.fixture
def traces(monkeypatch):
    """The searches traced from now on, in a process that has traced none."""
    monkeypatch.setattr(replacement, "_TRACED", {})
    made = []
    trace = pattern_matcher.gen_pattern_and_search_gm

    def counted(search_fn, *args, **kwargs):
        made.append(search_fn)
        return trace(search_fn, *args, **kwargs)

    monkeypatch.setattr(pattern_matcher, "gen_pattern_and_search_gm", counted)
    return made


def test_a_second_process_loads_the_searches_instead_of_tracing_them(tmp_path, traces, monkeypatch):
    with searches_cached_in(str(tmp_path), Report(level=1)):
        first = graph()
        assert pattern_set()(first).counts == {"relu_of_sum": 1, "double_then_add": 1}
    assert len(traces) == 2 and len(list(tmp_path.glob("patterns/*/*"))) == 2

    monkeypatch.setattr(replacement, "_TRACED", {})  # as a new process starts
    with searches_cached_in(str(tmp_path), Report(level=1)):
        second = graph()
        assert pattern_set()(second).counts == {"relu_of_sum": 1, "double_then_add": 1}
    assert len(traces) == 2, "a stored search was traced again"
    assert str(first.graph) == str(second.graph)
    assert aten.clamp_min.default in targets(second) and aten.relu.default not in targets(second)


def test_without_a_cache_one_search_is_traced_once_per_process(traces):
    for _ in range(2):
        assert pattern_set()(graph()).counts == {"relu_of_sum": 1, "double_then_add": 1}
    assert len(traces) == 2


def test_an_entry_naming_an_operator_this_torch_lacks_is_traced_instead(tmp_path, traces, monkeypatch):
    with searches_cached_in(str(tmp_path), Report(level=1)):
        pattern_set()(graph())
    monkeypatch.setattr(replacement, "_TRACED", {})
    monkeypatch.setattr(patterns, "_operator", _missing_operator)
    with searches_cached_in(str(tmp_path), Report(level=1)):
        assert pattern_set()(graph()).counts == {"relu_of_sum": 1, "double_then_add": 1}
    assert len(traces) == 4


def _missing_operator(namespace, name, overload):
    raise AttributeError(f"'_OpNamespace' '{namespace}' object has no attribute '{name}'")


@pytest.mark.parametrize("level", [1, 2])
def test_every_builtin_search_pattern_survives_the_round_trip_and_owns_its_key(level):
    """Each of the fusion library's searches, stored and loaded, is the pattern traced;
    and searches that share a key (so one is traced for all) trace to one pattern.
    Pattern factories make many functions of one name that differ only in what they
    capture: a key that missed that would hand one norm's search to another."""
    from graphopt.passes.fusion.replacement import _inductor_trace, _search_key, fwd_only

    printed = pattern_matcher.PatternPrettyPrinter.run
    by_key: dict[str, tuple[str, str, str]] = {}
    checked = 0
    for found in [norm.NORMS, activation.ACTIVATIONS, rotary.ROTARY, eltwise.ELTWISE]:
        for pattern in found.patterns:
            if level not in pattern.levels or pattern.search_fn_pattern is not None:
                continue
            trace = _inductor_trace if pattern.trace_fn is fwd_only and level == 2 else pattern.trace_fn
            traced, gm = pattern_matcher.gen_pattern_and_search_gm(
                pattern.search_fn, list(pattern.example_inputs), trace, pattern.scalar_workaround or {})
            [stored] = patterns._dump_search(traced, str(gm.graph))
            loaded, text = patterns._load_search(stored)
            assert printed(loaded) == printed(traced) and text == str(gm.graph), pattern.name
            key = _search_key(pattern, trace)
            first = by_key.setdefault(key, (pattern.name, printed(traced), text))
            assert first[1:] == (printed(traced), text), f"{pattern.name} shares a key with {first[0]}"
            checked += 1
    assert checked >= 10


def test_a_stored_pattern_with_pytree_leaves_loads_without_a_warning():
    """Inductor's patterns hold pytree specs, whose leaves are `LeafSpec`s: unpickled as
    such, torch 2.13 warned on stderr that the class is deprecated."""
    import warnings

    import torch.utils._pytree as pytree

    spec = pytree.tree_flatten([1, [2, 3]])[1]
    [data] = patterns._dump_search(spec, "a nested list")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded, text = patterns._load_search(data)
    assert loaded == spec and text == "a nested list"
