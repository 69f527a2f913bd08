"""What the runtime knows of one compiled graph's inputs and outputs, read from
the graph Dynamo traced (its placeholders' sources and symbolic sizes).

    inputs:  static (parameter, buffer, marked static) | mutated | user | SymInt
    batch:   the symbols of the batch dims, e.g. s0 in input_ids: [s0, 1]
    outputs: which dim of each output is s0 (logits: [s0, 1, vocab] -> dim 0)

Padding a batch up to a capture size is legal only when the graph's rows are
independent (`rows.py` proves it during the fake run; `mixing` gives, per
symbol, the op that mixes them) and every place the batch symbol appears is a
plain batch dim the runtime can pad and slice: a user input's dim, a SymInt
input equal to it, an output's dim. A static input sized by the batch
(transformers' StaticCache), an output of size 2*s0, a SymInt output tied to it
or an op that mixes rows make the graph run at exact sizes instead;
`exact_reason` says which.

With the default dynamic dims (dim 0 of every user input), a symbol whose rows
are not independent (a lookup table passed beside the ids) is not taken as the
batch when another symbol's are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import sympy
import torch
import torch.fx

from ..._compat import dynamo, shapes
from ..._compat.names import tensor_leaves, tree_leaves


@dataclass
class Signature:
    kinds: list[str]                       # per input: "static", "mutated", "input" or "symint"
    batch_dims: list[int | None]           # per input: its dim that is a batch symbol
    pads: list[float | int]                # per input: the value padded rows get
    batch_symints: list[int]               # SymInt inputs that are a batch symbol
    other_symints: list[int]               # SymInt inputs of other symbols: part of the capture point
    out_dims: list[int | None]             # per output: its dim that is a batch symbol
    exact_reason: str | None = None        # why padding is illegal, or None
    static_batch: int | None = None        # a graph without a batch symbol: its fixed batch size
    other_names: str = ""                  # where the other symbols come from, for messages
    batch_names: str = ""                  # which inputs' dims are the batch, for messages
    # SymInt outputs computed from SymInt inputs no tensor depends on (a token count a
    # sliding-window cache keeps as a Python int): (output, expression, {symbol: input}).
    # A replay would return the captured call's number, so the runner computes them.
    number_outputs: list[tuple[int, Any, dict]] = field(default_factory=list)

    @property
    def copied(self) -> list[int]:
        """User inputs: copied into static buffers."""
        return [i for i, kind in enumerate(self.kinds) if kind == "input"]

    @property
    def static(self) -> list[bool]:
        """Inputs a device graph must read and write in place: a different tensor means a new capture."""
        return [kind in ("static", "mutated") for kind in self.kinds]

    @property
    def has_batch(self) -> bool:
        return bool(self.batch_symints) or any(d is not None for d in self.batch_dims)

    def batch_of(self, args: Sequence[Any]) -> int | None:
        """This call's batch size, or None without a batch symbol. Raises
        BatchMismatch when the inputs sized by the batch disagree."""
        sizes = {int(args[i]) for i in self.batch_symints} or \
            {args[i].shape[dim] for i, dim in enumerate(self.batch_dims) if dim is not None}
        if len(sizes) > 1:
            raise BatchMismatch(f"the inputs sized by the batch disagree ({sorted(sizes)} rows)")
        return sizes.pop() if sizes else None

    def other_sizes(self, args: Sequence[Any]) -> tuple:
        return tuple(int(args[i]) for i in self.other_symints)

    def numbers_of(self, args: Sequence[Any]) -> dict[int, int]:
        """This call's number outputs, by output index."""
        return {i: int(expr.subs({symbol: int(args[j]) for symbol, j in inputs.items()}))
                for i, expr, inputs in self.number_outputs}


class BatchMismatch(ValueError):
    """A call whose batch-sized inputs have different numbers of rows."""


