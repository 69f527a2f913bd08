"""Frozen weights that change: noticed before the call that would read them stale.

With `freeze_parameters=True` a graph's code holds values computed from the weights
(folded constants, packed GEMM weights, an engine's initializers). Each compiled graph
of such a Backend runs behind a `FrozenWatch`, which before every call compares

  - the version counter of each parameter and buffer the graph takes (an in-place
    write under `torch.no_grad()`, `load_state_dict`, an optimizer step bumps it), and
  - a process-wide count of parameter, buffer and module assignments (`m.w =
    nn.Parameter(...)`, `m.lin = nn.Linear(...)`, `load_state_dict(assign=True)`),
    which, when it moved, has the watch compare the tensors Dynamo passes with the
    ones the graph was compiled with.

On a change the Backend's values are pointed at the new tensors and refreshed (what
`refresh()` does) before the call runs, and `report().weight_refreshes` counts why.
A write through `.data` (`p.data.mul_(2)`, `p.data = t`) bumps no version counter and
assigns nothing, and a tensor put in `m._parameters` directly runs no hook: neither is
noticed; call `refresh()` after one.
"""

from __future__ import annotations

import functools
import operator
import re
from typing import Any, Callable, Sequence

import torch

from .._compat import dynamo
from ..passes.constant_fold import FROZEN_INPUTS
from ..report import FallbackKind
from .frozen_code import LoadedCode, StaleCode

_version = operator.attrgetter("_version")
# Assignments of parameters, buffers and modules anywhere in the process (see count_assignments).
_assignments = [0]


class FrozenWatch:
    """The runtime of one frozen graph, behind the check of its weights (module docstring)."""

    def __init__(self, runtime: Callable, backend: Any, positions: list[int], tensors: list[torch.Tensor],
                 names: list[str], loaded: LoadedCode | None = None):
        self.runtime, self.backend, self.loaded = runtime, backend, loaded
        self.positions, self.tensors, self.names = positions, tensors, names
        # AOTAutograd's convention, kept for callers that read it: a boxed call passes one list.
        self._boxed_call = getattr(runtime, "_boxed_call", False)
        self.learned = False
        self.snapshot()

    def snapshot(self) -> None:
        """The weights as they are now are the ones the graph's values were computed from."""
        self.versions = list(map(_version, self.tensors))
        self.assignments = _assignments[0]

    def __call__(self, *args: Any) -> Any:
        if self.assignments != _assignments[0] or list(map(_version, self.tensors)) != self.versions:
            self._changed(args[0] if len(args) == 1 and isinstance(args[0], list) else args)
        if self.loaded is not None and self.loaded.stale is not None:
            raise StaleCode(self.loaded.stale)
        if self.learned:
            return self.runtime(*args)
        return self._first(*args)

    def _first(self, *args: Any) -> Any:
        """The first call: a buffer the graph writes itself (a KV cache) is not a frozen
        weight, and is watched no more."""
        result = self.runtime(*args)
        kept = [i for i, (t, v) in enumerate(zip(self.tensors, self.versions)) if t._version == v]
        self.positions, self.tensors, self.names = ([xs[i] for i in kept] for xs in
                                                    (self.positions, self.tensors, self.names))
        self.snapshot()
        self.learned = True
        return result

    def _changed(self, inputs: Sequence[Any]) -> None:
        described = zip(self.names, self.positions, self.tensors)
        replaced = [(n, t, inputs[i]) for n, i, t in described if inputs[i] is not t]
        moved = {id(old): new for _, old, new in replaced}
        reassigned = [n for n, _, _ in replaced]
        written = [n for n, t, v in zip(self.names, self.tensors, self.versions) if t._version != v]
        if not moved and not written:
            self.assignments = _assignments[0]
            return
        reason = "; ".join(f"{how}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                           for how, names in (("reassigned", reassigned), ("updated in place", written)) if names)
        refresh(self.backend, moved, reason)


def watched(runtime: Callable, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], backend: Any,
            level: int | str, inference: bool) -> Callable:
    """`runtime` of `gm` (compiled at `level`), behind a FrozenWatch where the Backend freezes
    weights (added to its `frozen_watches`); else as it is, with a note where it could have
    (`inference`: the graph records no autograd history)."""
    if level == 0:
        return runtime
    if not backend.config.freeze_parameters:
        if inference:
            note_unfrozen(gm, example_inputs, backend.report())
        return runtime
    frozen = watch(runtime, gm, example_inputs, backend)
    backend.frozen_watches.append(frozen)
    return frozen


