"""Dynamo's recompiles: its limit of graphs per function, whether the graph being
compiled now is a recompile, when Dynamo gives up on a function, and the guard
that failed with the value it failed on. Private Dynamo state, read defensively:
where a torch does not have it, graphopt says it does not know rather than
failing the compile."""

from __future__ import annotations

import logging
import re
import weakref
from typing import Any, Callable

import torch._dynamo

from . import guard_sources

# The subject of a guard: self.scale, L['x'], G['flag'], L['cache'][0].shape ...
_SUBJECT = re.compile(r"(?:\b[LG]\[['\"][^'\"]+['\"]\]|\b[A-Za-z_]\w*)(?:\.\w+|\[[^\]]+\])*")


_seen: dict[Any, int] = {}  # per code object: Dynamo's guard failures already read


def recompile_reasons() -> list[str]:
    """The guards that failed for the frame Dynamo is recompiling now, one per
    graph it already had, as Dynamo words them ("tensor 'x' size mismatch at index
    0. expected 4, actual 5", "L['self'].scale == 2.0"); [] where it cannot say."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.utils import guard_failures, orig_code_map

        code = InstructionTranslator.current_tx().f_code
        code = orig_code_map.get(code, code)
        failures = list(guard_failures.get(code, ()))
    except Exception:  # noqa: BLE001 - a torch without them: the caller says the reason is unknown
        return []
    start, _seen[code] = _seen.get(code, 0), len(failures)
    if start > len(failures):  # torch._dynamo.reset() cleared them
        start = 0
    return [re.sub(r"^\s*\[?\d+/\d+\]?:\s*", "", str(r)).strip() for r in failures[start:] if r]


def failed_value(guard: str) -> Any:
    """The value now held by what `guard` reads (its first `L[...]`/`G[...]` subject),
    read from the frame Dynamo is compiling; raises LookupError where it cannot."""
    expression = re.sub(r"^(___check_\w+|id|len|type)\(", "", guard.split("#")[0].strip())
    match = _SUBJECT.match(expression)
    if match is None:
        raise LookupError("the guard reads no local or global")
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        frame, module_globals = tx.f_locals, tx.f_globals
    except Exception as error:  # noqa: BLE001
        raise LookupError(f"Dynamo's frame is not reachable ({type(error).__name__})") from None
    subject = match.group(0)
    if not subject.startswith(("L[", "G[")):  # a reason's bare name: a local, else a global
        name = re.match(r"\w+", subject).group(0)
        subject = f"{'L' if name in frame else 'G'}[{name!r}]{subject[len(name):]}"
    walked = guard_sources.reader(subject)
    if walked is None:
        raise LookupError(f"{match.group(0)} is not a source graphopt reads")
    try:
        return guard_sources.read(walked, frame, module_globals)
    except Exception as error:  # noqa: BLE001
        raise LookupError(f"{match.group(0)} could not be read ({type(error).__name__})") from None


def backend_error(error: BaseException) -> BaseException | None:
    """The exception a backend raised, where Dynamo wrapped it (BackendCompilerFailed)."""
    inner = getattr(error, "inner_exception", None)
    return inner if isinstance(inner, BaseException) else None


_given_back: list[int] = []  # budgets of collected Backends not yet taken off the limit


def allow_recompiles(count: int) -> None:
    """Let Dynamo keep `count` more graphs per function before it gives up and runs
    eagerly. Its limit counts every graph of a code object, across every
    torch.compile of it: each optimized copy of one model needs its own share."""
    config = torch._dynamo.config
    setattr(config, _recompile_limit_name(), recompile_limit() + count)


def give_back_recompiles(count: int) -> None:
    """`count` taken off the limit at the next `allow_recompiles` or `recompile_limit`.
    For a finalizer, which runs inside the garbage collector: torch 2.13's config is
    context variables, and a `ContextVar.set` that the collector re-enters from inside
    another one frees the context's variables while that one still walks them (CPython
    before 3.12, gh-148891), so a finalizer must write no config."""
    _given_back.append(count)  # atomic under the GIL: no lock a collector could wait on


def recompile_limit() -> int:
    """How many graphs Dynamo keeps per function before it gives up and runs eagerly,
    once the budgets given back since the last read are taken off."""
    config, name = torch._dynamo.config, _recompile_limit_name()
    given_back = 0
    while _given_back:
        given_back += _given_back.pop()
    if given_back:
        setattr(config, name, getattr(config, name) - given_back)
    return getattr(config, name)


def _recompile_limit_name() -> str:
    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def is_recompile() -> bool:
    """Whether the graph being compiled now replaces one of the same frame whose
    guards failed (a recompile), rather than being that frame's first graph."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return bool(compile_id is not None and getattr(compile_id, "frame_compile_id", 0))


_recompile_limit_listeners: list[weakref.WeakMethod] = []


def on_recompile_limit(listener: Callable[[str], None]) -> None:
    """Call the bound method `listener(message)`, while its object lives, whenever Dynamo
    gives up on a function because it hit its recompile limit (it then runs that frame
    eagerly, saying so only in a log line: this watches that log line)."""
    if not _recompile_limit_listeners:
        class _Watch(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                if "hit config." in str(record.msg):
                    message = record.getMessage().splitlines()
                    for ref in list(_recompile_limit_listeners):
                        notify = ref()
                        if notify is None:
                            _recompile_limit_listeners.remove(ref)
                        else:
                            notify(" ".join(line.strip() for line in message[:2]))
                return True

        logging.getLogger("torch._dynamo.convert_frame").addFilter(_Watch())
    _recompile_limit_listeners.append(weakref.WeakMethod(listener))
