"""Checks of `GraphOptimizationConfig`'s fields: each names the key, what it accepts
and what it got, and where it can, the fix (`config.py` calls them)."""

from __future__ import annotations

import difflib
from typing import Any, Final, Mapping

import torch

from ._compat.names import INDUCTOR_OPTIONS


def describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_int(key: str, value: object, *, minimum: int | None = None, choices: tuple[int, ...] = (),
              or_else: str | None = None) -> None:
    """`or_else`: a word also accepted in place of an int, named in the error."""
    accepted = f"an int in {{{', '.join(map(str, choices))}}}" if choices else f"an int >= {minimum}"
    if or_else is not None:
        accepted += f" or {or_else!r}"
    # bool is a subclass of int, but True is never a meaningful level or count.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{key} must be {accepted}, got {describe(value)}")
    if (choices and value not in choices) or (minimum is not None and value < minimum):
        raise ValueError(f"{key} must be {accepted}, got {value}")


def check_bool(key: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{key} must be a bool (true/false), got {describe(value)}")


def check_choice(key: str, value: object, choices: tuple[str, ...], optional: bool = False) -> None:
    accepted = "one of " + ", ".join(repr(c) for c in choices) + (" or null" if optional else "")
    if optional and value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"{key} must be {accepted}, got {describe(value)}")
    if value not in choices:
        raise ValueError(f"{key} must be {accepted}, got {value!r}")


def check_tolerance(key: str, value: object) -> None:
    accepted = (f"{key} must be a number > 0 (a causal LM's next-token KL in nats, else a fraction of the output's "
                "largest magnitude) or null for no bound")
    if value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{accepted}, got {describe(value)}")
    if not value > 0:
        raise ValueError(f"{accepted}, got {value}")


def aten_op_names(value: object) -> list[str]:
    accepted = ('cudagraph_splitting_ops must be a list of ATen op names such as "aten.index_put_" '
                'or "aten.index_put_.default"')
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{accepted}, got {describe(value)}")
    for i, name in enumerate(value):
        if not isinstance(name, str):
            raise TypeError(f"{accepted}, got {describe(name)} at index {i}")
        parts = name.split(".")
        packet = getattr(torch.ops.aten, parts[1], None) if len(parts) in (2, 3) and parts[0] == "aten" else None
        if packet is None or (len(parts) == 3 and parts[2] not in packet.overloads()):
            raise ValueError(f"{accepted}; {name!r} at index {i} is not an ATen op")
    return list(value)


def op_names(key: str, value: object) -> list[str]:
    """Op names as "namespace.name" (an overload may follow: "mylib.op.default"); "::" is accepted."""
    accepted = f'{key} must be a list of op names such as "mylib::my_op" or "mylib.my_op"'
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{accepted}, got {describe(value)}")
    names = []
    for i, name in enumerate(value):
        if not isinstance(name, str):
            raise TypeError(f"{accepted}, got {describe(name)} at index {i}")
        dotted = name.replace("::", ".")
        if not 2 <= len(dotted.split(".")) <= 3 or not all(part.isidentifier() for part in dotted.split(".")):
            raise ValueError(f"{accepted}; {name!r} at index {i} is not one")
        names.append(dotted)
    return names


def capture_sizes(value: object) -> list[int]:
    accepted = ('cudagraph_capture_sizes must be a non-empty list of ints >= 1, "auto" (chosen from '
                'traffic) or null for the defaults')
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{accepted}, got {describe(value)}")
    if not value:
        raise ValueError(f"{accepted}, got an empty list")
    for i, size in enumerate(value):
        if not isinstance(size, int) or isinstance(size, bool):
            raise TypeError(f"{accepted}, got {describe(size)} at index {i}")
        if size < 1:
            raise ValueError(f"{accepted}, got {size} at index {i}")
    return sorted(set(value))


def check_budget(value: object) -> None:
    accepted = "graph_memory_budget must be an int number of bytes >= 0, or null for no limit"
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{accepted}, got {describe(value)}")
    if value < 0:
        raise ValueError(f"{accepted}, got {value}")


def pass_names(value: object) -> list[str]:
    accepted = 'disabled_passes must be a list of pass names (non-empty strings, "*" for all)'
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{accepted}, got {describe(value)}")
    for i, name in enumerate(value):
        if not isinstance(name, str):
            raise TypeError(f"{accepted}, got {describe(name)} at index {i}")
        if not name:
            raise ValueError(f"{accepted}, got an empty string at index {i}")
    return list(value)


def check_dump_dir(value: object) -> None:
    accepted = "debug_dump_dir must be a non-empty str (a directory path) or null"
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{accepted}, got {describe(value)}")
    if value == "":
        raise ValueError(f"{accepted}, got an empty string")


# Inductor options graphopt decides itself: its runtime owns device graphs, and its
# compile cache decides when Inductor's FX graph cache may answer.
RESERVED_INDUCTOR_OPTIONS: Final = ("triton.cudagraphs", "fx_graph_cache", "post_grad_custom_post_pass")
# Inductor options whose compiled code holds copies of the weights, taken at compile time.
WEIGHT_COPYING_INDUCTOR_OPTIONS: Final = ("freezing", "max_autotune", "max_autotune_gemm")


def inductor_compile_config(value: object, freeze_parameters: bool) -> dict[str, Any]:
    accepted = ('inductor_compile_config must be a mapping of Inductor option names to numbers, strings, '
                'booleans or null, e.g. {"max_autotune": true}')
    if not isinstance(value, Mapping):
        raise TypeError(f"{accepted}, got {describe(value)}")
    if not value:
        return {}
    from ._compat import inductor

    known = inductor.inductor_option_names()
    for key, option in value.items():
        if not isinstance(key, str) or key not in known:
            close = difflib.get_close_matches(key, known, n=1) if isinstance(key, str) else []
            hint = f"; did you mean {close[0]!r}?" if close else f" ({INDUCTOR_OPTIONS} lists them)"
            raise ValueError(f"inductor_compile_config: {key!r} is not an Inductor option{hint}")
        if key in RESERVED_INDUCTOR_OPTIONS:
            raise ValueError(f"inductor_compile_config: {key!r} is set by graphopt itself (its runtime owns "
                             "device graphs and its compile cache decides when Inductor's may answer); "
                             "leave it out")
        if option is not None and not isinstance(option, (bool, int, float, str)):
            raise TypeError(f"{accepted}; {key!r} is {describe(option)}")
    if value.get("freezing") and not freeze_parameters:
        raise ValueError("inductor_compile_config: freezing=True bakes the weights into the compiled code, "
                         "so in-place weight updates would silently not be seen; it needs "
                         "freeze_parameters=True, which says the weights are constant")
    return dict(value)


EXECUTORS: Final = ("onnxruntime", "openvino")


def executors(value: object, freeze_parameters: bool) -> list[str]:
    accepted = f'executors must be a list of engine names from {list(EXECUTORS)}, e.g. ["onnxruntime"]'
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{accepted}, got {describe(value)}")
    for i, name in enumerate(value):
        if name not in EXECUTORS:
            close = difflib.get_close_matches(name, EXECUTORS, n=1) if isinstance(name, str) else []
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{accepted}; {name!r} at index {i} is not one{hint}")
    if value and not freeze_parameters:
        raise ValueError("executors: an engine takes the weights as its own constants, so in-place weight "
                         "updates would not reach it; it needs freeze_parameters=True (refresh() then "
                         "exports the weights again)")
    return list(dict.fromkeys(value))
