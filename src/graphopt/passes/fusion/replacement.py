"""Pattern replacement: `graphopt.register_replacement` and the sets of patterns the
fusion library is made of, on top of Inductor's pattern matcher.

A pattern is a function (`search_fn`) traced into an ATen graph; every place the
optimized graph computes the same thing is replaced by `replace_fn` traced with the
matched values. A pattern is traced the way the graph it runs on was decomposed:
at level 1 as AOTAutograd decomposes (composite ops only), at level 2 with
Inductor's decompositions too, so one registration matches at both levels.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading
import types
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx

from ... import cache_trust
from ..._compat import fake, patterns
from ..._compat.names import tree_flatten
from ...cache import CompileCache, cache_key
from ...config import tolerance
from ...report import Report
from ..base import PassResult
from .fingerprint import Unkeyable, fingerprint


def fwd_only(fn: Callable, args: Sequence[Any], **_: Any) -> torch.fx.GraphModule:
    """Trace `fn(*args)` into the functional ATen graph graphopt's level-1 passes see
    (composite ops decomposed as AOTAutograd decomposes them, nothing more)."""
    return patterns.trace_forward(fn, args, {})


def _inductor_trace(fn: Callable, args: Sequence[Any], **_: Any) -> torch.fx.GraphModule:
    return patterns.trace_forward(fn, args, patterns.inductor_decompositions())


def _always(match: Any) -> bool:
    return True


@dataclass(eq=False)  # a registration is itself: remove() finds it by identity
class Pattern:
    """One replacement, and the levels it applies at."""

    name: str
    search_fn: Callable
    replace_fn: Callable
    example_inputs: Sequence[Any]
    trace_fn: Callable = fwd_only
    extra_check: Callable[[Any], bool] = _always
    scalar_workaround: dict[str, Any] | None = None
    search_fn_pattern: Any = None
    levels: tuple[int, ...] = (1, 2)
    owner: PatternSet | None = None

    def remove(self) -> None:
        """Stop applying this pattern in graphs optimized from now on."""
        if self.owner is not None:
            self.owner.remove(self)


@dataclass
class PatternSet:
    """Patterns applied together as one pass. Registration with the matcher is lazy
    (tracing a pattern is slow: docs/fusion.md, "Your own fusions") and redone when
    the set changes."""

    name: str
    patterns: list[Pattern] = field(default_factory=list)
    _matchers: dict[int, tuple[Any, Counter]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, pattern: Pattern) -> Pattern:
        with self._lock:
            pattern.owner = self
            self.patterns.append(pattern)
            self._matchers.clear()
        return pattern

    def remove(self, pattern: Pattern) -> None:
        with self._lock:
            self.patterns.remove(pattern)
            self._matchers.clear()

    def fingerprint(self) -> str:
        """What the set's patterns decide, for cache keys: each pattern's name, levels,
        example input types and every callable or value that decides a rewrite, with
        what it reads (`_fingerprint`). Raises Unkeyable where that cannot be captured."""
        with self._lock:
            return "\n".join(_pattern_fingerprint(p) for p in self.patterns)

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        """Replace every match of the set's patterns for the graph's level
        (`gm.meta["graphopt_level"]`, 1 when unset); counts are per pattern."""
        matcher, counts = self._matcher(gm.meta.get("graphopt_level", 1))
        counts.clear()
        matched = matcher.apply(gm) if matcher.patterns else 0
        if matched:
            _inputs_first(gm.graph)
            gm.graph.eliminate_dead_code()
        return PassResult(changed=matched > 0, counts={k: v for k, v in counts.items() if v})

    def _matcher(self, level: int) -> tuple[Any, Counter]:
        with self._lock:
            if level not in self._matchers:
                matcher, counts = patterns.pattern_matcher_pass(self.name), Counter()
                for pattern in self.patterns:
                    if level in pattern.levels:
                        _register(pattern, matcher, counts, level)
                self._matchers[level] = (matcher, counts)
            return self._matchers[level]


def _examples(pattern: Pattern) -> list[Any]:
    return [f"tensor {tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else x
            for x in pattern.example_inputs]


def _pattern_fingerprint(pattern: Pattern) -> str:
    examples = _examples(pattern)
    parts = [pattern.name, repr(pattern.levels)]
    for role in ("search_fn", "replace_fn", "extra_check", "trace_fn", "search_fn_pattern", "scalar_workaround"):
        try:
            parts.append(fingerprint(getattr(pattern, role)))
        except Unkeyable as why:
            raise Unkeyable(f"the {role} of register_replacement({pattern.name}) reads {why}, which no "
                            "cache key can capture") from None
    return " ".join(parts + [fingerprint(examples)])


def _inputs_first(graph: torch.fx.Graph) -> None:
    """Move each node that reads a value defined after it to just after its last
    input, with everything that reads it; the order of the rest is kept.

    Inductor's matcher inserts a replacement before the first output of its match
    (and Inductor sorts the graph after its own passes). An argument computed
    between the match's outputs would be read before it is defined: Gemma's
    `residual + x` is the first output of add + RMSNorm, and its `1 + weight` is
    computed after the norm it scales."""
    defined: set[torch.fx.Node] = set()
    waiting: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    last = None
    pending = list(reversed(graph.nodes))
    while pending:
        node = pending.pop()
        missing = [n for n in node.all_input_nodes if n not in defined]
        if missing:  # comes back when that input is placed, to check the others
            waiting.setdefault(missing[-1], []).append(node)
            continue
        defined.add(node)
        if last is not None and last.next is not node:
            last.append(node)
        last = node
        pending.extend(reversed(waiting.pop(node, [])))


# Where traced search patterns are kept between processes: the compile cache of the
# pipeline that is running (PassManager sets it), or None.
_SEARCH_CACHE: contextvars.ContextVar[CompileCache | None] = contextvars.ContextVar("graphopt_search_cache",
                                                                                     default=None)


# Search patterns traced or loaded in this process, by _search_key: a search that several
# patterns share is traced once, and a pattern set registered again reads no file.
_TRACED: dict[str, bytes] = {}


@contextlib.contextmanager
def searches_cached_in(directory: str | None, report: Report) -> Iterator[None]:
    """Inside, a pattern set registering its patterns loads each traced search pattern
    from the compile cache in `directory` (None: no cache; they are kept in its
    `patterns/`, apart from the graphs), or traces it and stores it there: tracing
    them is a large part of a small model's first level-1 compile (docs/compile-cache.md)."""
    token = _SEARCH_CACHE.set(CompileCache(Path(directory) / "patterns", report) if _trusted(directory) else None)
    try:
        yield
    finally:
        _SEARCH_CACHE.reset(token)


