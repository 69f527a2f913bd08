"""Capture safety: the operations a device graph cannot replay, found where they run.

A device graph records a step once and replays it on the same buffers. Three kinds
of operation break that contract, on CUDA and on the host alike:

- device->host syncs (`.item()`, `int()`/`float()`/`bool()` of a tensor, `torch.equal`,
  `.cpu()` of a CUDA tensor): the Python value read at capture would be baked into
  every replay, and on CUDA the stream capture itself fails;
- ops whose output shape depends on the data (`nonzero`, `masked_select`, `unique`,
  boolean-mask indexing, `repeat_interleave` with tensor repeats and no `output_size`):
  a replay writes fixed shapes;
- host->device copies from pageable (non-pinned) memory, which CUDA cannot capture.

`CaptureGuard` is a dispatch mode that is active during every capture (host and
CUDA), so a CPU test raises exactly the errors a GPU capture would. The device rules
read only the devices of the op's arguments, so they can be exercised on a CPU-only
machine with fake CUDA tensors.

Not visible to any dispatch mode: `.tolist()` and `.numpy()` of a CPU tensor read its
memory directly. On CUDA, `.tolist()` first copies to the host and is caught as a
device->host copy.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..._compat import autotune
from ..._compat.names import TorchDispatchMode, tensor_leaves
from ...kernels.collective import is_collective_op

_SYNC = ("copies a value from the device to the host: a replay would reuse the value read at capture, "
         "and a CUDA capture fails on the sync")
_SYNC_FIX = "compute it before the captured step, or keep it on the device (tensor ops instead of Python numbers)"
_SHAPE = "returns a tensor whose shape depends on the data, and a device graph replays fixed shapes"

# op name -> (what the user wrote, why it cannot be captured, what to do)
_RULES: dict[str, tuple[str, str, str]] = {
    "_local_scalar_dense": (".item() / int() / float() of a tensor", _SYNC, _SYNC_FIX),
    "item": (".item() / int() / float() of a tensor", _SYNC, _SYNC_FIX),
    "is_nonzero": ("bool() of a tensor, e.g. `if tensor:`", _SYNC,
                   "use torch.where instead of a Python branch, or decide before the captured step"),
    "equal": ("torch.equal", _SYNC, "keep (a == b) as a tensor, or compare outside the captured step"),
    "allclose": ("torch.allclose", _SYNC, "keep torch.isclose(a, b) as a tensor, or compare outside the captured step"),
    "nonzero": ("nonzero / argwhere", _SHAPE,
                "use torch.nonzero_static(x, size=...) or a mask with torch.where, or run it before the captured step"),
    "nonzero_numpy": ("nonzero(as_tuple=True)", _SHAPE, "use torch.nonzero_static(x, size=...) or a mask"),
    "argwhere": ("torch.argwhere", _SHAPE, "use torch.nonzero_static(x, size=...) or a mask"),
    "masked_select": ("torch.masked_select", _SHAPE, "use torch.where(mask, x, 0), which keeps the shape"),
    "_unique": ("torch.unique", _SHAPE, "compute it before the captured step"),
    "_unique2": ("torch.unique", _SHAPE, "compute it before the captured step"),
    "unique_dim": ("torch.unique(dim=...)", _SHAPE, "compute it before the captured step"),
    "unique_consecutive": ("torch.unique_consecutive", _SHAPE, "compute it before the captured step"),
    "unique_dim_consecutive": ("torch.unique_consecutive(dim=...)", _SHAPE, "compute it before the captured step"),
    "bincount": ("torch.bincount", _SHAPE, "scatter_add_ into a tensor of fixed size instead"),
}
_MASK_READ = ("boolean-mask indexing x[mask]", _SHAPE, "use torch.where(mask, x, other), which keeps the shape")
_MASK_WRITE = ("boolean-mask assignment x[mask] = v",
               "selects a data-dependent number of elements, which a CUDA capture cannot count without a sync",
               "use torch.where(mask, v, x), or x.masked_fill_(mask, v) for a scalar v")
_REPEATS = ("repeat_interleave with tensor repeats", _SHAPE,
            "pass output_size=... (the total length), which makes the shape static")
_TO_HOST = (".cpu() / .to('cpu') of a CUDA tensor", _SYNC,
            "keep the result on the device and copy it to the host after replay")
_PAGEABLE = ("a copy from pageable host memory to CUDA",
             "copies from non-pinned host memory, which CUDA cannot capture "
             "(and the host buffer may be gone at replay)",
             "copy into a static device buffer before the captured step, or pin the source (.pin_memory())")


@dataclass
class CaptureProblem:
    """One operation that cannot be captured: its ATen name, the full explanation
    (what, why, what to do, where), the user's `file:line`, and the explanation
    without the fix and the place (`summary`: for a message that names its own place)."""

    op: str
    message: str
    location: str
    summary: str = ""


class CaptureError(RuntimeError):
    """Raised at once when a capture meets an operation that cannot be replayed."""

    def __init__(self, problem: CaptureProblem):
        super().__init__(problem.message)
        self.op, self.message, self.location = problem.op, problem.message, problem.location


class CaptureGuard(TorchDispatchMode):
    """A dispatch mode that stops (or, with `collect=True`, records and lets run)
    every operation a device graph cannot replay. Push it above any recorder, so
    an op that raises here is never recorded. It also notes the process groups the
    step's collectives use (`groups`): the ranks of those must capture together."""

    def __init__(self, collect: bool = False):
        super().__init__()
        self.collect = collect
        self.problems: list[CaptureProblem] = []
        self.groups: list[str] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Off while torch.compile traces, on while its compiled code runs: a capture
        # sees the compiled step's ops instead of making Dynamo fall back to eager.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = problem_of(func, args, kwargs)
        # Inductor tunes a kernel at its first launch (a warm-up's), never in a replay:
        # the device->host reads of its timings are not the step's.
        if found is not None and autotune.tuning_at_run_time():
            found = None
        if found is not None:
            if not self.collect:
                raise CaptureError(found)
            self.problems.append(found)
        if is_collective_op(func):
            group = named_arguments(func, args, kwargs).get("group_name")
            if isinstance(group, str) and group not in self.groups:
                self.groups.append(group)
        return func(*args, **kwargs)


