"""`on_recompile`: what a recompile does ("recompile", "warn", "error").

Dynamo recompiles a step when a guard fails: a dim it specialised changed size,
an attribute or global `forward` reads changed. Each costs a compile and a new
set of captures, and in serving it is latency nobody asked for. With "warn" each
failing guard warns once; with "error" the compile is refused with a
RecompileError naming the guard, the value that failed it and the likely cause.
Refusing leaves the model as it was: the graphs compiled before still serve the
inputs that pass their guards (torch's `set_stance("fail_on_recompile")` is the
same guarantee).
"""

from __future__ import annotations

import re
import warnings

from .._compat import recompile as compat
from ..report import Report


class RecompileError(RuntimeError):
    """A recompile with `on_recompile="error"`; `guard` is the guard that failed."""

    def __init__(self, message: str, guard: str):
        super().__init__(message)
        self.guard = guard


# Dynamo's wording of a guard -> what usually makes it fail, and the fix.
_CAUSES = (
    ("size mismatch", "an input's size changed in a dim graphopt did not mark dynamic; declare it with "
                      "dynamic_dims (or DynamicDims) so one graph serves every size"),
    ("stride mismatch", "an input's layout changed (a transposed or sliced tensor); pass contiguous inputs"),
    ("dtype mismatch", "an input's dtype changed"),
    ("device mismatch", "an input moved to another device"),
    ("___check_obj_id", "an object forward reads (a submodule, a function, a tensor attribute) was replaced"),
    ("___check_type_id", "an argument or attribute changed type"),
    ("len(", "a list or tuple forward reads changed length"),
    ("==", "a Python value forward reads (an attribute, a flag, a global) changed; graph values are "
           "baked in at compile time"),
)


def on_recompile(policy: str, report: Report) -> None:
    """Count the recompile being compiled now and apply `policy` to it. The batch's
    0/1 specialisation (Dynamo compiles batch 1 apart from the dynamic batch, once
    per step) is counted but never warned of or refused: warming up (capture_all)
    meets it, and no serving engine can avoid it."""
    reasons = compat.recompile_reasons()
    named = [r for r in reasons if not _batch_specialisation(r)]
    guard = _first_line((named or reasons or ["unknown (this torch does not say which guard failed)"])[0])
    report.recompile_reasons[guard] += 1
    if policy == "recompile" or (reasons and not named) or \
            (policy == "warn" and report.recompile_reasons[guard] > 1):
        return
    message = f"graphopt: a guard of a compiled step failed: {guard}{_value(guard)}. {_cause(guard)}."
    if policy == "warn":
        warnings.warn(f"{message} It is recompiled (on_recompile='warn' says this once per guard)", stacklevel=2)
        return
    raise RecompileError(f"{message} on_recompile='error' refuses the recompile: the step keeps the graphs "
                         "it has, which serve the inputs that pass their guards", guard)


def raised(error: BaseException) -> RecompileError | None:
    """The RecompileError inside an error from torch.compile, if that is what it is."""
    inner = error if isinstance(error, RecompileError) else compat.backend_error(error)
    return inner if isinstance(inner, RecompileError) else None


def _first_line(reason: str) -> str:
    """Dynamo's guard, then `# <source> # <file:line>`: the guard and where, on one line."""
    guard, *where = [part.strip() for part in reason.splitlines()[0].split("#")]
    return guard + (f" (at {where[-1]})" if where else "")


def _batch_specialisation(reason: str) -> bool:
    return "0/1 specialization" in reason or bool(
        re.search(r"size mismatch at index \d+\. expected (1, actual \d+|\d+, actual 1)$", reason))


def _value(guard: str) -> str:
    if "mismatch" in guard:
        return ""  # Dynamo's words already give the expected and actual value
    try:
        value = compat.failed_value(guard.split(" (at ")[0])
    except LookupError:
        return ""
    text = repr(value)
    return f" (the value now: {text if len(text) <= 80 else text[:77] + '...'})"


def _cause(guard: str) -> str:
    return next((cause for pattern, cause in _CAUSES if pattern in guard), "a guard Dynamo placed on the step failed")