def _trusted(directory: str | None) -> bool:
    """The graph cache reports a directory it refuses; its patterns/ is not used either."""
    try:
        return directory is not None and cache_trust.check_directory(Path(directory)) is None
    except (cache_trust.Untrusted, OSError):
        return False


def _search_key(pattern: Pattern, trace: Callable) -> str | None:
    """What decides the traced search pattern (graphopt's and torch's versions are in
    every key), or None where a function reads what no key can capture."""
    try:
        parts = [_identity(pattern.search_fn), fingerprint(trace), fingerprint(pattern.scalar_workaround),
                 fingerprint(_examples(pattern))]
    except Unkeyable:
        return None
    return cache_key("search pattern", *parts)


def _identity(value: Any, depth: int = 0) -> str:
    """`fingerprint`, with what a function captures keyed even where `fingerprint` names
    the function alone (graphopt's own: its version is in every key). Pattern factories
    make many functions of one name, told apart only by their cells and defaults."""
    if depth > 8:
        raise Unkeyable("functions captured more than 8 deep")
    if isinstance(value, functools.partial):
        return f"partial {_identity(value.func, depth + 1)} {_identity(value.args, depth + 1)} " \
               f"{_identity(value.keywords, depth + 1)}"
    if isinstance(value, types.FunctionType):
        cells = [_identity(_contents(cell), depth + 1) for cell in value.__closure__ or ()]
        return f"{fingerprint(value)} cells ({', '.join(cells)}) defaults " \
               f"{_identity(value.__defaults__, depth + 1)} {_identity(value.__kwdefaults__, depth + 1)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}({', '.join(_identity(v, depth + 1) for v in value)})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{fingerprint(k)}: {_identity(v, depth + 1)}" for k, v in value.items()) + "}"
    return fingerprint(value)


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # not assigned yet: a function that refers to itself, being defined
        return "<empty cell>"


def _register(pattern: Pattern, matcher: Any, counts: Counter, level: int) -> None:
    # The replacement is traced like the search: at level 2 with Inductor's
    # decompositions, since an op Inductor decomposes (gelu, prelu) cannot be put
    # back into its post-grad graph.
    trace = _inductor_trace if pattern.trace_fn is fwd_only and level == 2 else pattern.trace_fn
    cache = _SEARCH_CACHE.get()
    key = _search_key(pattern, trace) if pattern.search_fn_pattern is None else None
    known = _TRACED.get(key) if key else None
    if key and known is None and cache is not None:
        known = cache.load(key)
    entries, traced = patterns.register_pattern(
        pattern.search_fn, pattern.replace_fn, pattern.example_inputs, trace, matcher,
        pattern.extra_check, pattern.scalar_workaround, pattern.search_fn_pattern, traced=known)
    if key and traced is not None:
        _TRACED[key] = traced
        if cache is not None:
            cache.store(key, traced)
    elif key and known is not None:
        _TRACED[key] = known
    for entry in entries:
        entry.extra_check = _counting(entry.extra_check, pattern.name, counts)