def batch_candidates(gm: torch.fx.GraphModule, dynamic_dims: Mapping[str, int] | None,
                     example_inputs: Sequence[Any] = ()) -> list[tuple]:
    """The batches the graph may have, in input order, each as the symbols of its
    dynamic dims: the declared dims are one batch; with the default dims, the
    symbols that took the same value when traced (input_ids: s0 and
    attention_mask: s1, both 3 rows) are one, a lookup table's (10 rows) another."""
    found: dict[Any, list] = {}
    for dim, example in _batch_dims(dynamo.graph_inputs(gm, example_inputs), dynamic_dims):
        expr = shapes.symbol_of(example.shape[dim])
        if expr is None or not expr.is_Symbol:
            continue
        symbols = found.setdefault(None if dynamic_dims is not None else shapes.size_hint(example.shape[dim]), [])
        if expr not in symbols:
            symbols.append(expr)
    return [tuple(symbols) for symbols in found.values()]


def signature_of(gm: torch.fx.GraphModule, dynamic_dims: Mapping[str, int] | None,
                 pad_values: Mapping[str, float | int], written: list[bool],
                 example_inputs: Sequence[Any], mixing: Mapping[tuple, str | None]) -> Signature:
    """Read a Dynamo graph's signature. `dynamic_dims` ({argument: dim}, None for
    the default dim 0) picks the batch symbols; `pad_values` gives padded rows'
    values; `written[i]` says the graph writes input i in place (it is then used
    in place: a "mutated" input); `example_inputs` are the backend's; `mixing`
    ({batch's symbols: why or None}, from the fake run) says whose rows are independent."""
    inputs = dynamo.graph_inputs(gm, example_inputs)
    batch = _batch_symbols(inputs, dynamic_dims, mixing)
    kinds = ["mutated" if w and kind == "input" else kind for (kind, _, _), w in zip(inputs, written)]
    pads = [pad_values.get(name, 0) if name else 0 for _, name, _ in inputs]
    batch_dims: list[int | None] = []
    batch_symints, other_symints, problems = [], [], []
    for i, (kind, name, example) in enumerate(inputs):
        where = f"input {name or i}"
        if kind == "symint":
            expr = shapes.symbol_of(example)
            batch_dims.append(None)
            if expr in batch:
                batch_symints.append(i)
            elif expr is not None and expr.free_symbols & batch:
                problems.append(f"{where} is a size computed from the batch ({expr})")
            elif expr is not None:
                other_symints.append(i)
            continue
        dim = _batch_dim(example, batch, where, problems) if isinstance(example, torch.Tensor) else None
        if dim is not None and kinds[i] == "static":
            problems.append(f"{where} is a static input (parameter, buffer or marked static) sized by the batch")
        if dim is not None and kinds[i] == "mutated":
            problems.append(f"{where} is written in place by the graph and sized by the batch "
                            "(a KV cache per sequence)")
        batch_dims.append(dim)
    other_symints, out_dims, number_outputs = _outputs(gm, inputs, batch, other_symints, problems)
    # The op that mixes rows names the user's line: it comes first.
    problems[:0] = [why for symbols, why in mixing.items() if batch & set(symbols) and why is not None]
    return Signature(kinds, batch_dims, pads, batch_symints, other_symints, out_dims,
                     exact_reason=problems[0] if problems else None,
                     static_batch=None if batch else _static_batch(inputs, dynamic_dims),
                     other_names=", ".join(sorted({f"from argument {inputs[i][1]!r}" if inputs[i][1] else
                                                 f"input {i}" for i in other_symints})),
                     batch_names=", ".join(f"dim {dim} of {inputs[i][1] or f'input {i}'!r}"
                                           for i, dim in enumerate(batch_dims) if dim is not None),
                     number_outputs=number_outputs)


def _outputs(gm: torch.fx.GraphModule, inputs: list, batch: set, other_symints: list[int],
             problems: list[str]) -> tuple[list[int], list[int | None], list]:
    """(the other symbols' SymInt inputs, each output's batch dim, the number outputs
    the runtime computes from other symbols): an other symbol that reaches no tensor
    is left out of the capture point, unless an output needs it and the runtime could not compute it."""
    symbols = {expr: i for i in other_symints if isinstance(expr := shapes.symbol_of(inputs[i][2]), sympy.Symbol)}
    numbers_only = _reaching_no_tensor(gm, symbols)
    for value in _output_values(gm):
        if (expr := shapes.symbol_of(value)) is not None and not expr.free_symbols <= set(symbols):
            numbers_only = {k: v for k, v in numbers_only.items() if k not in expr.free_symbols}
    other_symints = [i for i in other_symints if i not in numbers_only.values()]
    number_outputs = []
    out_dims = []
    for i, value in enumerate(_output_values(gm)):
        where = f"output {i}"
        if isinstance(value, torch.Tensor):
            out_dims.append(_batch_dim(value, batch, where, problems))
            continue
        out_dims.append(None)
        expr = shapes.symbol_of(value)
        if expr is not None and expr.free_symbols & batch:
            problems.append(f"{where} is a size computed from the batch ({expr})")
        elif expr is not None and expr.free_symbols & set(numbers_only):
            number_outputs.append((i, expr, {symbol: symbols[symbol] for symbol in expr.free_symbols}))
    return other_symints, out_dims, number_outputs


