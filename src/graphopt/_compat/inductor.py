"""Inductor: a graph compiled with graphopt's post-grad pass inside, the options it
takes, whether it can compile on this machine, and its CPU checks started early.

`compile_fx`, `CustomGraphPass`, `list_options`, the C++ compiler lookup and the CPU
vector-ISA checks are all Inductor internals (`torch._inductor`), which change between
releases: a torch upgrade that changes them breaks this file only. Inductor's pattern
matcher is `patterns.py`, what its autotuning chose `autotune.py`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import torch
import torch.fx


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

    if not _UNREAD and options.get("fx_graph_cache", True):
        cpu_isa_checks_done()  # a hit in Inductor's caches loads code before any pass runs
    patches = dict(options)
    patches["post_grad_custom_post_pass"] = _custom_graph_pass(post_grad_pass, pass_uuid)
    with lighter_templates():
        return compile_fx(gm, example_inputs, config_patches=patches)


@contextlib.contextmanager
def lighter_templates() -> Iterator[None]:
    """Inside, Inductor's kernel templates cost less to make: each template's source
    parsed once, and a packed GEMM weight copied once."""
    with templates_parsed_once(), weights_blocked_without_empty_pad():
        yield


@contextlib.contextmanager
def weights_blocked_without_empty_pad() -> Iterator[None]:
    """Inside, the C++ GEMM template blocks a constant weight whose columns need no
    padding without padding it first: `F.pad(W, (0, 0))` is a copy of the whole weight,
    into new memory, before the blocking copies it again (2.5 GB more on the ~1B
    decoder). The blocked values are the same."""
    def gemm_template() -> type:
        from torch._inductor import compile_fx  # noqa: F401 - the template's module imports only after it
        from torch._inductor.codegen.cpp_gemm_template import CppGemmTemplate
        return CppGemmTemplate

    def without_empty_pad(block: Callable) -> Callable:
        def block_weight(cls: type, W: Any, new_size: Sequence[int], padding: int) -> Any:
            if padding != 0 or not isinstance(W, torch.Tensor):
                return block(cls, W, new_size, padding)
            blocked = list(new_size)
            blocked[-2], blocked[-3] = blocked[-3], blocked[-2]
            return W.reshape(*blocked).transpose(-3, -2).contiguous()
        return block_weight

    with _replaced(gemm_template, "block_weight", classmethod, without_empty_pad):
        yield


@contextlib.contextmanager
def templates_parsed_once() -> Iterator[None]:
    """Inside, Inductor parses each kernel template's Jinja source once, not at every
    render: its C++ GEMM template renders for each candidate of each GEMM and again for
    the final code, and each render parsed and compiled its templates anew (903 parses
    in the first level-2 compile of the ~1B decoder with frozen weights). A parsed
    template is immutable; the cache is keyed by the source text."""
    def kernel_template() -> type:
        from torch._inductor.codegen.common import KernelTemplate
        return KernelTemplate

    with _replaced(kernel_template, "_template_from_string", staticmethod, _parsed):
        yield


@functools.cache
def _parsed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    return functools.lru_cache(maxsize=256)(parse)


@contextlib.contextmanager
def _replaced(owner: Callable[[], type], name: str, kind: type, replacement: Callable[[Callable], Callable]
              ) -> Iterator[None]:
    """Inside, the `kind` (staticmethod or classmethod) `name` of the class `owner()` is
    `replacement` of its function; left as it is where this torch has no such method."""
    try:
        cls = owner()
        method = cls.__dict__[name]
    except (ImportError, KeyError):
        yield
        return
    if not isinstance(method, kind):
        yield
        return
    with mock.patch.object(cls, name, kind(replacement(method.__func__))):
        yield


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
            cpu_isa_checks_done()  # lowering, next, picks the vector ISA

        def uuid(self) -> str:
            return pass_uuid

    return _GraphoptPostGradPass()


@contextlib.contextmanager
def caches_written_not_read() -> Iterator[None]:
    """Inductor's FX graph cache and AOTAutograd's, written as usual but never read: a
    compile whose pass records graphopt lacks must run the passes, which a hit would skip.
    Without it such a compile loaded the code, then compiled again for the records, and
    the loaded code's copies of frozen weights stayed alive beside the new ones."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._inductor.codecache import FxGraphCache

    with mock.patch.object(FxGraphCache, "_lookup_graph", staticmethod(lambda *args, **kwargs: (None, {}))), \
            mock.patch.object(AOTAutogradCache, "_lookup", staticmethod(lambda *args, **kwargs: None)):
        _UNREAD.append(True)
        try:
            yield
        finally:
            _UNREAD.pop()


@functools.cache
def inductor_option_names() -> frozenset[str]:
    """Every Inductor config key `torch.compile(options=...)` takes."""
    import torch._inductor

    return frozenset(torch._inductor.list_options())


_EARLY_CHECKS: list[threading.Thread] = []
_UNREAD: list[bool] = []  # non-empty inside caches_written_not_read()


def cpu_isa_checks_done() -> None:
    """Wait for the checks `check_cpu_isas_early` started, before Inductor lowers or
    loads code. Its checks change the ISA objects they test while they run (the AVX512
    check adds -mavx512bf16 to its flags for a moment): code loaded beside them was built
    with those flags, which missed the C++ build cache under the flags the compiling
    process used (8.6 s of g++ in every second start of the tiny decoder, level 2 frozen)."""
    for thread in _EARLY_CHECKS:
        thread.join()


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
    _EARLY_CHECKS.append(thread)
    return thread


def inductor_available() -> bool:
    """Inductor needs a C++ compiler on CPU; report its absence instead of failing late."""
    try:
        from torch._inductor import cpp_builder

        cpp_builder.get_cpp_compiler()
    except Exception:  # noqa: BLE001 - any failure means "cannot compile for CPU"
        return False
    return True
