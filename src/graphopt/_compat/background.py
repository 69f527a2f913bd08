"""Inductor's code generation in a child process, while this process serves another runtime.

    compile_fx -> AOTAutograd's graph -> graphopt's post-grad pass (here, in the main thread)
               -> pickled graph -> child process: Inductor's post-grad passes, lowering, C++ build
               -> Future; its code is unpickled here, in a thread, as soon as it arrives

Why a child process and not a thread: `make_fx` (Inductor's pattern replacements, graphopt's
pattern registration) sets FX's process-global tracing flag, and while it is set every call to
a `torch.compile`d function in another thread raises "Detected that you are using FX to
symbolically trace a dynamo-optimized function". Why graphopt's pass runs here: Inductor
leaves `post_grad_custom_post_pass` out of the config it sends to the child
(`_save_config_ignore`), and the pass's pattern tracing is safe in the main thread. The
child imports graphopt (this module) first, so graphopt's operators and their lowerings
exist there when the graph is unpickled.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import re
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Sequence

import torch

from . import autotune, inductor
from .size_assumptions import checked


class NotSerializable(RuntimeError):
    """Inductor could not pickle the graph for a child process."""


class BackgroundCompile:
    """The futures of the child compiles one `compile_fx` started (one per graph AOTAutograd
    compiles: the forward in inference), and why any was compiled here instead. `outside`
    is told each call whose sizes break an assumption the child's code made
    (size_assumptions.py)."""

    def __init__(self, outside: Callable[[str], None] = lambda why: None) -> None:
        self.futures: list[Future] = []
        self.in_foreground: list[str] = []
        self.outside = outside

    def ready(self) -> bool:
        """Whether every child compile has finished (or failed: `error()` says)."""
        return all(f.done() for f in self.futures)

    def error(self) -> BaseException | None:
        """The first child compile's exception, once ready; None when all succeeded."""
        return next((f.exception() for f in self.futures if f.exception() is not None), None)

    def why(self) -> str | None:
        """The first failed child compile's error as "Type: message", once ready; None when
        all succeeded. A child's error arrives as its traceback's text: the last unindented
        "Type: message" line (a lowering error's message goes on with the IR it lowered)."""
        error = self.error()
        if error is None:
            return None
        details = getattr(error, "details", None)  # SubprocException: the child's formatted traceback
        lines = [line for line in (details or "").splitlines() if _EXCEPTION_LINE.match(line)]
        return lines[-1].strip() if lines else f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ready, or `timeout` seconds; whether it is ready."""
        return not concurrent.futures.wait(self.futures, timeout).not_done


_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*: \S")


@contextlib.contextmanager
def in_child(started: BackgroundCompile) -> Iterator[None]:
    """Inside, Inductor's `compile_fx` returns at once: code generation runs in a child
    process, the compiled graph runs AOTAutograd's graph here until its code arrives."""
    from torch._inductor import compile_fx as inductor

    def codegen(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], inputs_to_check: Sequence[int],
                compile_region_name: str | None = None, **graph_kwargs: Any) -> Any:
        try:
            return _start(gm, example_inputs, inputs_to_check, graph_kwargs, started)
        except NotSerializable as error:
            # Level 2 late is better than none: generate the code here, now. graphopt's
            # pass has already run on the graph. (torch 2.13 added compile_region_name.)
            started.in_foreground.append(str(error))
            region = {} if compile_region_name is None else {"compile_region_name": compile_region_name}
            with torch._inductor.config.patch(post_grad_custom_post_pass=None):
                return saved(gm, example_inputs, inputs_to_check, **region, **graph_kwargs)

    saved = inductor.fx_codegen_and_compile
    inductor.fx_codegen_and_compile = codegen
    # The caches would store the code before it exists: a compile in the background bypasses
    # them. Not through `force_disable_caches`: that would build every C++ kernel anew, in a
    # temporary cache directory that Inductor never deletes.
    try:
        with torch._functorch.config.patch(bundled_autograd_cache=False, enable_autograd_cache=False), \
                torch._inductor.config.patch(fx_graph_cache=False):
            yield
    finally:
        inductor.fx_codegen_and_compile = saved


