"""Symbolic shapes: sizes compared, read and made concrete without adding a guard.

Dynamo traces a dynamic batch as a SymInt over a sympy symbol; a pass that asks
`a == b` of two such sizes in plain Python would guard on the traced value and
specialise the graph. These wrappers ask torch's shape environment
(`torch.fx.experimental.symbolic_shapes`) instead, whose names and hints have moved
between releases: a torch upgrade that moves them breaks this file only.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

# Inductor's guess for a size it cannot know (an unbacked symbol): used only for estimates.
_UNKNOWN_SIZE = 8192


def known_true(condition: Any) -> bool:
    """True when `condition` (a bool or a SymBool over symbolic sizes) holds for every
    value of its symbols; False when unknown. Never adds a guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(condition))


def same_sizes(a: Sequence, b: Sequence) -> bool:
    """Sizes equal for every value of their symbolic dims (no guard is added)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return same_sizes(a.shape, b.shape)


def symbol_of(size: Any) -> Any:
    """The sympy expression of a symbolic size, or None for a plain int."""
    return size.node.expr if isinstance(size, torch.SymInt) else None


def concrete(value: Any) -> Any:
    """A Dynamo example input as a plain value: SymInts become their hint."""
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if hint is None:
            raise ValueError(f"symbolic size {value} has no concrete hint")
        return int(hint)
    return value


def size_hint(value: Any) -> int:
    """A size as a plain int: a SymInt becomes the value it had when traced (its
    hint, never guarded on), or 8192 when it has none (a data-dependent size)."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # torch < 2.13
        hint = value.node.hint
        return int(hint) if hint is not None else _UNKNOWN_SIZE
    return int(optimization_hint(value, fallback=_UNKNOWN_SIZE))


def symbol_hints(values: Sequence[Any]) -> dict[str, int]:
    """For the symbols the SymInts among `values` are built from: name -> traced value."""
    hints: dict[str, int] = {}
    for value in values:
        if not isinstance(value, torch.SymInt):
            continue
        shape_env = value.node.shape_env
        for symbol in sorted(value.node.expr.free_symbols, key=str):
            if str(symbol) not in hints:
                hint = getattr(shape_env, "optimization_hint", None)  # torch >= 2.13
                hints[str(symbol)] = int(hint(symbol, fallback=_UNKNOWN_SIZE) if hint is not None
                                         else shape_env.size_hint(symbol))
    return hints
