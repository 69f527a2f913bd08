"""One run of a Dynamo graph on its fake values, before anything is compiled.

It tells the runtime two things no compiled form hides from it:
- the splitting nodes: nodes that issue an ATen op a device graph cannot replay
  (the rules of `safety.py`) or one the user lists in `cudagraph_splitting_ops`,
  each with the reason and the user's line;
- which inputs the graph writes in place (a KV cache): those are used in place
  by the runtime, never copied.

Watching ATen ops on fake tensors costs no real compute and sees what Inductor's
kernels would hide at run time (they bypass the dispatcher).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _compat
from .safety import problem_of


@dataclass
class GraphFindings:
    splitting_nodes: dict[torch.fx.Node, str]   # node -> why it must run outside a device graph
    written: list[bool]                         # per input: the graph writes it in place


def fake_run(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], splitting_ops: Iterable[str]) -> GraphFindings:
    fake_mode, fakes = _compat.backend_fakes(example_inputs)
    if fake_mode is None:
        raise RuntimeError("graphopt's runtime needs the fake mode Dynamo compiles in; "
                           "call the Backend from torch.compile")
    watcher = _OpWatcher(set(splitting_ops), fakes)
    with fake_mode, watcher:
        _NodeInterpreter(gm, watcher).run(*fakes)
    return GraphFindings(watcher.found, watcher.written)


class _OpWatcher(TorchDispatchMode):
    def __init__(self, splitting_ops: set[str], inputs: list[Any]):
        super().__init__()
        self.splitting_ops = splitting_ops
        self.node: torch.fx.Node | None = None
        self.found: dict[torch.fx.Node, str] = {}
        self.storages = [StorageWeakRef(x.untyped_storage()) if isinstance(x, torch.Tensor) else None
                         for x in inputs]
        self.written = [False] * len(inputs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in _compat.written_arguments(func, args, kwargs):
            if isinstance(value, torch.Tensor):
                storage = StorageWeakRef(value.untyped_storage())
                self.written = [w or (s is not None and storage == s) for w, s in zip(self.written, self.storages)]
        if self.node is not None and self.node not in self.found:
            reason = None
            if str(func) in self.splitting_ops or str(func.overloadpacket) in self.splitting_ops:
                reason = f"{func.overloadpacket} is in cudagraph_splitting_ops"
            elif (problem := problem_of(func, args, kwargs)) is not None:
                reason = _without_location(problem.message)
            if reason is not None:
                self.found[self.node] = f"{reason} (at {_location(self.node)})"
        return func(*args, **kwargs)


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


def _without_location(message: str) -> str:
    return re.sub(r", at [^:]*:\d+:", ":", message, count=1).split(" To fix:")[0]


def _location(node: torch.fx.Node) -> str:
    """The user's `file:line` that produced `node`, from Dynamo's stack trace."""
    trace = node.meta.get("stack_trace") or ""
    found = re.findall(r'File "([^"]+)", line (\d+)', trace)
    return f"{found[-1][0]}:{found[-1][1]}" if found else "<unknown>"
