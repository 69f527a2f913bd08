"""Every private torch API graphopt uses, in one place.

torch's compiler internals change between releases (graphopt runs on 2.11 to 2.15).
Each wrapper here detects what the installed torch offers, with `inspect` where a
signature moved, so an upgrade breaks this package and no other. This module holds
Dynamo, AOTAutograd, Inductor and shapes; `patterns.py` Inductor's pattern matcher,
`cache.py` what the compile cache needs, `traces.py` Dynamo's stored traces,
`recompile.py` Dynamo's recompiles (its limit, when it gives up, what failed),
`names.py` the private names used as they are.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
import threading
from typing import Any, Callable, Iterator, Sequence

import torch
import torch._dynamo
import torch.fx
from torch._functorch.aot_autograd import aot_module_simplified

try:  # torch >= 2.4 moved the boxing helper out of functorch.compile
    from torch._functorch._aot_autograd.utils import make_boxed_func
except ImportError:  # pragma: no cover - older layouts
    from functorch.compile import make_boxed_func


def _accepts(fn: Callable, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def aot_inference(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    fw_compiler: Callable[[torch.fx.GraphModule, list], Callable],
) -> Callable:
    """Dynamo graph -> functional ATen inference graph, handed to `fw_compiler`.

    Input mutations (a KV-cache write) are kept inside the graph as a trailing
    `copy_` into the input, so graphopt's passes can turn them back into in-place
    writes; otherwise AOTAutograd would apply them in a Python epilogue.
    """
    kwargs: dict[str, Any] = {"fw_compiler": fw_compiler}
    if _accepts(aot_module_simplified, "inference_compiler"):
        kwargs["inference_compiler"] = fw_compiler
    if _accepts(aot_module_simplified, "keep_inference_input_mutations"):
        kwargs["keep_inference_input_mutations"] = True
    return aot_module_simplified(gm, example_inputs, **kwargs)


def boxed(fn: Callable) -> Callable:
    """AOTAutograd calls compiled graphs with one list argument ("boxed")."""
    return make_boxed_func(fn)


def inductor_compile(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    post_grad_pass: Callable[[torch.fx.Graph], None],
    pass_uuid: str,
    options: dict[str, Any],
) -> Callable:
    """Compile a Dynamo graph with Inductor, running `post_grad_pass` as its
    post-grad custom pass (after Inductor's own pattern passes, before lowering)."""
    from torch._inductor.compile_fx import compile_fx

    patches = dict(options)
    patches["post_grad_custom_post_pass"] = _custom_graph_pass(post_grad_pass, pass_uuid)
    return compile_fx(gm, example_inputs, config_patches=patches)


def _custom_graph_pass(fn: Callable[[torch.fx.Graph], None], pass_uuid: str) -> Any:
    """Wrap `fn` as Inductor's CustomGraphPass; its uuid keys Inductor's FX graph
    cache, so two different graphopt configs never share a cached artifact."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # pragma: no cover - torch without the cache-aware interface
        return fn

    class _GraphoptPostGradPass(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            fn(graph)

        def uuid(self) -> str:
            return pass_uuid

    return _GraphoptPostGradPass()


@functools.cache
def inductor_option_names() -> frozenset[str]:
    """Every Inductor config key `torch.compile(options=...)` takes."""
    import torch._inductor

    return frozenset(torch._inductor.list_options())


@functools.cache
def check_cpu_isas_early() -> threading.Thread:
    """Start, on a thread, the checks Inductor makes before its first CPU compile of
    which vector ISAs the C++ compiler builds and this CPU runs: half a dozen small
    compiles, seconds of them, serial, once per cache dir (docs/compile-cache.md, "A cold
    start at level 2 on the CPU"). Started when a level-2
    step is made, they overlap Dynamo's trace, AOTAutograd and the passes instead of
    following them. Inductor reads the results (its `valid_vec_isa_list` cache, its
    files under their locks) when it gets there; a failure here is its to report."""
    from . import autotune

    autotune.hide_cuda_home_warning()
    # Everything the checks import, imported on this thread: two threads importing
    # circularly dependent modules (setuptools, distutils) at once can deadlock.
    import torch.utils.cpp_extension  # noqa: F401
    from torch._inductor import cpu_vec_isa

    def check() -> None:
        try:
            cpu_vec_isa.valid_vec_isa_list()
        except Exception:  # noqa: BLE001, S110 - Inductor checks again when it compiles, and reports
            pass

    thread = threading.Thread(target=check, name="graphopt-cpu-isa-checks", daemon=True)
    thread.start()
    return thread


def inductor_available() -> bool:
    """Inductor needs a C++ compiler on CPU; report its absence instead of failing late."""
    try:
        from torch._inductor import cpp_builder

        cpp_builder.get_cpp_compiler()
    except Exception:  # noqa: BLE001 - any failure means "cannot compile for CPU"
        return False
    return True


def distributed_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def process_group_named(name: str) -> Any:
    """The process group a functional collective names in the graph (its `group_name`)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


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


def concrete(value: Any) -> Any:
    """A Dynamo example input as a plain value: SymInts become their hint."""
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if hint is None:
            raise ValueError(f"symbolic size {value} has no concrete hint")
        return int(hint)
    return value


def same_sizes(a: Sequence, b: Sequence) -> bool:
    """Sizes equal for every value of their symbolic dims (no guard is added)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return same_sizes(a.shape, b.shape)


def fake_mode_of(gm: torch.fx.GraphModule) -> Any:
    """The FakeTensorMode the graph's `meta["val"]` values belong to, or None."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])


def backend_fakes(example_inputs: Sequence[Any]) -> tuple[Any, list[Any]]:
    """The fake mode a compiler backend traces in, and `example_inputs` as its fake
    values (with the symbolic sizes Dynamo gave them); (None, []) outside one."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(list(example_inputs))
    if mode is None:
        return None, []
    return mode, [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]


@contextlib.contextmanager
def fake_tracing(fake_mode: Any) -> Iterator[None]:
    """Run ops on fake tensors in `fake_mode` as Dynamo and AOTAutograd do, under the
    Python dispatcher: composite ops (linear's 3-D fold) then decompose in Python
    with `sym_size`. Without it torch 2.11 reads a C++ `sizes()`, which specialises
    the batch symbol to the traced value for the rest of the compile."""
    from torch._dispatch.python import enable_python_dispatcher

    with fake_mode, enable_python_dispatcher():
        yield


def outside_fake_mode() -> Any:
    """A context that runs real tensors while a compiler's FakeTensorMode is active
    (passes run inside AOTAutograd's and Inductor's tracing)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


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


def written_arguments(op: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments an ATen call writes in place (its schema's mutable aliases)."""
    written = []
    for i, argument in enumerate(op._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.append(args[i] if i < len(args) else kwargs.get(argument.name))
    return written


def current_dispatch_mode() -> Any:
    """The innermost TorchDispatchMode of this thread, or None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def known_true(condition: Any) -> bool:
    """True when `condition` (a bool or a SymBool over symbolic sizes) holds for every
    value of its symbols; False when unknown. Never adds a guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(condition))


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


def symbol_of(size: Any) -> Any:
    """The sympy expression of a symbolic size, or None for a plain int."""
    return size.node.expr if isinstance(size, torch.SymInt) else None


def is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return bool(_is_fake(tensor))


# Inductor's guess for a size it cannot know (an unbacked symbol): used only for estimates.
_UNKNOWN_SIZE = 8192


def size_hint(value: Any) -> int:
    """A size as a plain int: a SymInt becomes the value it had when traced (its
    hint, never guarded on), or 8192 when it has none (a data-dependent size)."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # torch < 2.13
        hint = value.node.hint
        return int(hint) if hint is not None else _UNKNOWN_SIZE
    return int(optimization_hint(value, fallback=_UNKNOWN_SIZE))


def symbol_hints(values: Sequence[Any]) -> dict[str, int]:
    """For the symbols the SymInts among `values` are built from: name -> traced value."""
    hints: dict[str, int] = {}
    for value in values:
        if not isinstance(value, torch.SymInt):
            continue
        shape_env = value.node.shape_env
        for symbol in sorted(value.node.expr.free_symbols, key=str):
            if str(symbol) not in hints:
                hint = getattr(shape_env, "optimization_hint", None)  # torch >= 2.13
                hints[str(symbol)] = int(hint(symbol, fallback=_UNKNOWN_SIZE) if hint is not None
                                         else shape_env.size_hint(symbol))
    return hints


def inplace_overload(op: Any) -> Any:
    """torch's own choice of the in-place overload of a functional op (the one whose
    schema matches argument for argument, e.g. pow.Tensor_Scalar -> pow_.Scalar), or
    None. From torch.fx.passes.reinplace, which may move or change."""
    try:
        from torch.fx.passes.reinplace import _maybe_get_inplace_op
    except ImportError:  # pragma: no cover - callers fall back to their own lookup
        return None
    try:
        return _maybe_get_inplace_op(op)
    except AssertionError:  # several candidate overloads, or an odd schema: no answer
        return None
