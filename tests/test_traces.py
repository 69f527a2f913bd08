"""Stored traces: a second "process" (a fresh optimize() after `torch._dynamo.reset()`)
runs the step from the trace the first stored, without Dynamo tracing it, with the
outputs eager gives; a changed source, a rebound function, other inputs or a broken
entry make it trace again, never run a stale graph."""

from __future__ import annotations

import functools
import importlib
import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch._dynamo
from cache_starts import Kept
from support import cache_entries as entries

import graphopt
from graphopt import FallbackKind
from graphopt._compat import guard_sources
from graphopt.api import traces
from graphopt.api.identity import identity
from graphopt.backend.backend import Backend
from graphopt.models import Decoder, DecoderConfig, generate
from graphopt.models import decoder as decoder_module

PROMPTS = torch.randint(500, (3, 6), generator=torch.Generator().manual_seed(0))


def start(model, cache_dir, **config):
    """A fresh optimized step over `model`, as a new process would build it."""
    torch._dynamo.reset()
    cfg = graphopt.GraphOptimizationConfig(**{"graph_opt_level": 1, "cache_dir": str(cache_dir), "use_cudagraph": False,
                                              **config})
    return graphopt.optimize(model, cfg, pad_values={"slots": model.scratch_slot})


@pytest.fixture(scope="module")
def first_start(tmp_path_factory) -> Kept:
    """A first start's cache (level 1, its trace stored), for the tests of what a second
    start does with it; each test gets it back as it was (`restore()`)."""
    torch.manual_seed(0)  # the weights of conftest's `decoder`
    model = Decoder(DecoderConfig.tiny()).eval()
    directory = tmp_path_factory.mktemp("first-start") / "cache"
    first = start(model, directory)
    generate(model, PROMPTS, 6, step=first)
    assert first.report().traces_stored == 1
    torch._dynamo.reset()
    return Kept(directory)


def no_tracing(monkeypatch):
    """Any Dynamo trace of a step ends in a Backend call: make that fail."""
    def refuse(self, gm, example_inputs):
        raise AssertionError("Dynamo traced the step again")

    monkeypatch.setattr(Backend, "compile", refuse)


CONFIGS = {
    "level 1": {"graph_opt_level": 1},
    "level 1 + host graphs": {"graph_opt_level": 1, "use_cudagraph": True, "cudagraph_capture_sizes": [1, 4]},
    "level 2": {"graph_opt_level": 2},
}


@pytest.mark.parametrize("name", CONFIGS)
def test_second_start_runs_the_stored_trace(tmp_path, monkeypatch, name):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    decoder = Decoder(DecoderConfig.tiny(num_layers=1)).eval()  # level 2's C++ code for one layer: compiled faster
    expected = generate(decoder, PROMPTS, 6)
    first = start(decoder, tmp_path / "graphopt", **CONFIGS[name])
    assert torch.equal(generate(decoder, PROMPTS, 6, step=first), expected)
    assert (first.report().traces_stored, first.report().traces_used) == (1, 0)

    second = start(decoder, tmp_path / "graphopt", **CONFIGS[name])
    with monkeypatch.context() as patch:
        no_tracing(patch)
        assert torch.equal(generate(decoder, PROMPTS, 6, step=second), expected)
        assert torch.equal(generate(decoder, PROMPTS[:2], 6, step=second), expected[:2])
    report = second.report()
    assert (report.traces_used, report.traces_stored, report.cache_hits) == (1, 0, 1)
    assert not report.graphs[0].traced and report.graphs[0].cache_hit
    assert report.graphs[0].nodes_after == first.report().graphs[0].nodes_after
    assert [p.name for p in report.passes] == [p.name for p in first.report().passes]
    assert "with its stored Dynamo trace" in str(report)
    if CONFIGS[name].get("use_cudagraph"):
        assert report.replays > 0 and {c.size for c in report.captures} == {4}


