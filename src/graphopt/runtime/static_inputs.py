"""Static inputs: the one place a call's inputs are copied to where a device graph reads them.

`StaticInputs` (one per runner) holds the user inputs' buffers; `CapturedInputs` (one
per captured graph) the tensors a capture read, and how a later call's tensors take
their place. Neither captures or replays anything.


A user input with a batch dim gets one buffer, allocated at the largest capture
size and sliced to each size it runs at (nano-vllm's `capture_cudagraph`), so
every capture size reads from the same memory. A call copies its rows in and
fills the padded rows with the input's pad value. Inputs without a batch dim get
one buffer of their own shape. A broadcast dim (stride 0, from `expand`) keeps
stride 0. Static inputs (parameters, buffers, inputs marked
static, mutated inputs) and SymInts are never copied: they are passed through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..report import Report
from .analysis.signature import Signature

if TYPE_CHECKING:
    from .device_graph import DeviceGraph


class _Target(NamedTuple):
    """Where a user input goes, for one batch at one capture size."""
    base: torch.Tensor               # its buffer at the capture size (one row on broadcast dims)
    broadcast: list[int]             # its broadcast dims, copied from one row
    rows: torch.Tensor               # the buffer's first `batch` rows: what the input is copied into
    padding: torch.Tensor | None     # the rows after them, filled with the pad value; None: none
    arg: torch.Tensor                # what the graph is passed (the buffer, expanded where broadcast)


class StaticInputs:
    """A runner's user inputs, copied (and padded) into buffers shared by every capture
    size. It does not decide the size (the dispatcher does) nor know device graphs."""

    def __init__(self, signature: Signature, largest: int, clone_input: bool):
        self.signature = signature
        self.largest = largest
        # Inputs without a batch dim are left to the device graph when clone_input is off:
        # it copies one only when it is not the captured tensor.
        self.copied = [i for i in signature.copied if signature.batch_dims[i] is not None or clone_input]
        self.buffers: dict[tuple[int, int | None], torch.Tensor] = {}
        self.layouts: dict[tuple[int, tuple[int, ...]], tuple[list[int], bool, bool]] = {}
        # (input, batch, size, shape, strides) -> where that input goes: the same few
        # keys every call, so a call does no layout work and makes no views.
        self.targets: dict[tuple, _Target] = {}

    def fill(self, args: list[Any], batch: int | None, size: int | None) -> list[Any]:
        """`args` (the caller's list, rewritten) for running at `size`: user inputs
        copied (and padded) into their buffers, the batch SymInt set to `size`,
        everything else as given."""
        for i in self.copied:
            value = args[i]
            key = (i, batch, size, value.shape, value.stride())
            target = self.targets.get(key)
            if target is None:
                target = self.targets[key] = self._target(i, value, batch, size)
            base, broadcast, rows, padding, arg = target
            if base.data_ptr() != value.data_ptr():
                source = value
                for d in broadcast:
                    source = source.narrow(d, 0, 1)
                rows.copy_(source)
            if padding is not None:
                padding.fill_(self.signature.pads[i])
            args[i] = arg
        for i in self.signature.batch_symints:
            args[i] = size
        return args

    def _target(self, i: int, value: torch.Tensor, batch: int | None, size: int | None) -> _Target:
        """Where input i, laid out as `value` is, goes for `batch` rows at capture size `size`."""
        broadcast, has_rows, outermost = self._layout(i, value)
        base = self._buffer(i, value, broadcast, outermost, size if has_rows else None)
        dim = self.signature.batch_dims[i]
        padded = has_rows and batch < size
        return _Target(base, broadcast, rows=base.narrow(dim, 0, batch) if padded else base,
                       padding=base.narrow(dim, batch, size - batch) if padded else None,
                       arg=base.expand(_shape_at(value, dim, size)) if broadcast else base)

    def _layout(self, i: int, value: torch.Tensor) -> tuple[list[int], bool, bool]:
        """(broadcast dims, whether it has rows to pad, whether its batch dim is
        outermost) for input i laid out as `value` is: Dynamo guards the layout, so
        it is worked out once per stride pattern."""
        key = (i, value.stride())
        layout = self.layouts.get(key)
        if layout is None:
            dim = self.signature.batch_dims[i]
            # A broadcast dim (stride 0, as from expand) stays one in the buffer: the
            # compiled graph was traced with that layout, and its rows are one row anyway.
            broadcast = [d for d in range(value.dim()) if value.stride(d) == 0 and value.shape[d] > 1]
            rows = dim is not None and dim not in broadcast
            layout = self.layouts[key] = (broadcast, rows, rows and _outermost(value, dim))
        return layout

    def _buffer(self, i: int, value: torch.Tensor, broadcast: list[int], outermost: bool,
                size: int | None) -> torch.Tensor:
        """Input i's buffer at `size` rows (None: no rows to pad), one row on broadcast dims."""
        dim = self.signature.batch_dims[i]
        # Without rows to pad, a size of another symbol (a table's length) keys the buffer.
        key = (i, self.largest if outermost else size if size is not None else tuple(value.shape))
        buffer = self.buffers.get(key)
        if buffer is None:
            shape = [1 if d in broadcast else n for d, n in enumerate(value.shape)]
            if size is not None:
                shape[dim] = key[1]
            buffer = self.buffers[key] = _empty_like(value, shape)
        return buffer.narrow(dim, 0, size) if outermost else buffer


class CapturedInputs:
    """The tensors one device graph read at its capture, and how a call's arguments
    take their place: a tensor at a new address is copied into the captured one,
    unless it is a static argument (parameter, buffer, written input), which the graph
    must read and write itself: a new tensor of the same size, stride and dtype (the
    KV cache of a new `generate()`) is rebound where the device graph can; otherwise
    the graph must be captured again (`take` says why). A graph that rebinds is
    captured on a private alias of each static argument that is not a parameter, so
    that rebinding moves the alias and never the caller's tensor."""

    def __init__(self, args: tuple, static: list[bool], rebinds: bool):
        hows = [_how(a, s) for a, s in zip(args, static)]
        if rebinds:
            args = tuple(_alias(a) if how == "rebind" else a for a, how in zip(args, hows))
        self.args = args  # what the capture runs on
        self.tensors = [(i, a, how) for i, (a, how) in enumerate(zip(args, hows)) if isinstance(a, torch.Tensor)]

    def take(self, args: tuple, graph: DeviceGraph, report: Report) -> str | None:
        """Make the captured tensors hold this call's: copy, or rebind `graph`. Returns
        why the graph must be captured again instead, or None."""
        rebound = 0
        for i, captured, how in self.tensors:
            value = args[i]
            if value.data_ptr() == captured.data_ptr():
                continue
            if how == "copy":
                captured.copy_(value)
                continue
            why = "it is a parameter" if how == "recapture" else graph.rebind(captured, value)
            if why is not None:
                return f"input {i} is a new tensor and {why}"
            rebound += 1
        report.rebinds += rebound
        return None


def _how(value: Any, static: bool) -> str:
    """How a replay takes a new tensor in this argument's place: "copy" it into
    the captured one, "rebind" the graph to it, or "recapture". A parameter keeps
    being captured again: Dynamo's guards recompile for a reassigned one first,
    so this is rare, and an alias would not carry its `requires_grad`."""
    if not static or not isinstance(value, torch.Tensor):
        return "copy"
    return "recapture" if isinstance(value, torch.nn.Parameter) else "rebind"


def _alias(value: torch.Tensor) -> torch.Tensor:
    """A new tensor object on `value`'s memory, with its size, stride and offset:
    what the graph is captured on, so that a rebind moves it and not `value`."""
    with torch.inference_mode(value.is_inference()):
        return torch.empty(0, dtype=value.dtype, device=value.device).set_(
            value.untyped_storage(), value.storage_offset(), value.size(), value.stride())


def _shape_at(value: torch.Tensor, dim: int | None, size: int | None) -> list[int]:
    shape = list(value.shape)
    if dim is not None:
        shape[dim] = size
    return shape


def _outermost(value: torch.Tensor, dim: int) -> bool:
    """Whether `dim` is the slowest-moving dim of `value`: then a slice of its
    first rows is dense and has the strides a tensor of that many rows would have."""
    return all(value.stride(dim) >= value.stride(d) for d in range(value.dim()) if value.shape[d] > 1)


def _empty_like(value: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """An empty tensor of `shape` with `value`'s dtype, device and dim order: the
    compiled graph was traced with inputs of that layout."""
    order = sorted(range(value.dim()), key=lambda d: value.stride(d), reverse=True)
    strides = [0] * value.dim()
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return torch.empty_strided(shape, strides, dtype=value.dtype, device=value.device)