def check(fn: Callable, *args: Any, **kwargs: Any) -> list[CaptureProblem]:
    """Run `fn(*args, **kwargs)` once, as a capture would see it, and return every
    operation that would stop a capture, in order (`[]` when it can be captured).
    `fn` really runs, side effects (cache writes) included."""
    guard = CaptureGuard(collect=True)
    with torch.inference_mode(), guard:
        fn(*args, **kwargs)
    return guard.problems


_RECORDS_AUTOGRAD = ("the step records autograd history (grad mode is on and its outputs require grad), "
                     "which a device graph cannot replay: call it under torch.inference_mode() or "
                     "torch.no_grad(), or give the parameters requires_grad=False")


@dataclass
class Scan:
    """A step's run under the capture checks: what it returned, why a device graph
    must never capture it (None: it may), and the process groups it communicates over."""

    outputs: Any
    refusal: str | None
    groups: list[str]


def scan(fn: Callable, args: Sequence[Any]) -> Scan:
    """Run `fn(*args)` once, finding before any capture what a device graph could not
    replay: the first capture-unsafe op (with the user's line), or outputs that
    require grad (a replay rewrites the saved activations under their grad_fn, so a
    backward through them would read another step's values)."""
    guard = CaptureGuard(collect=True)
    with guard:
        outputs = fn(*args)
    refusal = None
    if guard.problems:
        first = guard.problems[0]
        refusal = f"{first.op} at {first.location}: {first.message}"
    elif any(t.requires_grad for t in tensor_leaves(outputs)):
        refusal = _RECORDS_AUTOGRAD
    return Scan(outputs, refusal, guard.groups)


def problem_of(func: Any, args: tuple, kwargs: dict) -> CaptureProblem | None:
    """The problem an ATen call would cause in a capture, or None. Decided from the
    op and its arguments only (devices included), before the op runs."""
    name = func.overloadpacket.__name__
    named = named_arguments(func, args, kwargs)
    rule = _RULES.get(name)
    if name == "index" and _has_mask(named.get("indices")):
        rule = _MASK_READ
    elif name in ("index_put", "index_put_", "_index_put_impl_") and _has_mask(named.get("indices")):
        rule = _MASK_WRITE
    elif name == "repeat_interleave" and isinstance(named.get("repeats"), torch.Tensor) \
            and named.get("output_size") is None:
        rule = _REPEATS
    elif name in ("_to_copy", "to", "copy_"):
        rule = _transfer_rule(name, named)
    if rule is None:
        return None
    spelled, why, fix = rule
    op = str(func.overloadpacket)
    location = user_location()
    what = f"{op} ({spelled}) cannot be captured in a device graph"
    return CaptureProblem(op, f"{what}, at {location}: it {why}. To fix: {fix}.", location, f"{what}: it {why}.")


def named_arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    named = dict(zip((a.name for a in func._schema.arguments), args))
    named.update(kwargs)
    return named


def _has_mask(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _transfer_rule(name: str, named: dict[str, Any]) -> tuple | None:
    if name == "copy_":
        src, dst = named.get("src"), named.get("self")
        dst_device = dst.device if isinstance(dst, torch.Tensor) else None
    else:
        src = named.get("self")
        other = named.get("other")
        dst_device = other.device if isinstance(other, torch.Tensor) else named.get("device")
    if not isinstance(src, torch.Tensor) or dst_device is None:
        return None
    dst_type = torch.device(dst_device).type
    if src.device.type == "cuda" and dst_type == "cpu":
        return _TO_HOST
    if src.device.type == "cpu" and dst_type == "cuda" and src.numel() > 0 and not src.is_pinned():
        return _PAGEABLE
    return None


def _directories() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(torch's and graphopt's package directories, the standard library's)."""
    graphopt_dir = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
    packages = (os.path.dirname(torch.__file__), graphopt_dir)
    stdlib = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib")}
    return tuple(os.path.join(d, "") for d in packages), tuple(os.path.join(d, "") for d in stdlib)


_PACKAGE_DIRS, _STDLIB_DIRS = _directories()


def _is_library(filename: str) -> bool:
    if filename.startswith(_PACKAGE_DIRS) or filename.startswith("<"):  # "<eval_with_key>": FX's generated code
        return True
    # A venv-less install keeps site-packages inside the standard library's directory.
    return filename.startswith(_STDLIB_DIRS) and "site-packages" not in filename and "dist-packages" not in filename


def user_location() -> str:
    """`file:line` of the innermost frame outside torch, graphopt, the standard
    library and generated code: the user's line that issued the operation."""
    frame = sys._getframe(1)
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame = frame.f_back
    return "<unknown>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"