def test_other_inputs_are_traced_again_and_stored_beside(decoder, first_start):
    """The stored guards still hold: a batch of one (Dynamo specialises it) misses
    the stored dynamic-batch trace, is traced, and its trace is stored too."""
    expected = generate(decoder, PROMPTS, 6)
    cache_dir = first_start.restore()
    second = start(decoder, cache_dir)
    assert torch.equal(generate(decoder, PROMPTS[:1], 6, step=second), expected[:1])
    assert (second.report().traces_used, second.report().traces_stored) == (0, 1)
    third = start(decoder, cache_dir)
    generate(decoder, PROMPTS, 6, step=third)
    generate(decoder, PROMPTS[:1], 6, step=third)
    assert (third.report().traces_used, third.report().traces_stored) == (2, 0)


def test_a_rebound_function_is_traced_again(decoder, first_start, monkeypatch):
    """`repeat_kv` is a module global the trace inlined; Dynamo guards it by
    identity, which cannot be stored: the trace's own record of it refuses it."""
    cache_dir = first_start.restore()
    original = decoder_module.repeat_kv
    monkeypatch.setattr(decoder_module, "repeat_kv", lambda x, n: original(x, n) * 0.5)
    expected = generate(decoder, PROMPTS, 6)
    second = start(decoder, cache_dir)
    assert torch.equal(generate(decoder, PROMPTS, 6, step=second), expected)
    report = second.report()
    assert report.traces_used == 0
    [reason] = report.reasons(FallbackKind.TRACE_NOT_USED)
    assert "G['repeat_kv']" in reason  # the guard that failed


MODEL_SOURCE = '''
import torch


def scale(x):
    return x * {factor}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return scale(self.proj(x)).relu()
'''


def test_an_edited_source_is_traced_again(tmp_path, monkeypatch):
    """The same function object, its source edited between two processes."""
    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / "edited_model.py"
    source.write_text(MODEL_SOURCE.format(factor=2.0))
    module = importlib.import_module("edited_model")
    torch.manual_seed(0)
    model, x = module.Model(), torch.randn(4, 8)
    cfg = graphopt.GraphOptimizationConfig(graph_opt_level=1, cache_dir=str(tmp_path / "cache"), use_cudagraph=False)
    torch._dynamo.reset()
    with torch.no_grad():
        graphopt.optimize(model, cfg)(x)

    source.write_text(MODEL_SOURCE.format(factor=-3.0))
    importlib.reload(module)
    model.__class__ = module.Model
    torch._dynamo.reset()
    step = graphopt.optimize(model, cfg)
    with torch.no_grad():
        torch.testing.assert_close(step(x), model(x), atol=1e-5, rtol=1e-5)
    assert step.report().traces_used == 0
    assert step.report().fallback_counts[FallbackKind.TRACE_NOT_USED] >= 1


SCALE = 2.0


def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE + 1


def test_a_rebound_module_global_is_never_read_stale(tmp_path, monkeypatch):
    """Where this torch checks a loaded trace's global guards against the module
    itself, the trace is stored and a rebind is seen; where it would check a copy,
    the trace is not stored at all."""
    cfg = graphopt.GraphOptimizationConfig(graph_opt_level=1, cache_dir=str(tmp_path), use_cudagraph=False)
    x = torch.randn(4, 3)
    torch._dynamo.reset()
    first = graphopt.optimize(scaled, cfg)
    torch.testing.assert_close(first(x), x * 2 + 1)
    torch._dynamo.reset()
    second = graphopt.optimize(scaled, cfg)
    x = x.clone()  # as a new process's inputs: not marked dynamic by the first start
    torch.testing.assert_close(second(x), x * 2 + 1)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 5.0)
    torch.testing.assert_close(second(x), x * 5 + 1)
    if first.report().traces_stored == 0:
        assert any("SCALE" in r for r in first.report().reasons(FallbackKind.TRACE_NOT_STORED))
        assert second.report().traces_used == 0
    else:
        assert second.report().traces_used == 1


def returns_tuple(forward):
    """A decorator as transformers' `can_return_tuple`: its wrapper reads the wrapped
    function (`func.__name__`), which its module names only through the wrapper."""
    @functools.wraps(forward)
    def wrapper(self, x):
        return forward(self, x) if forward.__name__ == "forward" else (forward(self, x),)
    return wrapper


class Decorated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    @returns_tuple
    def forward(self, x):
        return self.proj(x).relu()


