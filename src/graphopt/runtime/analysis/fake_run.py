"""One run of a Dynamo graph on its fake values, before anything is compiled.

It tells the runtime three things no compiled form hides from it:
- the splitting nodes: nodes that issue an ATen op a device graph cannot replay
  (the rules of `safety.py`) or one the user lists in `cudagraph_splitting_ops`,
  each with the reason and the user's line;
- which inputs the graph writes in place (a KV cache): those are used in place
  by the runtime, never copied;
- for each group of symbols that may be the batch, whether the graph keeps its
  rows independent, or the first op that mixes them (`rows.py`): padding is legal
  only in the first case.

Watching ATen ops on fake tensors costs no real compute and sees what Inductor's
kernels would hide at run time (they bypass the dispatcher).
"""

from __future__ import annotations

import linecache
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..._compat import fake, ops
from ..._compat.names import TorchDispatchMode
from .rows import BatchRows, Mixes
from .safety import problem_of


@dataclass
class GraphFindings:
    splitting_nodes: dict[torch.fx.Node, str]   # node -> why it must run outside a device graph
    written: list[bool]                         # per input: the graph writes it in place
    mixing: dict[tuple, str | None]             # per candidate batch (its symbols): why its rows mix, or None


def fake_run(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], splitting_ops: Iterable[str],
             batches: Iterable[tuple] = (), rowwise_ops: Iterable[str] = ()) -> GraphFindings:
    fake_mode, fakes = fake.backend_fakes(example_inputs)
    if fake_mode is None:
        raise RuntimeError("graphopt's runtime needs the fake mode Dynamo compiles in; "
                           "call the Backend from torch.compile")
    rows = [BatchRows(symbols, fakes, set(rowwise_ops)) for symbols in batches]
    watcher = _OpWatcher(set(splitting_ops), fakes, rows)
    with fake.fake_tracing(fake_mode), watcher:
        outputs = _NodeInterpreter(gm, watcher).run(*fakes)
    for state in rows:
        if state.why is None:
            state.why = _mixed_output(state, outputs)
    return GraphFindings(watcher.found, watcher.written, {state.symbols: state.why for state in rows})


class _OpWatcher(TorchDispatchMode):
    def __init__(self, splitting_ops: set[str], inputs: list[Any], rows: list[BatchRows]):
        super().__init__()
        self.rows = rows
        self.splitting_ops = splitting_ops
        self.node: torch.fx.Node | None = None
        self.found: dict[torch.fx.Node, str] = {}
        self.storages = [StorageWeakRef(x.untyped_storage()) if isinstance(x, torch.Tensor) else None
                         for x in inputs]
        self.written = [False] * len(inputs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in ops.written_arguments(func, args, kwargs):
            if isinstance(value, torch.Tensor):
                storage = StorageWeakRef(value.untyped_storage())
                self.written = [w or (s is not None and storage == s) for w, s in zip(self.written, self.storages)]
        if self.node is not None and self.node not in self.found:
            reason = None
            if str(func) in self.splitting_ops or str(func.overloadpacket) in self.splitting_ops:
                reason = f"{func.overloadpacket} is in cudagraph_splitting_ops"
            elif (problem := problem_of(func, args, kwargs)) is not None:
                reason = problem.summary
            if reason is not None:
                self.found[self.node] = f"{reason} (at {_location(self.node)})"
        out = func(*args, **kwargs)
        for state in self.rows:
            if state.why is None:
                state.at = self.node
                try:
                    state.step(func, args, kwargs, out)
                except Mixes as mixes:
                    state.why = f"{func.overloadpacket} at {_location(self.node, code=True)} {mixes}"
                except Exception as error:  # noqa: BLE001 - an unproven graph is captured at exact sizes
                    state.why = (f"the row analysis could not follow {func.overloadpacket} at "
                                 f"{_location(self.node)} ({type(error).__name__}: {error})")
        return out


class _NodeInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, watcher: _OpWatcher):
        super().__init__(gm)
        self.watcher = watcher

    def run_node(self, node: torch.fx.Node) -> Any:
        self.watcher.node = node
        try:
            return super().run_node(node)
        finally:
            self.watcher.node = None


def _mixed_output(state: BatchRows, outputs: Any) -> str | None:
    """Why an output of the graph is not one row per row of the batch, or None."""
    for i, value in enumerate(outputs if isinstance(outputs, (tuple, list)) else (outputs,)):
        if not isinstance(value, torch.Tensor):
            continue
        rows = state.of(value)
        if rows is not None and rows.outer != 1:
            return f"output {i} holds rows of several ranks interleaved"
        order = None if rows is None else rows.order or (rows.index and rows.index.order)
        if order is not None:
            return (f"output {i} holds rows of the batch in the order of the sort at "
                    f"{_location(state.sorted_at.get(order), code=True)}, or positions in that order")
        if state.groups_of(value) is not None:
            return f"output {i} holds counts taken over every row of the batch"
        if rows is None and state.written_intermediate(value):
            return (f"output {i} is a tensor rows of the batch were written into at positions taken "
                    "from data, so padded rows would write into it too")
    return None


def _location(node: torch.fx.Node | None, code: bool = False) -> str:
    """The user's `file:line` that produced `node`, from Dynamo's stack trace (with
    `code`, followed by the line itself)."""
    trace = (node.meta.get("stack_trace") if node is not None else None) or ""
    found = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not found:
        return "<unknown>"
    where = f"{found[-1][0]}:{found[-1][1]}"
    text = linecache.getline(found[-1][0], int(found[-1][1])).strip()
    return f"{where} (`{text[:80]}`)" if code and text else where
