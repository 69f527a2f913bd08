"""The value types of `graphopt`'s command-line options: argparse prefixes their errors
with the option's name, so each message says only what was expected and what came."""

from __future__ import annotations

import argparse
from typing import Callable, Sequence


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type; argparse prefixes its errors with the option's name."""
    allowed = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {value}")
        return value

    return parse


def int_list(low: int, high: int) -> Callable[[str], list[int]]:
    """Comma-separated integers, each in low..high; duplicates dropped (they would only repeat rows)."""
    item = int_in(low, high)
    return lambda text: list(dict.fromkeys(item(part.strip()) for part in text.split(",")))


def names(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """Comma-separated names, each one of `allowed`; duplicates dropped."""
    def parse(text: str) -> list[str]:
        names = list(dict.fromkeys(part.strip() for part in text.split(",")))
        wrong = [name for name in names if name not in allowed]
        if wrong:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, wrong))}; choose from "
                                             f"{', '.join(allowed)}")
        return names

    return parse
