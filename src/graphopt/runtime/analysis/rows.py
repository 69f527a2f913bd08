"""Row independence: whether padding a graph's batch can change its real rows.

Padding a batch of 3 up to a capture size of 4 is legal only when row 3 cannot
reach rows 0-2: every real row of every output must be computed from the same row
of the batch-sized inputs and from nothing else sized by the batch. This module
proves it op by op during the fake run, for one batch at a time: the symbols of the
dynamic dims that take the same value (Dynamo may give input_ids and attention_mask
one each), called `s` below. Each tensor is either

    shared    computed without reading any row (weights, constants, other inputs), or
    rows(d)   its dim d has size outer*s*c, and the c entries of row r (in each of
              `outer` blocks: the ranks' rows after an all-gather) depend on row r alone.

An op keeps rows apart only when a rule in `row_rules.py` or `row_views.py` says so;
one that touches rows without a rule, or mixes them, makes padding illegal:

    h = relu(x @ w.t())      rows(0) -> rows(0)   pointwise; the matmul contracts another dim
    m = h - h.mean(0)        rows(0) -> mixes     a reduction along the batch dim

Writes of rows into a shared tensor at positions chosen per row (`cache[slots] = k`)
are trusted, as a padded row writes where `pad_values` sends it; that tensor may
then only be read per row (`cache[slots]`). The batch size may size tensors
(`zeros(s)`, `arange(s)`, views) but not enter a computation as a number. Ops in
`rowwise_ops` map their inputs' rows to each output's dim sized by the batch.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..._compat import ops
from ..._compat.names import tree_leaves
from . import row_indexing, row_sorts, row_views  # noqa: F401 - register their rules
from .row_rules import (
    METADATA,
    NO_DATA,
    PER_ROW_WRITES,
    RULES,
    SIZE_ARGUMENTS,
    Call,
    Groups,
    Mixes,
    Rows,
    free,
    pointwise_rule,
    positional,
    rowwise,
)


class BatchRows:
    """What one batch's rows reach during a fake run: the state of every tensor, the
    storages rows were written into, and why padding is illegal (`why`, set by the
    first op that mixes rows; None while rows stay independent)."""

    def __init__(self, symbols: tuple, inputs: list[Any], rowwise_ops: set[str]):
        self.symbols = symbols
        self.symbol = symbols[0]  # each of `symbols` stands for it in sizes
        self.rowwise_ops = rowwise_ops
        # Keyed by id(), holding the tensor: a dead tensor's id would be reused.
        self.rows: dict[int, tuple[Rows, torch.Tensor]] = {}
        self.input_storages = {_storage(t) for t in inputs if isinstance(t, torch.Tensor)}
        for t in inputs:
            if isinstance(t, torch.Tensor):
                dims = [d for d, size in enumerate(t.shape) if self.carries(size)]
                if dims:
                    self.rows[id(t)] = (Rows(dims[0]), t)
        self.groups: dict[int, tuple[Groups, torch.Tensor]] = {}
        self.written: set[StorageWeakRef] = set()
        self.why: str | None = None
        self.at: Any = None  # what the caller says the current op is (its FX node)
        self.sorted_at: dict[Any, Any] = {}  # each sort's order -> `at` of the sort

    def carries(self, value: Any) -> bool:
        """`value` (a size or a number) is computed from the batch size."""
        return bool(free(value) & set(self.symbols))

    def expr(self, size: Any) -> Any:
        """`size` as a sympy expression in which the batch is `self.symbol`."""
        expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.sympify(size)
        return expr.subs({other: self.symbol for other in self.symbols[1:]})

    def of(self, t: torch.Tensor) -> Rows | None:
        found = self.rows.get(id(t))
        return found[0] if found is not None else None

    def groups_of(self, t: torch.Tensor) -> Groups | None:
        found = self.groups.get(id(t))
        return found[0] if found is not None else None

    def written_intermediate(self, t: torch.Tensor) -> bool:
        """`t` is a tensor the graph made (not an input) that rows were written into."""
        storage = _storage(t)
        return storage in self.written and storage not in self.input_storages

    def step(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Follow the rows through one ATen call; raises Mixes when it mixes them."""
        leaves = tree_leaves(out)
        outs = [t for t in leaves if isinstance(t, torch.Tensor)]
        call = Call(func, args, kwargs, outs, self)
        reads = [] if call.name in NO_DATA else [t for t in call.tensors if self.of(t) is not None]
        reads_written = [t for t in call.tensors if self.of(t) is None and _storage(t) in self.written]
        numbers = [v for v in tree_leaves((args, kwargs)) if self.carries(v)]
        sized = [t for t in outs if call.batch_dims(t)]
        counts = [t for t in call.tensors if self.groups_of(t) is not None]
        if not (reads or reads_written or numbers or sized or counts) or call.name in METADATA:
            return
        declared = bool({str(func.overloadpacket), str(func)} & self.rowwise_ops)
        rule = rowwise if declared else RULES.get(call.name) or pointwise_rule(func)
        self._check_sorted(rule, reads, counts)
        if rule is None:
            raise Mixes("has no rule saying it keeps rows apart")
        self._check_numbers(call)
        result = rule(call)
        for t, rows in zip(outs, result):
            self._set(call, t, rows)
            if getattr(rows, "order", None) is not None:
                self.sorted_at.setdefault(rows.order, self.at)
        writes = [t for t in ops.written_arguments(func, args, kwargs) if isinstance(t, torch.Tensor)]
        self._check_reads(call, reads, reads_written, result, writes, leaves)
        if reads:
            for t in writes:
                self._written_into(t, call.name)

    def _check_sorted(self, rule: Any, reads: list, counts: list) -> None:
        """What a sort moved or counted reaches only the rules that follow it (`row_sorts.py`)."""
        if counts and not getattr(rule, "reads_groups", False):
            raise Mixes("reads counts taken over every row of the batch")
        if any(self.of(t).order is not None for t in reads) and not getattr(rule, "keeps_order", False):
            raise Mixes("reads rows in a sorted order, which it is not known to keep")
        if any(positional(self.of(t)) for t in reads) and not getattr(rule, "reads_positions", False):
            raise Mixes("uses positions in a sorted order as numbers")

    def _check_numbers(self, call: Call) -> None:
        for name, value in call.named.items():
            if not any(self.carries(v) for v in tree_leaves(value)):
                continue
            if name not in SIZE_ARGUMENTS or name == "end" and call.name not in ("slice", "arange"):
                raise Mixes(f"uses the batch size as a number (its argument {name!r}), so a padded "
                            "batch changes the result")

    def _set(self, call: Call, t: torch.Tensor, rows: Rows | Groups | None) -> None:
        dims = call.batch_dims(t)
        if isinstance(rows, Groups):
            self.rows.pop(id(t), None)
            self.groups[id(t)] = (rows, t)
            return
        self.groups.pop(id(t), None)
        if rows is None and dims:
            raise Mixes(f"gives a result of shape {_shape(t)} whose size carries the batch but whose "
                        "rows are not one per row of the batch")
        if rows is not None and dims != [rows.dim]:
            raise Mixes(f"gives a result of shape {_shape(t)} sized by the batch in {len(dims)} dims")
        if rows is not None and self.symbol in sympy.cancel(self.expr(t.shape[rows.dim]) / self.symbol).free_symbols:
            raise Mixes(f"gives a result of shape {_shape(t)} whose size is computed from the batch")
        if rows is None:
            self.rows.pop(id(t), None)
        else:
            self.rows[id(t)] = (rows, t)

    def _check_reads(self, call: Call, reads: list, reads_written: list, result: list, writes: list,
                     leaves: list) -> None:
        """A value computed from rows must itself be rows (or be a per-row write)."""
        if not (reads or reads_written):
            return
        if any(not isinstance(v, torch.Tensor) and v is not None for v in leaves):
            raise Mixes("reads a number out of rows of the batch")
        for t, rows in zip(call.outs, result):
            if rows is not None or any(t is w for w in writes) or _empty(t):
                continue
            if call.name in PER_ROW_WRITES:
                self.written.add(_storage(t))
            elif reads or not _shares_storage(t, reads_written):
                raise Mixes(f"computes a result of shape {_shape(t)} that is not one per row from "
                            + ("rows of the batch" if reads else "a tensor rows were written into"))
        if not call.outs and not writes:
            raise Mixes("reads rows of the batch and returns nothing sized by it")

    def _written_into(self, t: torch.Tensor, name: str) -> None:
        storage = _storage(t)
        if storage in self.input_storages and name not in PER_ROW_WRITES:
            raise Mixes("writes rows into an input at positions not chosen per row, so padded rows "
                        "would write where eager does not (write per row, e.g. cache[slots] = k, with "
                        "pad_values sending padded rows to a scratch row)")
        if self.of(t) is None:
            self.written.add(storage)


def _storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _shares_storage(t: torch.Tensor, others: list[torch.Tensor]) -> bool:
    return any(_storage(t) == _storage(o) for o in others)


def _empty(t: torch.Tensor) -> bool:
    """Statically empty (a batch norm's saved statistics in eval mode): it holds no values."""
    return any(isinstance(n, int) and n == 0 for n in t.shape)


def _shape(t: torch.Tensor) -> tuple:
    return tuple(int(s) if isinstance(s, int) else str(s) for s in t.shape)
