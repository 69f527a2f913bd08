"""Cleanup passes: dead code elimination and common subexpression elimination."""

from __future__ import annotations

import torch.fx

from .base import GraphFacts, PassResult, alias_root, has_effect


def dce(gm: torch.fx.GraphModule) -> PassResult:
    """Dead code elimination: drop nodes whose value nobody reads.

        before:  t = aten.t(w);  unused = aten.mul(x, 2);  mm = aten.mm(x, t);  return (mm,)
        after:   t = aten.t(w);  mm = aten.mm(x, t);  return (mm,)

    Mutations (index_put_, copy_ into an input), side effects and random ops stay.
    """
    removed = 0
    for node in reversed(gm.graph.nodes):
        if node.op in ("call_function", "call_method", "call_module", "get_attr") \
                and not node.users and not has_effect(node):
            gm.graph.erase_node(node)
            removed += 1
    return PassResult(changed=removed > 0, counts={"removed": removed} if removed else {})


def cse(gm: torch.fx.GraphModule) -> PassResult:
    """Common subexpression elimination: compute each pure value once.

        before:  u1 = aten.unsqueeze(slots, 1);  ...;  u2 = aten.unsqueeze(slots, 1);  f(u2)
        after:   u1 = aten.unsqueeze(slots, 1);  ...;  f(u1)

    Random ops and ops with effects are never merged, and an in-place write (or
    another side effect) is a barrier: no value computed before it is reused after
    it, and a value written in place is never merged. Two values that are both returned stay two tensors
    (the caller may write into one of them).
    """
    facts = GraphFacts(gm.graph)
    seen: dict[tuple, torch.fx.Node] = {}
    merged = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if has_effect(node):
            if node.is_impure(impure_random=False):  # a write or a side effect: a barrier
                seen.clear()
            continue  # a random op is only never merged
        key = _hashable((node.target, node.args, node.kwargs))
        if key is None:
            continue
        kept = seen.get(key)
        if kept is None:
            seen[key] = node
        elif not ({alias_root(node), alias_root(kept)} & facts.written
                  or alias_root(node) in facts.returned and alias_root(kept) in facts.returned):
            node.replace_all_uses_with(kept)
            gm.graph.erase_node(node)
            merged += 1
    return PassResult(changed=merged > 0, counts={"merged": merged} if merged else {})


def _hashable(value: object) -> object:
    """`value` with lists and dicts made into tuples; None if anything in it cannot be hashed."""
    if isinstance(value, (list, tuple)):
        items = [_hashable(v) for v in value]
        if any(i is None and v is not None for i, v in zip(items, value)):
            return None
        return (type(value).__name__, *items)
    if isinstance(value, dict):
        return _hashable(sorted(value.items(), key=lambda kv: kv[0]))
    try:
        hash(value)
    except TypeError:
        return None
    return value
