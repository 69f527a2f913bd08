"""Inductor's pattern matcher, for graphopt.register_replacement and the fusion library."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import torch
import torch.fx

from .fake import outside_fake_mode


def _accepts(fn: Callable, name: str) -> bool:
    """Whether this torch's `fn` takes keyword `name` (one added in a later release)."""
    return name in inspect.signature(fn).parameters


def pattern_matcher_pass(name: str) -> Any:
    from torch._inductor.pattern_matcher import PatternMatcherPass

    return PatternMatcherPass(pass_name=name) if _accepts(PatternMatcherPass.__init__, "pass_name") \
        else PatternMatcherPass()


def trace_forward(fn: Callable, args: Sequence[Any], decompositions: dict) -> torch.fx.GraphModule:
    """`fn` as a functional ATen inference graph with `decompositions` applied, the
    way AOTAutograd hands graphs over (in-place ops functionalized, no-op views and
    dead code removed): what the pattern matcher compares graphs against."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._inductor.fx_passes.post_grad import remove_noop_ops
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.traceback import preserve_node_meta

    # AOTAutograd's functionalization (torch.func.functionalize runs above the
    # composite decompositions and would leave their in-place ops in the pattern).
    with enable_python_dispatcher(), preserve_node_meta():
        gm = make_fx(dispatch_functionalize(fn), decompositions, tracing_mode="real")(*args)
    remove_noop_ops(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def inductor_decompositions() -> dict:
    """The decompositions Inductor applies before its post-grad passes run."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def register_pattern(search_fn: Callable, replace_fn: Callable, example_inputs: Sequence[Any],
                     trace_fn: Callable, matcher: Any, extra_check: Callable,
                     scalar_workaround: dict | None, search_fn_pattern: Any) -> list[Any]:
    """Register one replacement with Inductor's matcher; returns the entries it added
    (so the caller can wrap their checks, e.g. to count matches)."""
    from torch._inductor import pattern_matcher

    before = {id(e) for entries in matcher.patterns.values() for e in entries}
    kwargs: dict[str, Any] = {"extra_check": extra_check, "scalar_workaround": scalar_workaround or {},
                              "search_fn_pattern": search_fn_pattern}
    if _accepts(pattern_matcher.register_replacement, "skip_duplicates"):
        kwargs["skip_duplicates"] = True
    # Patterns are registered lazily, possibly while a compiler traces with its own
    # fake mode: trace them outside it, as Inductor registers its own patterns.
    with torch._guards.tracing(None), outside_fake_mode():
        pattern_matcher.register_replacement(search_fn, replace_fn, list(example_inputs), trace_fn, matcher,
                                             **kwargs)
    return [e for entries in matcher.patterns.values() for e in entries if id(e) not in before]


@functools.cache
def online_softmax_op() -> Any:
    """`prims.prepare_softmax_online`, into which Inductor's CUDA post-grad pass folds a
    softmax's max and sum (None on a torch without it)."""
    try:
        from torch._inductor import inductor_prims  # noqa: F401 - registers the op
    except ImportError:  # pragma: no cover - a torch without Inductor
        return None
    op = getattr(torch.ops.prims, "prepare_softmax_online", None)
    return op.default if op is not None else None