def stored_then_run(model, x, cfg, monkeypatch):
    """A first start stores its trace and a second runs it without Dynamo tracing,
    both with eager's output; the second's report."""
    torch._dynamo.reset()
    first = graphopt.optimize(model, cfg)
    with torch.no_grad():
        torch.testing.assert_close(first(x), model(x))
    assert first.report().traces_stored == 1, first.report().fallbacks
    torch._dynamo.reset()
    second = graphopt.optimize(model, cfg)
    with torch.no_grad(), monkeypatch.context() as patch:
        no_tracing(patch)
        torch.testing.assert_close(second(x.clone()), model(x))
    return second.report()


def test_a_decorated_forward_is_stored_and_checks_the_function_it_wraps(tmp_path, monkeypatch):
    """The guard on the wrapped function's name is the trace's own to check: a
    second start uses the stored trace, and one whose wrapper holds another
    function is refused, not run stale."""
    torch.manual_seed(0)
    model, x = Decorated().eval(), torch.randn(4, 8)
    cfg = graphopt.GraphOptimizationConfig(graph_opt_level=1, cache_dir=str(tmp_path), use_cudagraph=False)
    assert stored_then_run(model, x, cfg, monkeypatch).traces_used == 1

    def other(self, x):
        return self.proj(x).sigmoid()

    cell = Decorated.forward.__closure__[0]
    wrapped, cell.cell_contents = cell.cell_contents, other
    try:
        torch._dynamo.reset()
        third = graphopt.optimize(model, cfg)
        with torch.no_grad():
            [out] = third(x.clone())
            torch.testing.assert_close(out, model.proj(x).sigmoid())
    finally:
        cell.cell_contents = wrapped
    assert third.report().traces_used == 0
    assert any("L['forward']" in r for r in third.report().reasons(FallbackKind.TRACE_NOT_USED))


def as_module(func):
    """As kernels' `use_kernel_forward_from_hub` on a function (transformers 5.25's
    rotary embedding): the function becomes the one instance of a class made for it,
    a module global that pickles by its name."""
    class Func(torch.nn.Module):
        def forward(self, *args):
            return func(*args)

        def __reduce__(self):
            return func.__name__

    Func.__module__ = func.__module__
    return Func()


@as_module
def gated(x):
    return x * torch.sigmoid(x)


@as_module
def softened(x):
    return torch.tanh(x)


