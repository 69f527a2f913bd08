"""What the compile cache (graphopt/cache.py) needs from torch: tensors loaded outside
a fake mode, AOTAutograd's runtime wrapper redone for a stored graph, and graph
targets by name."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """No fake mode and no tracing context: unpickling a tensor goes through
    `torch.load`, which makes meta tensors while a tracing context holds a fake
    mode, as it does inside a backend."""
    from torch._guards import tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with tracing(None), unset_fake_temporarily():
        yield


def aot_wrapper_output_dims(graph_inputs: int, dynamo_inputs: int, inference: bool) -> list | None:
    """Called inside an AOTAutograd compiler: None when AOTAutograd's runtime wrapper
    does more than call the compiled graph and hand back inputs it returns (training,
    input mutations applied outside the graph, outputs that alias views of inputs or
    intermediates, subclasses, RNG, effect tokens, autocast, a grad-mode change,
    inputs it adds); else, for each output, the dims the wrapper marks dynamic for
    later frames, or {"input": i} for an output that is input i itself (a KV cache
    a transformers model returns), which the wrapper returns as the input object."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is None or graph_inputs != dynamo_inputs or not inference:
        return None
    plain = (int, type(None), *_aot_plain_meta_types())
    if (meta.traced_tangents or meta.num_mutated_inp_runtime_indices or meta.num_intermediate_bases
            or meta.tokens or meta.is_rng_op_functionalized
            or meta.grad_enabled_mutation is not None or torch.is_autocast_enabled("cpu")
            or torch.is_autocast_enabled("cuda")
            or any(o.output_type.name not in ("non_alias", "is_input") for o in meta.output_info)
            or not all(isinstance(m, plain) for m in [*meta.subclass_inp_meta, *meta.subclass_fw_graph_out_meta])):
        return None
    return [{"input": o.base_idx} if o.output_type.name == "is_input" else
            sorted(o.dynamic_dims) if o.dynamic_dims else None for o in meta.output_info]


def _aot_plain_meta_types() -> list[type]:
    from torch._functorch._aot_autograd import schemas

    return [schemas.PlainTensorMeta] if hasattr(schemas, "PlainTensorMeta") else []


def call_like_aot(graph: torch.fx.GraphModule, output_dims: list) -> Callable:
    """What AOTAutograd's runtime wrapper does for a graph `aot_wrapper_output_dims`
    accepted: call it, return the inputs it returns as themselves, and mark the
    dynamic dims of its other outputs for later frames. It calls the graph's
    `forward`: GraphModule's `__call__` adds an nn.Module call, on every replay, only
    to print the generated code on an error (the traceback shows its lines anyway)."""
    from torch._functorch._aot_autograd import runtime_wrappers

    # The helper's name up to torch 2.11, and after.
    mark = getattr(runtime_wrappers, "mark_dynamo_propagated_dynamic_indices", None) or \
        runtime_wrappers.maybe_mark_dynamic_helper

    marked = [(i, set(dims)) for i, dims in enumerate(output_dims) if isinstance(dims, list) and dims]
    inputs = [(i, dims["input"]) for i, dims in enumerate(output_dims) if isinstance(dims, dict)]

    def run(*args: Any) -> Any:
        outputs = graph.forward(*args)
        if inputs:
            outputs = list(outputs)
        for i, base in inputs:
            outputs[i] = args[base]
        for i, dims in marked:
            mark(outputs[i], dims)
        return outputs

    return run


def qualified_name(target: Any) -> str:
    """A dotted name that `object_by_name` turns back into `target`: FX's name for it
    or, for one of torch's C bindings that FX names by its public alias (`torch.split`
    is a Python wrapper, the graph calls `torch._C._VariableFunctions.split`), its
    binding namespace's."""
    from torch.fx.node import _get_qualified_name

    name = _get_qualified_name(target)
    short = getattr(target, "__name__", "")
    for candidate in (name, *(f"torch._C.{space}.{short}" for space in ("_VariableFunctions", "_nn", "_linalg",
                                                                       "_special", "_fft", "TensorBase"))):
        try:
            if object_by_name(candidate) is target:
                return candidate
        except (ImportError, AttributeError):
            continue
    return name


def object_by_name(name: str) -> Any:
    """The object a dotted name such as `torch._C._VariableFunctions.narrow` or
    `operator.getitem` stands for: the longest importable module, then attributes."""
    import importlib

    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            value = getattr(value, attribute)
        return value
    raise ImportError(f"no module found for {name!r}")
