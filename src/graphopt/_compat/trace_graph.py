"""The compiled graph a stored trace calls, for `graphopt/backend/backend.py`: `TraceGraph`
(Dynamo's `SerializableCallable`, so that a trace carrying it can be saved) and
Inductor's compiled code bundled with it (level 2).
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any, Callable, Iterator

import torch

from .traces import unsupported


def bundled_inductor(compiled: Any) -> bytes | None:
    """Inductor's compiled graph (from `inductor_compile` with the cache on) as bytes,
    or None when AOTAutograd's cache did not keep a serializable entry for it."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    if getattr(compiled, "serialize", None) is None:
        return None
    return BundledAOTAutogradSerializableCallable.serialize_compile_artifacts(
        BundledAOTAutogradSerializableCallable(compiled))


def load_inductor(data: bytes) -> Callable:
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    from .inductor import cpu_isa_checks_done

    cpu_isa_checks_done()

    with torch._inductor.config.patch(enable_autograd_for_aot=True):
        return BundledAOTAutogradSerializableCallable.deserialize_compile_artifacts(data)


@contextlib.contextmanager
def bundled_inductor_cache() -> Iterator[None]:
    """AOTAutograd's cache entries hold Inductor's compiled graph itself, so that a
    compile can be serialized with `bundled_inductor`."""
    with torch._functorch.config.patch(bundled_autograd_cache=True):
        yield


class NotSerializable(Exception):
    """A trace whose graph a later process could not build again."""


class NotChosenYet(NotSerializable):
    """A trace whose graph's level (graph_opt_level="auto") is chosen after the trace is
    stored: a later process, which loads the choice, stores it."""


def _serializable_base() -> type:
    from torch._dynamo.aot_compile_types import SerializableCallable

    return SerializableCallable


class TraceGraph(_serializable_base() if unsupported() is None else object):  # type: ignore[misc]
    """What a trace's bytecode calls in place of the compiled graph: `target`, and
    `spec` (picklable) saying how a later process builds it again, or None with the
    reason in `why`. A loaded trace gets its target from `bind()`."""

    def __init__(self, spec: Any, target: Callable | None = None, why: str | None = None, chosen: bool = True):
        self.spec = spec
        self.target = target
        self.why = why
        self.chosen = chosen

    def bind(self, target: Callable) -> None:
        self.target = target

    def __call__(self, *args: Any) -> Any:
        return self.target(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: TraceGraph) -> bytes:
        if fn.spec is None:
            raise (NotSerializable if fn.chosen else NotChosenYet)(fn.why)
        return pickle.dumps(fn.spec)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> TraceGraph:
        return cls(pickle.loads(data))
