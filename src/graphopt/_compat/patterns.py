"""Inductor's pattern matcher, for graphopt.register_replacement and the fusion library."""

from __future__ import annotations

import functools
import inspect
import io
import pickle
import types
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

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
                     scalar_workaround: dict | None, search_fn_pattern: Any,
                     traced: bytes | None = None) -> tuple[list[Any], bytes | None]:
    """Register one replacement with Inductor's matcher. Returns the entries it added
    (so the caller can wrap their checks, e.g. to count matches) and the traced search
    pattern as `dump_search` writes it, for a later process to pass back as `traced`
    (then nothing is traced; None is returned in its place)."""
    from torch._inductor import pattern_matcher

    before = {id(e) for entries in matcher.patterns.values() for e in entries}
    kwargs: dict[str, Any] = {"extra_check": extra_check, "scalar_workaround": scalar_workaround or {},
                              "search_fn_pattern": search_fn_pattern}
    if _accepts(pattern_matcher.register_replacement, "skip_duplicates"):
        kwargs["skip_duplicates"] = True
    made: list[bytes] = []
    trace = pattern_matcher.gen_pattern_and_search_gm

    def search(*args: Any, **kw: Any) -> tuple[Any, Any]:
        # What register_replacement traces first. Only the pattern and the graph's text are
        # used from it (the text tells apart patterns equal but for constants they ignore);
        # a match is still checked by tracing `search_fn` on the matched values.
        loaded = _load_search(traced) if traced is not None else None
        if loaded is not None:
            return loaded[0], types.SimpleNamespace(graph=_Printed(loaded[1]))
        pattern, gm = trace(*args, **kw)
        made.extend(_dump_search(pattern, str(gm.graph)))
        return pattern, gm

    # Patterns are registered lazily, possibly while a compiler traces with its own
    # fake mode: trace them outside it, as Inductor registers its own patterns.
    pattern_matcher.gen_pattern_and_search_gm = search
    try:
        with torch._guards.tracing(None), outside_fake_mode():
            pattern_matcher.register_replacement(search_fn, replace_fn, list(example_inputs), trace_fn, matcher,
                                                 **kwargs)
    finally:
        pattern_matcher.gen_pattern_and_search_gm = trace
    added = [e for entries in matcher.patterns.values() for e in entries if id(e) not in before]
    return added, (made[0] if made else None)


class _Printed:
    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text


class _PatternPickler(pickle.Pickler):
    """Inductor's patterns are plain objects but for the operators they name, which
    pickle by name here, and pytree's leaf spec, which loads as pytree's own shared one:
    a `LeafSpec` made by unpickling warns on stderr that the class is deprecated (2.13)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            return _operator, (obj.namespace, obj._opname, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            namespace, name = obj._qualified_op_name.split("::")
            return _operator, (namespace, name, None)
        leaf = getattr(pytree, "treespec_leaf", None)
        if leaf is not None and isinstance(obj, pytree.TreeSpec) and obj.is_leaf():
            return leaf, ()
        return NotImplemented


def _operator(namespace: str, name: str, overload: str | None) -> Any:
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def _dump_search(pattern: Any, text: str) -> list[bytes]:
    """[the pickled pattern], or [] where a pattern holds what does not pickle (it is
    then traced in every process)."""
    stream = io.BytesIO()
    try:
        _PatternPickler(stream, protocol=pickle.HIGHEST_PROTOCOL).dump((pattern, text))
    except (pickle.PicklingError, TypeError, AttributeError):
        return []
    return [stream.getvalue()]


def _load_search(data: bytes) -> tuple[Any, str] | None:
    """The stored pattern, or None where this torch no longer has an operator it names."""
    try:
        return pickle.loads(data)
    except (AttributeError, RuntimeError):
        return None


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