def watch(runtime: Callable, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], backend: Any) -> FrozenWatch:
    """`runtime` behind a FrozenWatch of the parameters and buffers Dynamo passes to `gm`."""
    positions, tensors, names = [], [], []
    described = zip(example_inputs, dynamo.input_kinds(gm), dynamo.input_sources(gm))
    for i, (value, kind, source) in enumerate(described):
        if kind != "input" and isinstance(value, torch.Tensor) and not value.is_inference():
            positions.append(i)
            tensors.append(value)
            names.append(_short(source))
    return FrozenWatch(runtime, backend, positions, tensors, names)


def watch_inputs(runtime: Callable, backend: Any, inputs: list, sources: dict[int, str],
                 loaded: LoadedCode | None) -> FrozenWatch:
    """`runtime` behind a FrozenWatch of the weights among `inputs` (a graph's inputs,
    as a stored trace's graph is built from: `sources` names each weight's position).
    `loaded`: a level-2 graph's code, which raises StaleCode once refresh() let it go."""
    positions = [i for i in sources if isinstance(inputs[i], torch.Tensor) and not inputs[i].is_inference()]
    return FrozenWatch(runtime, backend, positions, [inputs[i] for i in positions],
                       [_short(sources[i]) for i in positions], loaded)


UNFROZEN = ("freeze_parameters=False: a graph ran in inference (no grad) with its weights as live inputs; "
            "freeze_parameters=True would fold and pack them, and notices a change to them before each call "
            "(not a write through .data); see the configuration docs, Frozen weights")


def note_unfrozen(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], report: Any) -> None:
    """Say once (a note) that a graph run in inference could have run on frozen weights: it takes some."""
    takes_weights = any(kind != "input" and isinstance(x, torch.Tensor)
                        for x, kind in zip(example_inputs, dynamo.input_kinds(gm)))
    if takes_weights and UNFROZEN not in report.notes:
        report.notes.append(UNFROZEN)


def refresh(backend: Any, moved: dict[int, torch.Tensor], reason: str) -> None:
    """Point every value `backend` keeps at the reassigned tensors (`moved`: id of the
    old one -> the new one), then refresh what was computed from the weights."""
    if moved:
        for gm in backend.graph_modules:
            _retarget(gm.meta.get(FROZEN_INPUTS, {}), moved)
        for runtime in backend.repackables:
            if hasattr(runtime, "held"):  # a level-2 graph: its compile inputs
                for inputs in runtime.held:
                    _retarget(inputs, moved)
            elif hasattr(runtime, "engine"):  # the executors' choice
                _leave_engine(runtime, backend.report())
        for other in backend.frozen_watches:
            _retarget(other.tensors, moved)
    backend.report().weight_refresh(reason)
    backend.refresh()


def _leave_engine(choice: Any, report: Any) -> None:
    """An engine's export holds the weights it was given: after a reassignment the graph
    runs on graphopt's code, which follows the new ones."""
    choice.run, choice.engine = choice.runtime, None
    choice.record.update(executor="graphopt", reason="a frozen weight was reassigned after the export")
    report.fallback(FallbackKind.EXECUTOR,
                    "executors: a frozen weight was reassigned; the graph runs on graphopt's code, "
                    "which follows it (optimize the model again to export the new weights)")


def _retarget(values: dict | list, moved: dict[int, torch.Tensor]) -> None:
    for key, value in (values.items() if isinstance(values, dict) else enumerate(values)):
        if id(value) in moved:
            values[key] = moved[id(value)]


def _short(source: str) -> str:
    """`L['self']._modules['lin']._parameters['weight']` -> `lin.weight`."""
    name = re.sub(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", r".\1", source)
    return re.sub(r"^L\['[^']*'\]\.", "", name) or "a weight"


def _bump(*_: Any) -> None:
    # A model's forward that builds a module (`self.layers[:n]` makes a ModuleList) runs
    # this hook while Dynamo traces it: counted there, the count would become a guard
    # that fails at every call. What a compiled step assigns is no weight change.
    if not torch.compiler.is_compiling():
        _assignments[0] += 1


@functools.cache
def count_assignments() -> None:
    """From the first Backend that freezes weights on (not at import), count every
    assignment of a parameter, buffer or module in the process: torch has no per-module
    hook for them. Before that Backend's first trace, not at its first graph: a forward
    that builds a module (transformers' Llama slices its ModuleList) has Dynamo guard on
    the registration hooks, and a stored trace must find the same hooks in a later
    process as where it was traced."""
    torch.nn.modules.module.register_module_parameter_registration_hook(_bump)
    torch.nn.modules.module.register_module_buffer_registration_hook(_bump)
    torch.nn.modules.module.register_module_module_registration_hook(_bump)