def _reaching_no_tensor(gm: torch.fx.GraphModule, symbols: dict) -> dict:
    """Of `symbols` ({symbol: input}), those no tensor of the graph depends on: in no
    size, stride or offset, and in no argument of an op that makes a tensor. Only
    numbers are computed from them, so a device graph captured for one value serves
    every value."""
    left = dict(symbols)
    for node in gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        tensors = tensor_leaves(value)
        found: set = set()
        for t in tensors:
            for size in (*t.shape, *t.stride(), t.storage_offset()):
                found |= getattr(shapes.symbol_of(size), "free_symbols", set())
        if tensors and node.op != "placeholder":
            for arg in tree_leaves((node.args, node.kwargs)):
                number = arg.meta.get("example_value", arg.meta.get("val")) if isinstance(arg, torch.fx.Node) else arg
                found |= getattr(getattr(getattr(number, "node", None), "expr", None), "free_symbols", set())
        for symbol in found:
            left.pop(symbol, None)
    return left


def _batch_dims(inputs: list, dynamic_dims: Mapping[str, int] | None) -> list[tuple[int, Any]]:
    """(dynamic dim, example) of every user input that has one: dim 0 by default."""
    found = []
    for kind, name, example in inputs:
        if kind != "input" or not isinstance(example, torch.Tensor) or example.dim() == 0:
            continue
        if dynamic_dims is None:
            found.append((0, example))
        elif name in dynamic_dims and -example.dim() <= dynamic_dims[name] < example.dim():
            found.append((dynamic_dims[name], example))
    return found


def _batch_symbols(inputs: list, dynamic_dims: Mapping[str, int] | None, mixing: Mapping[tuple, str | None]) -> set:
    """The batch symbols, chosen among the candidate batches (`batch_candidates`, the
    keys of `mixing` in input order): the first whose rows are independent. When none
    is, the first, unless Dynamo specialised the batch (size 1): a symbol whose rows
    mix is then a table's. Declared dims are one candidate, always the batch."""
    batches = list(mixing)
    chosen = next((symbols for symbols in batches if mixing[symbols] is None), None)
    if chosen is None and batches and (dynamic_dims is not None or _static_batch(inputs, dynamic_dims) is None):
        chosen = batches[0]
    return set(chosen or ())


def _static_batch(inputs: list, dynamic_dims: Mapping[str, int] | None) -> int | None:
    """A graph Dynamo specialised to one batch size (size 1 always is): that size."""
    for dim, example in _batch_dims(inputs, dynamic_dims):
        if isinstance(example.shape[dim], int):
            return example.shape[dim]
    return None


def _batch_dim(value: torch.Tensor, batch: set, where: str, problems: list[str]) -> int | None:
    if not batch:
        return None
    dims = [d for d, size in enumerate(value.shape) if shapes.symbol_of(size) in batch]
    tied = [d for d, size in enumerate(value.shape) if d not in dims and
            (expr := shapes.symbol_of(size)) is not None and expr.free_symbols & batch]
    if len(dims) > 1 or tied:
        problems.append(f"{where} of shape {tuple(value.shape)} depends on the batch in a way "
                        "padding and slicing rows cannot undo")
        return None
    return dims[0] if dims else None


def _output_values(gm: torch.fx.GraphModule) -> list[Any]:
    (outputs,) = gm.graph.output_node().args
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return [o.meta.get("example_value", o.meta.get("val")) if isinstance(o, torch.fx.Node) else o
            for o in outputs]
