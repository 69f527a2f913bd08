"""Canonicalization: one form per op family, so that a fusion matches the math and
not one spelling of it. Each pass rewrites the spellings of one family into the
form the fusions (passes/fusion/) match; it never fuses, and what it rewrites
computes the same values (the same ops in another arrangement, up to rounding)."""

from __future__ import annotations

from typing import Callable


def canonical_passes() -> dict[str, Callable]:
    """The canonicalization passes by name, in pipeline order."""
    from .attention import canonicalize_attention
    from .norm import canonicalize_norms
    from .rotary import canonicalize_rotary

    return {"canonicalize_norms": canonicalize_norms, "canonicalize_attention": canonicalize_attention,
            "canonicalize_rotary": canonicalize_rotary}
