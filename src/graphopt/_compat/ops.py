"""ATen operators as torch's dispatcher sees them: the arguments a call writes, an op's
in-place overload, the dispatch mode in effect.

These read an op's schema (`OpOverload._schema`), the dispatch-mode stack
(`torch.utils._python_dispatch`) and torch's own reinplacing table
(`torch.fx.passes.reinplace`), all private: a torch upgrade that moves them breaks
this file only.
"""

from __future__ import annotations

from typing import Any


def written_arguments(op: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments an ATen call writes in place (its schema's mutable aliases)."""
    written = []
    for i, argument in enumerate(op._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.append(args[i] if i < len(args) else kwargs.get(argument.name))
    return written


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