class UsesFuncs(torch.nn.Module):
    """Reads its function modules as transformers' attention does: from a plain dict
    attribute (kernels' `_kernel_funcs`) and as a module global."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.funcs = {"act": gated}

    def forward(self, x):
        y = self.proj(x)
        return self.funcs["act"](y) + gated(y)


def test_function_modules_of_local_classes_are_stored_and_told_apart(tmp_path, monkeypatch):
    """Dynamo stores a type by its name, which a class made inside a function lacks:
    graphopt checks those types itself, by what their methods run. A second start
    uses the stored trace; one whose dict holds another function module (the same
    class name, another function) is refused, not run stale."""
    torch.manual_seed(0)
    model, x = UsesFuncs().eval(), torch.randn(4, 8)
    cfg = graphopt.GraphOptimizationConfig(graph_opt_level=1, cache_dir=str(tmp_path), use_cudagraph=False)
    assert type(gated).__qualname__ == type(softened).__qualname__
    assert identity(type(gated)) != identity(type(softened))
    assert identity(gated).startswith(f"global {__name__}.gated ")
    second = stored_then_run(model, x, cfg, monkeypatch)
    assert (second.traces_used, second.fallbacks) == (1, {})

    model.funcs["act"] = softened
    torch._dynamo.reset()
    third = graphopt.optimize(model, cfg)
    with torch.no_grad():
        torch.testing.assert_close(third(x.clone()), torch.tanh(model.proj(x)) + gated(model.proj(x)))
    assert third.report().traces_used == 0
    assert any("funcs" in r for r in third.report().reasons(FallbackKind.TRACE_NOT_USED)), third.report().fallbacks


def test_forward_hooks_keep_running(decoder, first_start):
    calls = []
    cache_dir = first_start.restore()
    handle = decoder.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        step = start(decoder, cache_dir)
        generate(decoder, PROMPTS, 6, step=step)
    finally:
        handle.remove()
    assert len(calls) == 5 and step.report().traces_used == 0


def test_a_trace_stored_in_inference_mode_is_not_used_outside_it(decoder, tmp_path):
    ids, positions, slots = PROMPTS[:, 0], torch.full((3,), 6), torch.arange(3)
    with torch.inference_mode():
        start(decoder, tmp_path)(ids, positions, slots)
    step = start(decoder, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(step(ids, positions, slots), decoder(ids, positions, slots))
    assert step.report().traces_used == 0


def trace_entry(cache_dir: Path, graph_entries: set[Path]) -> Path:
    [entry] = [p for p in entries(cache_dir) if p not in graph_entries]
    return entry


def test_broken_or_orphaned_entries_trace_again(decoder, tmp_path):
    expected = generate(decoder, PROMPTS, 6)
    generate(decoder, PROMPTS, 6, step=start(decoder, tmp_path, cache_traces=False))
    graphs = set(entries(tmp_path))
    generate(decoder, PROMPTS, 6, step=start(decoder, tmp_path))
    entry = trace_entry(tmp_path, graphs)
    entry.write_bytes(entry.read_bytes()[:200])
    step = start(decoder, tmp_path)
    assert torch.equal(generate(decoder, PROMPTS, 6, step=step), expected)
    assert (step.report().cache_rebuilt, step.report().traces_stored) == (1, 1)

    [graph] = graphs
    graph.unlink()
    step = start(decoder, tmp_path)
    assert torch.equal(generate(decoder, PROMPTS, 6, step=step), expected)
    assert step.report().traces_used == 0
    assert step.report().fallback_counts[FallbackKind.TRACE_NOT_USED] >= 1


def test_a_step_whose_trace_cannot_be_stored_goes_to_dynamo_in_later_processes(decoder, tmp_path, monkeypatch):
    """As transformers' forwards on torch 2.13 (a guard on a decorator's closure
    cannot be pickled): the first process runs its trace and records why it could
    not store it; a later process does not trace for nothing, Dynamo dispatches."""
    expected = generate(decoder, PROMPTS, 6)

    def cannot_pickle(traced):
        raise pickle.PicklingError("a guard reads an object pickle cannot name")

    monkeypatch.setattr(traces.dynamo_traces, "dumps", cannot_pickle)
    first = start(decoder, tmp_path)
    assert torch.equal(generate(decoder, PROMPTS, 6, step=first), expected)
    assert first.report().traces_stored == 0
    assert any("PicklingError" in r for r in first.report().reasons(FallbackKind.TRACE_NOT_STORED))

    monkeypatch.setattr(traces.dynamo_traces, "trace", lambda *args: pytest.fail("traced again"))
    second = start(decoder, tmp_path)
    assert torch.equal(generate(decoder, PROMPTS, 6, step=second), expected)
    report = second.report()
    assert (report.traces_used, report.cache_hits, report.cache_misses) == (0, 1, 0)
    assert any("PicklingError" in r for r in report.reasons(FallbackKind.TRACE_NOT_USED))


def test_cache_traces_off_stores_graphs_only(decoder, tmp_path):
    step = start(decoder, tmp_path, cache_traces=False)
    generate(decoder, PROMPTS, 6, step=step)
    assert step.report().traces_stored == 0
    assert len(entries(tmp_path)) == 1
    with pytest.raises(TypeError, match="cache_traces must be a bool"):
        graphopt.GraphOptimizationConfig(graph_opt_level=1, cache_traces="yes")


class Outer:
    class Inner:
        pass


def test_identity_names_objects_by_what_they_are():
    assert identity(torch) == "module torch"
    assert identity(torch.cat) == "builtin torch._VariableFunctionsClass.cat"
    assert identity(torch.nn.Linear) == "class torch.nn.modules.linear.Linear"
    assert identity(scaled).startswith(f"function {__name__}.scaled ")
    assert identity(scaled) != identity(test_identity_names_objects_by_what_they_are)
    assert identity(torch.zeros(1)) is None
    # A class nested in a class is found by its qualified name; only one made in a function is digested.
    assert identity(Outer.Inner) == f"class {__name__}.Outer.Inner"


CHILD = textwrap.dedent('''
    import json, sys, torch, graphopt
    from graphopt.models import Decoder, DecoderConfig, generate
    torch.manual_seed(0)
    model = Decoder(DecoderConfig.tiny()).eval()
    cfg = graphopt.GraphOptimizationConfig(graph_opt_level=1, cache_dir=sys.argv[1], use_cudagraph=False)
    step = graphopt.optimize(model, cfg)
    tokens = generate(model, torch.randint(500, (3, 6), generator=torch.Generator().manual_seed(0)), 4, step=step)
    traced = sum(graph.traced for graph in step.report().graphs)
    print(json.dumps({"tokens": tokens.tolist(), "used": step.report().traces_used, "traced": traced}))
''')


def test_two_processes(decoder, tmp_path):
    """The real thing: the second process traces no graph (the first is this one,
    which builds the step as the child does)."""
    torch._dynamo.reset()
    first = graphopt.optimize(decoder, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, cache_dir=str(tmp_path), use_cudagraph=False))
    tokens = generate(decoder, PROMPTS, 4, step=first)
    assert torch.equal(tokens, generate(decoder, PROMPTS, 4))
    assert (first.report().traces_used, sum(graph.traced for graph in first.report().graphs)) == (0, 1)
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    second = json.loads(done.stdout.strip().splitlines()[-1])
    assert second["tokens"] == tokens.tolist()
    assert (second["used"], second["traced"]) == (1, 0)


class Patches(torch.nn.Module):
    """Swin's first ops: a strided conv, and its windows padded (here by nothing)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 4, stride=4)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.conv(pixels).permute(0, 2, 3, 1)
        return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 0)).relu()


