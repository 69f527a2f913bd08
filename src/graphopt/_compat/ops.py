"""ATen operators as torch's dispatcher sees them: the arguments a call writes, an op's
in-place overload, whether it is pointwise, the dispatch mode in effect.

These read an op's schema (`OpOverload._schema`), the dispatch-mode stack
(`torch.utils._python_dispatch`) and torch's own reinplacing table
(`torch.fx.passes.reinplace`), all private: a torch upgrade that moves them breaks
this file only.
"""

from __future__ import annotations

from typing import Any

import torch

# Elementwise ops torch does not tag pointwise (torch 2.13: hardswish, a CNN's activation).
UNTAGGED_POINTWISE = {"hardswish", "hardswish_"}


def written_arguments(op: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments an ATen call writes in place (its schema's mutable aliases)."""
    written = []
    for i, argument in enumerate(op._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.append(args[i] if i < len(args) else kwargs.get(argument.name))
    return written


def is_pointwise(op: Any) -> bool:
    """Whether an ATen op computes each output element from the same element of its inputs:
    torch's pointwise tag, completed where torch leaves it off (`UNTAGGED_POINTWISE`, and
    in-place ops whose functional op carries it: `relu_` is tagged, `gelu_`, which
    re-inplacing makes, is not)."""
    tags = getattr(op, "tags", ())
    if torch.Tag.pointwise in tags:
        return True
    packet = getattr(op, "overloadpacket", None)
    if packet is None:
        return False
    if packet.__name__ in UNTAGGED_POINTWISE:
        return True
    if torch.Tag.inplace not in tags:
        return False
    functional = getattr(torch.ops.aten, packet.__name__.rstrip("_"), None)
    overload = getattr(functional, op._overloadname, None) if functional is not None else None
    return overload is not None and torch.Tag.pointwise in overload.tags


def current_dispatch_mode() -> Any:
    """The innermost TorchDispatchMode of this thread, or None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def inplace_overload(op: Any) -> Any:
    """torch's own choice of the in-place overload of a functional op (the one whose
    schema matches argument for argument, e.g. pow.Tensor_Scalar -> pow_.Scalar), or
    None. From torch.fx.passes.reinplace, which may move or change."""
    try:
        from torch.fx.passes.reinplace import _maybe_get_inplace_op
    except ImportError:  # pragma: no cover - callers fall back to their own lookup
        return None
    try:
        return _maybe_get_inplace_op(op)
    except AssertionError:  # several candidate overloads, or an odd schema: no answer
        return None