def _start(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], inputs_to_check: Sequence[int],
           graph_kwargs: dict[str, Any], started: BackgroundCompile) -> Any:
    from torch._inductor import config
    from torch._inductor.compile_fx_async import _AsyncOutputCode
    from torch._inductor.compile_fx_subproc import _SubprocessFxCompile

    custom = config.post_grad_custom_post_pass
    if custom is not None:
        custom(gm.graph)
        gm.recompile()
    _detach_view_values(gm)
    scheme = _SubprocessFxCompile()
    with _pickling_errors() as errors, _child_resolvable_ops(), _constants_kept_here(gm) as marked:
        serialized = scheme.serialize_compile(gm, example_inputs, inputs_to_check, graph_kwargs)
    if serialized is None:
        why = f" ({errors[0][:200]})" if errors else ""
        raise NotSerializable(f"Inductor could not pickle the graph or its inputs for a child process{why}")
    pickled, constants = serialized
    shape_env = _current_shape_env()
    known = len(shape_env.guards) if shape_env is not None else 0
    env = {v: os.environ[v] for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") if v in os.environ}
    future = _unpickled(_submit(pickled, env), lambda result: (result[0].deserialize(constants), result[1]))
    started.futures.append(future)
    gemm_records = autotune.open_choices()

    def arrived(result: tuple[Any, dict[str, str]]) -> Any:
        output, gemms = result
        for record in gemm_records:
            record.update(gemms)
        # A guard Inductor added while compiling (a size it specialized on) would have
        # joined Dynamo's guards in this process; from the child it cannot any more.
        added = output.shape_env.guards[known:] if output.shape_env is not None else []
        scheme._postprocess(output)
        if added:
            checked(output.graph, here, example_inputs, shape_env, added, started.outside)
        _drop_packed_originals(gm, marked, output.graph)
        return output.graph

    def here(args: list) -> Any:
        return gm(*args)

    here._boxed_call = True  # type: ignore[attr-defined]
    return _AsyncOutputCode(here, future, arrived)


def start_child() -> None:
    """Start the child process now (it imports torch and graphopt: seconds), so that it is
    ready by the time a graph is sent to it."""
    _pool()


def _submit(pickled: Any, env: dict[str, str]) -> Future:
    """The child's compile of `pickled`, sent from a thread: the pool writes the graph into
    a pipe, which blocks until the child reads it all, and a child still importing torch
    reads nothing (with frozen weights' constants in it, that was most of a first call)."""
    pool, result = _pool(), Future()

    def send() -> None:
        try:
            sent = pool.submit(_run_in_child, pickled, env)
        except BaseException as error:  # noqa: BLE001 - the compile's failure, reported as the child's would be
            result.set_exception(error)
            return
        sent.add_done_callback(lambda done: result.set_exception(done.exception()) if done.exception() is not None
                               else result.set_result(done.result()))

    threading.Thread(target=send, name="graphopt-background-send", daemon=True).start()
    return result


def _unpickled(sent: Future, unpickle: Any) -> Future:
    """`sent`'s result, unpickled in a thread of its own as soon as it arrives. With frozen
    weights the child's code carries the weights its GEMM template packed (1.9 GB on a
    0.85B Llama): unpickled by the call that first runs level 2, they stalled that call
    for 4.8 s. A failure to unpickle is the compile's failure, as the child's own is.
    `sent` holds the returned future weakly, and `unpickle` (which holds the graph's
    constants) only through it: a model dropped while its child compiles is freed at
    once, and what the child sends back for it is never unpickled."""
    result: Future = Future()
    result.unpickle = unpickle  # type: ignore[attr-defined]
    waiting = weakref.ref(result)

    def unpack() -> None:
        pending = waiting()
        if pending is None:
            return
        try:
            pending.set_result(pending.unpickle(sent.result()))
        except BaseException as error:  # noqa: BLE001 - reported by BackgroundCompile.why()
            pending.set_exception(error)
        finally:
            del pending.unpickle

    sent.add_done_callback(lambda _: threading.Thread(target=unpack, name="graphopt-background-unpickle",
                                                      daemon=True).start())
    return result


@contextlib.contextmanager
def _constants_kept_here(gm: torch.fx.GraphModule) -> Iterator[list[str]]:
    """While Inductor pickles `gm` for a child: graphopt's own entries of `gm.meta` (the
    frozen weights, the recipes refresh() reads) left out, as the child's compile reads
    none of them; and the graph's tensor constants (the values frozen weights were folded
    into) marked as Inductor's frozen parameters, so that the compiled graph coming back
    names them instead of carrying a copy of each, and takes this process's own tensors
    (`CompiledFxGraphConstantsWithGm`). The child sees them with their values: its GEMM
    template packs them and its autotuning times them. Yields the names marked."""
    from torch._inductor import freezing_utils

    meta = gm.meta
    named = [(n, t) for n, t in (*gm.named_buffers(), *gm.named_parameters()) if not hasattr(t, "_is_frozen_param")]
    constants = [t for _, t in named]
    gm.meta = {k: v for k, v in meta.items() if not str(k).startswith("graphopt_")}
    freezing_utils.record_has_frozen_params(gm)
    for tensor in constants:
        tensor._is_frozen_param = True
    try:
        yield [n for n, _ in named]
    finally:
        gm.meta = meta
        del gm._has_frozen_params
        for tensor in constants:
            del tensor._is_frozen_param


def _drop_packed_originals(gm: torch.fx.GraphModule, marked: list[str], compiled: Any) -> None:
    """Drop from `gm` the constants (of `marked`) the child's code no longer names: those
    its GEMM template packed and pruned from its copy of the graph, as it does from the
    graph it compiles in this process. Kept, each would hold a weight's size for nothing."""
    used = set(getattr(compiled, "frozen_param_names", {}).values())
    for name in marked:
        if name not in used and "." not in name and name in gm._buffers:
            delattr(gm, name)


@contextlib.contextmanager
def _pickling_errors() -> Iterator[list[str]]:
    """The errors of Inductor's warning that it could not pickle a graph for a child, as
    "Type: message", kept off its logger: the caller reports them in its fallback, and a
    traceback on stderr would be the compile printing where no one asked."""
    from torch._inductor.compile_fx import log

    errors: list[str] = []

    def keep(record: logging.LogRecord) -> bool:
        if record.exc_info and "pickle" in record.getMessage():
            errors.append(f"{record.exc_info[0].__name__}: {record.exc_info[1]}")
            return False
        return True

    log.addFilter(keep)
    try:
        yield errors
    finally:
        log.removeFilter(keep)


_CHILD_NAMESPACES = ("torch.ops.aten.", "torch.ops.prims.", "torch.ops.graphopt.", "torch.ops.fbgemm.")


@contextlib.contextmanager
def _child_resolvable_ops() -> Iterator[None]:
    """Inductor pickles only ATen's operators for a child (its default filter is meant for
    another machine), so every graph with a `.float()` (decomposed into
    `prims.convert_element_type`) or a graphopt kernel stayed in the foreground. The child
    is this machine's torch with graphopt imported, so those namespaces resolve there."""
    from torch.fx import _graph_pickler

    saved = _graph_pickler.GraphPickler.__init__

    def init(self: Any, file: Any, options: Any = None) -> None:
        if options is None:
            options = _graph_pickler.Options(ops_filter=lambda name: name.startswith(_CHILD_NAMESPACES))
        saved(self, file, options)

    _graph_pickler.GraphPickler.__init__ = init
    try:
        yield
    finally:
        _graph_pickler.GraphPickler.__init__ = saved


def _detach_view_values(gm: torch.fx.GraphModule) -> None:
    """A node a pattern replacement added carries a view as its fake value, or a list of
    them (a split of a fused linear's result; AOTAutograd's own are not views), and
    Inductor's pickler keeps a view's base with its fake mode, which does not pickle. The
    detached value has the same sizes, strides and offset."""
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = _detached(node.meta["val"])


def _detached(value: Any) -> Any:
    """`value` with every view in it (one tensor, or a split's list of them) detached."""
    if isinstance(value, torch.Tensor):
        return value.detach() if value._is_view() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


def _current_shape_env() -> Any:
    from torch._inductor.compile_fx_ext import _current_fake_mode

    return _current_fake_mode().shape_env


def _run_in_child(pickled: Any, env: dict[str, str]) -> tuple[Any, dict[str, str]]:
    """The child's compile of `pickled`, with the GEMM choices its autotuning made (the
    report's, which this process would otherwise never see)."""
    from torch._inductor.compile_fx_subproc import _SubprocessFxCompile

    # The child's warnings are replayed here: what this process keeps off stderr, it does too.
    autotune.hide_inductor_storage_warning()
    # The compile in the background bypasses the caches: its GEMM timings are the child's own.
    with autotune.gemm_choices() as gemms, autotune.timings_kept_per(None), inductor.lighter_templates():
        output = _SubprocessFxCompile._run_in_child_subprocess(pickled, env)
    return output, gemms


@functools.cache
def _pool() -> Any:
    import atexit

    from torch._inductor.compile_worker.subproc_pool import SubprocKind, SubprocPool

    pool = SubprocPool(1, kind=SubprocKind.SPAWN)
    atexit.register(pool.shutdown)
    return pool
