"""The constants of Inductor's compiled code: where each came from, left out of what is
serialized, and supplied again when the code is loaded.

Inductor's compiled graph (`output_code.CompiledFxGraph`) keeps its constants in a dict
that its cache entries pickle by value, and sets them on the loaded module through
`CompiledFxGraphConstants.unwrap`. Its C++ GEMM template adds constants of its own: each
constant weight blocked and packed for its micro-kernel (`CppGemmTemplate.prep_weight`,
pure tensor ops on the weight). All private, and moved between releases: a torch
upgrade that changes them breaks this file only, and a constant whose origin is not
found here is kept by value by the caller, never guessed.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from unittest import mock

import torch
import torch.fx


@dataclass
class Packing:
    """One weight the C++ GEMM template packed: the weight as the template read it (a
    view of a constant's storage: its geometry), and the packing traced as ATen ops."""

    storage: int                      # data_ptr of the storage the template's weight views
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    trace: torch.fx.GraphModule | None  # None where the packing could not be traced


@dataclass
class Recorded:
    """What an Inductor compile made, seen from inside it: per compiled graph its
    constants (name -> tensor; left out of the compiled graph itself) and the names the
    graph module gave them; per packed weight, how it was packed."""

    constants: list[dict[str, torch.Tensor] | None] = field(default_factory=list)  # None: not read
    names: list[dict[str, str]] = field(default_factory=list)
    packings: dict[int, tuple[weakref.ref, Packing]] = field(default_factory=dict)

    def packing(self, value: torch.Tensor) -> Packing | None:
        """How `value` (a constant of the compiled graph) was packed, or None."""
        ref, packing = self.packings.get(id(value), (None, None))
        return packing if ref is not None and ref() is value else None


@contextlib.contextmanager
def constants_left_out() -> Iterator[Recorded]:
    """Inside, each graph Inductor compiles keeps its constants out of what its caches
    and `serialize()` pickle (they are in the Recorded, and the compiled module still
    holds them), and each weight its C++ GEMM template packs is recorded with the
    packing, traced."""
    from torch._inductor.output_code import CompiledFxGraph

    recorded = Recorded()
    init = CompiledFxGraph.__init__
    signature = inspect.signature(init)

    def left_out(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            names = dict(signature.bind(self, *args, **kwargs).arguments["graph"].allocated_constant_name)
        except (TypeError, KeyError, AttributeError):  # another torch's compiled graph: left as it is
            recorded.constants.append(None)
            recorded.names.append({})
            return
        tensors = {k: v for k, v in (self.constants or {}).items() if isinstance(v, torch.Tensor)}
        recorded.constants.append(tensors)
        recorded.names.append(names)
        # A new dict: the loaded module already holds the values, and the graph's own
        # dict stays as Inductor left it.
        self.constants = {k: v for k, v in self.constants.items() if k not in tensors}

    with mock.patch.object(CompiledFxGraph, "__init__", left_out), _packings_recorded(recorded):
        yield recorded


@contextlib.contextmanager
def _packings_recorded(recorded: Recorded) -> Iterator[None]:
    try:
        from torch._inductor.codegen.cpp_gemm_template import CppGemmTemplate
    except ImportError:  # pragma: no cover - a torch without the C++ GEMM template
        yield
        return
    prep_weight = CppGemmTemplate.__dict__["prep_weight"].__func__

    def recording(cls: type, inputs: list, layout: Any, micro_gemm: Any, *args: Any, **kwargs: Any) -> Any:
        new_inputs, new_layout = prep_weight(cls, inputs, layout, micro_gemm, *args, **kwargs)
        weight, packed = inputs[1], new_inputs[1]
        # The template's postprocessor packs the weight that becomes a constant, with its
        # int8 compensation skipped; the other calls pack example inputs for timing.
        if kwargs.get("skip_int8_compensation") and isinstance(weight, torch.Tensor) \
                and isinstance(packed, torch.Tensor) and packed is not weight:
            def pack(w: torch.Tensor) -> torch.Tensor:
                return prep_weight(cls, [None, w], layout, micro_gemm, *args, **kwargs)[0][1]

            recorded.packings[id(packed)] = (weakref.ref(packed), Packing(
                weight.untyped_storage().data_ptr(), tuple(weight.shape), tuple(weight.stride()),
                weight.storage_offset(), _trace(pack, weight)))
        return new_inputs, new_layout

    with mock.patch.object(CppGemmTemplate, "prep_weight", classmethod(recording)):
        yield


def _trace(pack: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor) -> torch.fx.GraphModule | None:
    """`pack` as a graph of ATen ops, traced on a meta tensor shaped like `weight`."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import _disable_current_modes

    meta = torch.empty_strided(weight.shape, weight.stride(), dtype=weight.dtype, device="meta")
    try:
        with _disable_current_modes():
            return make_fx(pack)(meta)
    except Exception:  # noqa: BLE001 - an untraceable packing keeps its constant by value
        return None


@contextlib.contextmanager
def constants_supplied(values: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside, a compiled graph Inductor loads (`deserialize_compile_artifacts`) gets
    `values` as its constants, beside those its entry holds."""
    from torch._inductor import output_code

    with contextlib.ExitStack() as patches:
        for name in ("CompiledFxGraphConstants", "CompiledFxGraphConstantsWithGm"):
            kind = getattr(output_code, name, None)
            if kind is not None:
                patches.enter_context(mock.patch.object(kind, "unwrap", _supplying(kind.unwrap, values)))
        yield


def _supplying(unwrap: Callable, values: dict[str, torch.Tensor]) -> Callable:
    def supplied(self: Any, graph: Any) -> dict:
        return {**unwrap(self, graph), **values}

    return supplied