def _counting(check: Callable[[Any], bool], name: str, counts: Counter) -> Callable[[Any], bool]:
    def counted(match: Any) -> bool:
        accepted = bool(check(match))
        counts[name] += accepted
        return accepted

    return counted


USER_PATTERNS = PatternSet("user_replacements")


def register_replacement(search_fn: Callable, replace_fn: Callable, example_inputs: Sequence[Any],
                         trace_fn: Callable = fwd_only, extra_check: Callable[[Any], bool] = _always,
                         search_fn_pattern: Any = None) -> Pattern:
    """Replace every computation that matches `search_fn` by `replace_fn`, in every
    graph optimized from now on (levels 1 and 2; pass `user_replacements`).

    `example_inputs` are tensors (or scalars) to trace both functions with; a match
    binds `search_fn`'s arguments to graph values of any shape and dtype the traced
    pattern allows. `extra_check(match)` can veto a match: `match.kwargs` maps
    `search_fn`'s argument names to graph nodes (`node.meta["val"]` is a fake tensor
    with the shape and dtype). `search_fn_pattern` replaces the traced pattern.
    Returns the registration; `.remove()` it to stop. Its match count is reported as
    `user_replacements` in `report()`, under the `search_fn`'s name.
    """
    name = getattr(search_fn, "__name__", "pattern")
    _check_replacement(name, search_fn, replace_fn, example_inputs, trace_fn)
    return USER_PATTERNS.add(Pattern(name, search_fn, replace_fn, list(example_inputs), trace_fn,
                                     extra_check, None, search_fn_pattern))


def _check_replacement(name: str, search_fn: Callable, replace_fn: Callable,
                       example_inputs: Sequence[Any], trace_fn: Callable) -> None:
    """Registration-time errors: untraceable functions, mismatched signatures, or a
    `replace_fn` that computes something else than `search_fn` on the examples."""
    if not isinstance(example_inputs, (list, tuple)):
        raise TypeError(f"register_replacement({name}): example_inputs must be a list or tuple of "
                        f"tensors, got {type(example_inputs).__name__}")
    arity = len(inspect.signature(search_fn).parameters)
    if arity != len(example_inputs):
        raise ValueError(f"register_replacement({name}): search_fn takes {arity} argument(s) but "
                         f"{len(example_inputs)} example input(s) were given; give one per argument")
    # Values are compared on fresh random floats: examples are often `torch.empty`.
    generator = torch.Generator().manual_seed(0)
    probe = [_random_like(x, generator) for x in example_inputs]
    outputs = []
    for role, fn in (("search_fn", search_fn), ("replace_fn", replace_fn)):
        try:
            trace_fn(fn, list(example_inputs))
            with torch.no_grad():
                outputs.append(fn(*[_copy(x) for x in probe]))
        except Exception as error:  # noqa: BLE001 - any tracing failure is the user's to fix
            raise ValueError(f"register_replacement({name}): {role} cannot be traced with the example "
                             f"inputs: {type(error).__name__}: {error}. Patterns must be functional "
                             "torch code with no data-dependent Python control flow.") from error
    _check_same_outputs(name, *outputs)


def _copy(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def _random_like(x: Any, generator: torch.Generator) -> Any:
    """A real tensor like `x` (which may be fake) with random values when floating."""
    if not isinstance(x, torch.Tensor):
        return x
    with fake.outside_fake_mode():
        if x.dtype.is_floating_point:
            return torch.randn(tuple(x.shape), generator=generator).to(dtype=x.dtype, device=x.device)
        if fake.is_fake(x):
            return torch.zeros(tuple(x.shape), dtype=x.dtype, device=x.device)
    return x


def _check_same_outputs(name: str, searched: Any, replaced: Any) -> None:
    (found, found_spec), (made, made_spec) = tree_flatten(searched), tree_flatten(replaced)
    if found_spec != made_spec:
        raise ValueError(f"register_replacement({name}): replace_fn returns {made_spec} but search_fn "
                         f"returns {found_spec}; they must return the same structure")
    for i, (a, b) in enumerate(zip(found, made)):
        if not isinstance(a, torch.Tensor):
            continue
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            got = f"{tuple(b.shape)}/{b.dtype}" if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"register_replacement({name}): output {i} of replace_fn is {got}, "
                             f"search_fn's is {tuple(a.shape)}/{a.dtype}")
        atol, rtol = tolerance(a.dtype)
        if not torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True):
            diff = (a.double() - b.double()).abs().max().item()
            raise ValueError(f"register_replacement({name}): output {i} of replace_fn differs from "
                             f"search_fn's on the example inputs (max abs difference {diff:.3g}, "
                             f"atol={atol}); a replacement must compute the same values")
