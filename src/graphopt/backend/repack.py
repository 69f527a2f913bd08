"""Level-2 graphs whose compiled code holds Inductor's own copies of the frozen weights.

With `freeze_parameters=True`, Inductor's GEMM templates pack each weight for their
micro-kernel and its freezing folds weights into new constants, both at compile time:
an in-place weight update never reaches those copies. `refresh()` compiles such a graph
again from the weights as they are now (code loaded from a frozen entry makes its
constants again instead, where it can: frozen_code.py); graphopt's own folded
constants it recomputes in place (`passes/constant_fold.py`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch.fx

from ..report import Report


class Repackable:
    """A compiled graph `repack()` compiles again: `compile_again` runs Inductor, and with
    it graphopt's passes (the post-grad pass appends to `optimized`), without caches."""

    def __init__(self, compiled: Callable, compile_again: Callable[[], Callable],
                 optimized: list[tuple[torch.fx.GraphModule, dict]], graph_modules: list[torch.fx.GraphModule],
                 report: Report, held: list[list] | None = None):
        self.compiled, self.compile_again = compiled, compile_again
        # The lists of inputs compile_again reads: a reassigned weight is put in them (frozen_watch.py).
        self.held = held or []
        self.optimized, self.graph_modules, self.report = optimized, graph_modules, report
        self._boxed_call = getattr(compiled, "_boxed_call", False)  # Dynamo's calling convention

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args)

    def repack(self) -> None:
        remake = getattr(self.compiled, "remake", None)  # code loaded from a frozen entry (frozen_code.py)
        if remake is not None and remake():
            return
        report, old = self.report, [graph for graph, _ in self.optimized]
        passes, memory = len(report.passes), len(report.memory)
        self.optimized.clear()
        self.compiled = self.compile_again()
        # The report keeps the first compile's records; the graph refresh() folds is the new one.
        del report.passes[passes:], report.memory[memory:]
        self.graph_modules[:] = [g for g in self.graph_modules if not any(g is o for o in old)]
        report.repacks += 1