def test_a_trace_made_in_inference_mode_keeps_the_batch_dynamic(tmp_path):
    """Traced as Dynamo compiles (outside inference mode: in it, finding the
    written inputs on fake tensors specialised the batch at a zero `pad`), one
    trace serves every batch size."""
    torch.manual_seed(0)
    model = Patches().eval()
    cfg = graphopt.GraphOptimizationConfig(graph_opt_level=1, cache_dir=str(tmp_path), cudagraph_capture_sizes=[2, 4],
                                           cudagraph_num_of_warmups=1)
    step = graphopt.optimize(model, cfg)
    with torch.inference_mode():
        for batch in (2, 3, 4, 3):
            x = torch.randn(batch, 3, 16, 16)
            torch.testing.assert_close(step(x), model(x))
    assert len(step.report().graphs) == 1 and step.report().recompiles == 0


WEIGHT = torch.ones(3)


def weighted(x: torch.Tensor) -> torch.Tensor:
    return x * WEIGHT


def test_the_trace_reads_module_globals_as_they_are_now(tmp_path, monkeypatch):
    """A global tensor rebound to one of the same shape passes every guard: the
    trace must read the new one, as the function itself would."""
    step = graphopt.optimize(weighted, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, cache_dir=str(tmp_path), use_cudagraph=False))
    x = torch.randn(2, 3)
    torch.testing.assert_close(step(x), x)
    monkeypatch.setattr(sys.modules[__name__], "WEIGHT", torch.full((3,), 2.0))
    torch.testing.assert_close(step(x), x * 2)


def test_guard_sources_are_read_by_a_walker_never_evaluated():
    """Dynamo's guard sources are read by walking their syntax: subscripts by a
    constant, attributes, the lookups Dynamo writes as calls. Anything else (a call
    of an arbitrary function, a computed index) is refused, not run."""
    reader = guard_sources.reader
    module_globals = {"torch": torch}
    frame = {"d": {"k": scaled}, "f": returns_tuple(scaled), "r": {"a": 0, "b": {"k": scaled}}}
    for source, value in [("G['torch'].nn.functional", torch.nn.functional), ("dict.__getitem__(L['d'], 'k')", scaled),
                          ("dict.__getitem__(L['r'], list(dict.keys(L['r']))[1])['k']", scaled),
                          ("list(dict.keys(L['r']))[1]", "b"),
                          ("L['f'].__closure__[0].cell_contents", scaled), ("type(L['d'])", dict),
                          ("G['__import_torch_dot_nn'].Linear", torch.nn.Linear), ("getattr(L['f'], '__name__')",
                                                                                  "scaled")]:
        assert guard_sources.read(reader(source), frame, module_globals) == value, source
    for source in ["__import__('os').getcwd()", "G['torch'].cat()", "L['d'][len(L['d'])]", "eval('1')",
                   "L['x'].size()[0]", "G['__import_no_such_module'].x", "lambda: 0",
                   "dict.__getitem__(L['r'], list(dict.keys(L['d']))[0])"]:
        assert reader(source) is None, source


