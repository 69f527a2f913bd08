"""Which of Dynamo's guards a step keeps: the `guards` config key.

    guards="all":    every guard Dynamo makes (1,409 for a 4-layer transformers BERT:
                     each submodule's hooks, type and attributes, each parameter's
                     metadata, the globals the forward reads) is checked on every call
    guards="inputs": only the guards on the step's arguments (type, dtype, device,
                     shape, the dynamic dims' ranges) and on torch's global state
                     (grad mode, default device) are checked

A serving step's module does not change between calls, and checking that it has not
is a sizeable share of a small model's call (docs/configuration.md, "Guards: what a
call checks").
vLLM drops every guard for this reason; "inputs" keeps the ones that pick the graph
for a call, so a new dtype or rank still compiles a new graph instead of running the
wrong one. What it trusts: after the first call, the module's Python state (its
attributes, submodules, `training`, config objects, the globals its forward reads)
stays as it was; weights may change in place (`refresh()` where they are frozen).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

_ROOT = re.compile(r"(?:L\['(\w+)'\]|([A-Za-z_]\w*))")
_WRAPPERS = frozenset({"L", "type", "len", "dict", "list", "tuple", "getattr", "id"})


def keep_input_guards(arguments: Iterable[str]) -> Callable[[list], list[bool]]:
    """A `guard_filter_fn` that keeps the guards on `arguments` (a step's parameter
    names, `self` left out) and on global state, and drops the rest."""
    names = frozenset(arguments) - {"self"}
    return lambda entries: [_on_inputs(entry, names) for entry in entries]


def _on_inputs(entry: Any, names: frozenset[str]) -> bool:
    if entry.is_global:
        return False
    if not entry.name:  # grad mode, default device, the shape env's guards
        return True
    for match in _ROOT.finditer(entry.name):
        root = match.group(1) or match.group(2)
        if root not in _WRAPPERS:
            return root in names
    return False
