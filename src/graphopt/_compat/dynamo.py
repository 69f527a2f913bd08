"""Dynamo: a backend registered under a name, dims marked dynamic, the torch.compile
call a backend serves, and what Dynamo recorded about each graph input.

A Dynamo graph's placeholders carry where their value came from (`grapharg`,
`_dynamo_source`), which tells parameters from buffers from `forward` arguments; the
backend registry and `torch._TorchCompileWrapper` are Dynamo's own. All of these are
private and have changed between releases: a torch upgrade that changes them breaks
this file only.
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Any, Callable, Sequence

import torch
import torch._dynamo
import torch.fx


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Ask Dynamo to trace `dim` symbolically. `maybe_` because a size-1 dim is
    specialised by Dynamo (0/1 specialisation) rather than raising."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def register_dynamo_backend(name: str, fn: Callable) -> None:
    """Make `backend=name` find `fn`, as an entry point torch loads on first use.

    torch's `lookup_backend` loads a package's `torch_dynamo_backends` entry point and
    registers what it returns; importing the package is part of that load, so a
    registration at import would make torch's own one fail as a duplicate. Declaring
    the name as a lazy entry point instead leaves the one registration to torch,
    whichever door (the installed entry point or an `import`) is used first."""
    from importlib.metadata import EntryPoint

    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS

    if _COMPILER_FNS.get(name) is fn:
        return
    _COMPILER_FNS.pop(name, None)
    _BACKENDS[name] = EntryPoint(name=name, value=f"{fn.__module__}:{fn.__qualname__}",
                                 group="torch_dynamo_backends")


def compile_call() -> Any:
    """The torch.compile call whose graph a backend is compiling (torch's wrapper of the
    backend and its arguments, one per call), found on the stack; None when the
    backend was called another way."""
    code = getattr(getattr(torch, "_TorchCompileWrapper", None), "__call__", None)
    code = getattr(code, "__code__", None)
    frame = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def later_in_this_compile() -> Callable[[], Any]:
    """A context that puts back, for a compile of the graph after Dynamo handed it over
    (level 2 started at a later call), what Dynamo compiled it in: its tracing context
    (fake mode and shape environment: without them the compile specialises the graph's
    symbolic sizes to its example inputs'), each input's symbolic context, and the grad
    and inference modes (a later call outside `torch.no_grad()` would have AOTAutograd
    trace a backward graph).

    Dynamo forgets the symbolic contexts when a registered backend's compile ends
    (`config.invalidate_compile_context_weakrefs`); without them AOTAutograd makes every
    size of every input a symbol, the weights' too, and Inductor's GEMM template, which
    packs a weight of known size, is never tried (Gemma-3's deferred level 2 ran its
    GEMMs on ATen, 5.8x slower than level 1)."""
    from torch._guards import TracingContext, tracing
    from torch.utils.weak import WeakTensorKeyDictionary

    context, modes = TracingContext.try_get(), modes_of_now()
    symbolic = WeakTensorKeyDictionary()
    if context is not None:
        for tensor, symbolic_context in context.tensor_to_context.items():
            symbolic[tensor] = symbolic_context

    @contextlib.contextmanager
    def again() -> Any:
        with (tracing(context) if context is not None else contextlib.nullcontext()), modes():
            if context is not None:
                for tensor, symbolic_context in symbolic.items():
                    context.tensor_to_context[tensor] = symbolic_context
            yield

    return again


def modes_of_now() -> Callable[[], Any]:
    """A context that puts back the grad and inference modes of now, for a compile run
    later (a deferred level 2, refresh()'s): in grad mode, AOTAutograd compiles a graph that
    saves its inputs for backward, which inference tensors refuse. Dynamo compiles with
    inference mode off and its fake tensors made without inference-ness, so a graph that
    writes an input made under `torch.inference_mode()` (transformers' static cache) traces;
    a later compile makes fake tensors of such inputs again, and needs the same."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    @contextlib.contextmanager
    def again() -> Any:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad), _fakes_without_inference():
            yield

    return again


def _fakes_without_inference() -> Any:
    """Dynamo's own context for that (torch._dynamo.utils), where this torch has it."""
    from torch._dynamo import utils

    fake_prop = getattr(utils, "maybe_disable_inference_mode_for_fake_prop", None)
    return fake_prop() if fake_prop is not None else contextlib.nullcontext()


def input_kinds(gm: torch.fx.GraphModule) -> list[str]:
    """For each placeholder of a Dynamo graph: "parameter", "buffer" or "input",
    read from the source Dynamo recorded for it."""
    kinds = []
    for node in gm.graph.find_nodes(op="placeholder"):
        name = _source_name(node)
        kinds.append("parameter" if "._parameters[" in name else "buffer" if "._buffers[" in name else "input")
    return kinds


def input_sources(gm: torch.fx.GraphModule) -> list[str]:
    """For each placeholder of a Dynamo graph: where Dynamo took its value from, or ""."""
    return [_source_name(node) for node in gm.graph.find_nodes(op="placeholder")]


def _source_name(placeholder: torch.fx.Node) -> str:
    """Where Dynamo took a placeholder's value from (`L['self']._modules[...]`), or "".
    The node's `grapharg` has it; a graph from Dynamo's full-graph capture (stored
    traces) keeps only the `_dynamo_source` Dynamo sets before calling a backend."""
    source = getattr(placeholder.meta.get("grapharg"), "source", None) or getattr(placeholder, "_dynamo_source", None)
    name = getattr(source, "name", "")
    return name() if callable(name) else str(name)  # a method before torch 2.12, a property since


def graph_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any] = ()) -> list[tuple[str, str | None, Any]]:
    """For each placeholder of a Dynamo graph: (kind, argument name, example value).

    kind is "static" for parameters, buffers and tensors marked static
    (`torch._dynamo.mark_static_address`), "symint" for a symbolic size, else
    "input". The argument name is the `forward` argument the value came from
    (`slots` for `L['slots']`, `input_ids` for `L['kwargs']['input_ids']`), or None.
    The example value is Dynamo's fake tensor or SymInt, with symbolic sizes.
    `example_inputs` (the backend's) stand in for the values a graph from Dynamo's
    full-graph capture no longer records.
    """
    found = []
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        grapharg = node.meta.get("grapharg")
        name = _source_name(node)
        example = node.meta.get("example_value")
        real = grapharg.example if grapharg is not None else \
            example_inputs[i] if i < len(example_inputs) else None
        if isinstance(example, torch.SymInt):
            kind = "symint"
        elif "._parameters[" in name or "._buffers[" in name or \
                getattr(real, "_dynamo_static_input_type", None) is not None:
            kind = "static"
        else:
            kind = "input"
        match = re.match(r"L\['(\w+)'\](?:\['(\w+)'\])?", name)
        argument = None
        if match:
            argument = match.group(2) if match.group(1) == "kwargs" and match.group(2) else match.group(1)
        found.append((kind, argument, example))
    return found