def test_a_stored_guard_graphopt_cannot_read_refuses_the_trace(decoder, first_start):
    """An entry whose identity guard has a source the walker refuses is not used:
    logged, and the step traced again."""
    expected = generate(decoder, PROMPTS, 6)
    cache_dir = first_start.restore()
    stored = start(decoder, cache_dir)._step.traces
    entry = stored.cache.load(stored.key)
    entry["traces"][0]["identities"]["__import__('os').getcwd()"] = "constant None"
    stored.cache.store(stored.key, entry)
    second = start(decoder, cache_dir)
    assert torch.equal(generate(decoder, PROMPTS, 6, step=second), expected)
    assert (second.report().traces_used, second.report().traces_stored) == (0, 1)
    assert any("__import__('os').getcwd()" in r for r in second.report().reasons(FallbackKind.TRACE_NOT_USED))


def test_a_guard_torch_cannot_store_leaves_the_step_to_dynamo(decoder, tmp_path, monkeypatch):
    """An identity guard whose source graphopt does not read stays Dynamo's, which
    cannot store it: torch's trace fails, Dynamo's dispatch runs the step, and a
    later process goes to Dynamo without tracing for nothing."""
    read = guard_sources.reader
    monkeypatch.setattr(guard_sources, "reader",
                        lambda name: None if name == "G['repeat_kv']" else read(name))
    expected = generate(decoder, PROMPTS, 6)
    first = start(decoder, tmp_path)
    assert torch.equal(generate(decoder, PROMPTS, 6, step=first), expected)
    assert first.report().traces_stored == 0

    monkeypatch.setattr(traces.dynamo_traces, "trace", lambda *args: pytest.fail("traced again"))
    second = start(decoder, tmp_path)
    assert torch.equal(generate(decoder, PROMPTS, 6, step=second), expected)
    assert second.report().fallback_counts[FallbackKind.TRACE_NOT_USED] >= 1


def test_a_torch_nn_container_is_traced_once_and_stored(tmp_path, monkeypatch):
    """torch.compile traces a forward from torch's own files (`nn.Sequential`)
    through a `(*args, **kwargs)` wrapper of its own: a trace's guards are checked on
    that frame (else every call would trace again), and a trace made while the
    parameters hold gradients (after a training step) still stores and loads."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model(torch.randn(2, 8)).sum().backward()
    x = torch.randn(3, 8)
    cfg = graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False, cache_dir=str(tmp_path))
    first = graphopt.optimize(model, cfg)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(first(x), model(x))
    assert (len(first.report().graphs), first.report().traces_stored) == (1, 1)
    assert not first.report().fallbacks
    torch._dynamo.reset()
    second = graphopt.optimize(model, cfg)
    with monkeypatch.context() as patch, torch.no_grad():
        no_tracing(patch)
        x = x.clone()  # a new process's input, without the dims the first start marked
        torch.testing.assert_close(second(x), model(x))
    assert second.report().traces_used == 1


def test_a_step_first_called_in_grad_mode_still_stores_its_inference_trace(tmp_path, monkeypatch):
    """A step called without no_grad on parameters that require grad records autograd:
    its trace serves that process only (its backward is compiled outside the cache),
    but that is the call's mode, not the step's: a later process under no_grad stores
    its own trace, and the one after runs it without tracing."""
    torch.manual_seed(0)
    model = Patches()
    x = torch.randn(2, 3, 8, 8)
    cfg = graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False, cache_dir=str(tmp_path))
    first = graphopt.optimize(model, cfg)
    torch.testing.assert_close(first(x), model(x))
    assert first.report().traces_stored == 0
    assert first.report().fallback_counts[FallbackKind.TRACE_NOT_STORED] >= 1
    for stored, used in ((1, 0), (0, 1)):
        torch._dynamo.reset()
        later = graphopt.optimize(model, cfg)
        with torch.no_grad():
            torch.testing.assert_close(later(x.clone()), model(x))
        assert (later.report().traces_stored, later.report().traces_used) == (stored, used)
