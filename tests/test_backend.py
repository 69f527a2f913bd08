import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch
import torch._dynamo
from support import decode_inputs

import graphopt
from graphopt import FallbackKind
from graphopt.config import tolerance
from graphopt.models import Decoder, DecoderConfig

ATOL, RTOL = tolerance(torch.float32)


@pytest.fixture
def decoder() -> Decoder:
    """One layer: what these tests read (Dynamo's dispatch, the replays, the frozen inputs)
    is the same for every layer, and each layer adds its share to every compile."""
    torch.manual_seed(0)
    return Decoder(DecoderConfig.tiny(num_layers=1)).eval()


def test_backend_is_registered_by_name():
    assert "graphopt" in torch._dynamo.list_backends()


def test_backend_entry_point_is_declared():
    (entry,) = [e for e in entry_points(group="torch_dynamo_backends") if e.name == "graphopt"]
    assert entry.value == "graphopt.backend.registry:graphopt_backend"
    assert entry.load() is graphopt.graphopt_backend


@pytest.mark.parametrize("level", [0, 1])
def test_torch_compile_with_backend_name(decoder, level):
    compiled = torch.compile(decoder, backend="graphopt", options={"graph_opt_level": level, "use_cudagraph": False})
    with torch.inference_mode():
        for batch in (2, 4):
            inputs = decode_inputs(batch)
            expected = decoder(*inputs)
            decoder.reset_cache()
            torch.testing.assert_close(compiled(*inputs), expected, atol=ATOL, rtol=RTOL)
            decoder.reset_cache()


def test_backend_options_are_validated(decoder):
    compiled = torch.compile(decoder, backend="graphopt", options={"use_cuda_graph": False})
    with pytest.raises(Exception, match=r"use_cuda_graph.*did you mean 'use_cudagraph'"):
        with torch.inference_mode():
            compiled(*decode_inputs(2))


def test_frozen_inputs_are_handed_to_the_passes_only_when_parameters_are_frozen(decoder):
    frozen = graphopt.optimize(decoder, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, use_cudagraph=False, freeze_parameters=True))
    live = graphopt.optimize(decoder, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    with torch.inference_mode():
        frozen(*decode_inputs(3))
        live(*decode_inputs(3))
    handed = frozen.graphs()[0].meta["graphopt_frozen_inputs"]
    named = dict(decoder.named_parameters()) | dict(decoder.named_buffers())
    assert len(handed) == len(named)
    assert {id(t) for t in handed.values()} == {id(t) for t in named.values()}
    assert "graphopt_frozen_inputs" not in live.graphs()[0].meta


def device_graph_config(level=1, **kw):
    kw.setdefault("cudagraph_capture_sizes", [2, 4, 8])
    kw.setdefault("cudagraph_num_of_warmups", 1)
    return graphopt.GraphOptimizationConfig(graph_opt_level=level, **kw)


@pytest.mark.parametrize("level", [0, 1])
def test_backend_object_replays_device_graphs(level):
    torch.manual_seed(0)
    config = DecoderConfig.tiny(num_layers=1)
    eager, model = Decoder(config).eval(), Decoder(config).eval()
    model.load_state_dict(eager.state_dict())
    backend = graphopt.Backend(device_graph_config(level), pad_values={"slots": model.scratch_slot})
    compiled = torch.compile(model, backend=backend)
    with torch.inference_mode():
        for position, batch in enumerate([3, 3, 3, 3, 5, 5, 5]):
            inputs = decode_inputs(batch, position)
            torch.testing.assert_close(compiled(*inputs), eager(*inputs), atol=ATOL, rtol=RTOL)
    report = backend.report()
    # Dynamo compiles the first shape (3) statically, and a graph with a batch
    # symbol when a second one (5) arrives: 3 is captured as it is, 5 padded to 8.
    assert [c.size for c in report.captures] == [3, 8]
    assert report.replays == 3 and not report.fallbacks


def test_backend_by_name_with_options_builds_one_backend_for_the_call(decoder):
    options = {"graph_opt_level": 1, "cudagraph_capture_sizes": [2, 4], "cudagraph_num_of_warmups": 1}
    compiled = torch.compile(decoder, backend="graphopt", options=options)
    with torch.inference_mode():
        for _ in range(4):
            compiled(*decode_inputs(2))
    assert graphopt.backends()[-1].report().replays == 2


class Guarded(torch.nn.Module):
    """Python state `forward` reads: an attribute, a flag and a module-level constant."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.scale = 1.0
        self.use_relu = False

    def forward(self, x):
        y = self.linear(x) * self.scale * OFFSET
        return torch.relu(y) if self.use_relu else y


OFFSET = 1.0


def test_guards_run_before_every_replay():
    """A change Dynamo guards on recompiles (and captures anew) instead of replaying a stale graph."""
    global OFFSET
    torch.manual_seed(0)
    model = Guarded().eval()
    opt = graphopt.optimize(model, device_graph_config())
    x = torch.randn(3, 8)
    with torch.inference_mode():
        for change in (None, ("scale", 3.0), ("use_relu", True), ("OFFSET", -2.0)):
            if change is not None and change[0] == "OFFSET":
                OFFSET = change[1]
            elif change is not None:
                setattr(model, *change)
            for _ in range(3):  # a warm-up, the capture, a replay
                torch.testing.assert_close(opt(x), model(x), atol=ATOL, rtol=RTOL)
    OFFSET = 1.0
    assert opt.report().replays == 4 and opt.report().recompiles >= 3


@pytest.mark.parametrize("level", [0, 1])
def test_an_empty_batch_never_replays(decoder, level):
    opt = graphopt.optimize(decoder, device_graph_config(level), pad_values={"slots": decoder.scratch_slot})
    with torch.inference_mode():
        for _ in range(3):
            opt(*decode_inputs(2))
        replays = opt.report().replays
        empty = tuple(x[:0] for x in decode_inputs(2))
        with pytest.raises(RuntimeError) as eager_error:
            decoder(*empty)
        with pytest.raises(type(eager_error.value)):
            opt(*empty)
    assert opt.report().replays == replays


def test_dynamo_giving_up_is_counted():
    model = Guarded().eval()
    # Dynamo's own dispatch: stored traces (cache_dir) count traces against the same limit.
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, use_cudagraph=False, cache_dir=None))
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    x = torch.randn(3, 8)
    with torch.inference_mode(), torch._dynamo.config.patch(**{name: 1}):
        for scale in (1.0, 2.0, 3.0):
            model.scale = scale
            torch.testing.assert_close(opt(x), model(x), atol=ATOL, rtol=RTOL)
    (reason,) = opt.report().reasons(FallbackKind.EAGER)
    assert "recompile_limit" in reason  # the setting to raise


def test_a_backend_gives_its_recompile_budget_back_when_it_goes():
    """Each Backend raises Dynamo's per-function recompile limit by its share while it
    lives (its graphs count against that limit) and lowers it again when it is gone."""
    import gc

    from graphopt._compat.recompile import recompile_limit
    from graphopt.backend.backend import RECOMPILE_BUDGET

    gc.collect()  # Backends of earlier tests that are already garbage give their share back first
    before = recompile_limit()
    backend = graphopt.Backend(graphopt.GraphOptimizationConfig(graph_opt_level=1))
    assert recompile_limit() == before + RECOMPILE_BUDGET
    del backend
    gc.collect()
    assert recompile_limit() == before


def test_a_backend_collected_by_the_garbage_collector_writes_no_torch_config(monkeypatch):
    """A Backend's finalizer runs inside the garbage collector, which may have been
    entered from a `ContextVar.set` (torch's config is context variables): a config
    write there frees the context's variables under the outer set (CPython before 3.12,
    gh-148891), a segfault in a later Dynamo trace. Its budget is given back later."""
    import gc

    from graphopt._compat.recompile import recompile_limit

    gc.collect()
    before = recompile_limit()
    backend = graphopt.Backend(graphopt.GraphOptimizationConfig(graph_opt_level=1))
    backend.cycle = backend  # only the collector frees it, as a compiled model's Backend
    writes = []
    config_module = type(torch._dynamo.config)
    write = config_module.__setattr__
    monkeypatch.setattr(config_module, "__setattr__",
                        lambda module, name, value: writes.append(name) or write(module, name, value))
    del backend
    gc.collect()
    assert writes == []
    assert recompile_limit() == before and len(writes) == 1  # the budget, taken off at this read


# One fresh process (Inductor keeps what both tests read for the process): first a
# level-2 Backend's ISA checks, whose outcome goes to a file, then a level-2 compile that
# must print nothing at all.
LEVEL_2_PROCESS = """
import pathlib, sys, threading, traceback, torch, graphopt
from torch._inductor import cpu_vec_isa
from graphopt.models import Decoder, DecoderConfig

def started():
    return any(t.name == "graphopt-cpu-isa-checks" for t in threading.enumerate())

def isa_checks():
    graphopt.Backend(graphopt.GraphOptimizationConfig(graph_opt_level=1, cache_dir=None))
    assert not started() and cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0
    graphopt.Backend(graphopt.GraphOptimizationConfig(graph_opt_level=2, cache_dir=None))
    assert started()
    imported = set(sys.modules)
    next(t for t in threading.enumerate() if t.name == "graphopt-cpu-isa-checks").join(300)
    assert set(sys.modules) == imported, set(sys.modules) - imported  # the thread imports nothing
    assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1
    assert cpu_vec_isa.pick_vec_isa() in cpu_vec_isa.valid_vec_isa_list()

try:
    isa_checks()
    outcome = "ok"
except Exception:
    outcome = traceback.format_exc()
pathlib.Path(sys.argv[1]).write_text(outcome)

torch.manual_seed(0)
model = Decoder(DecoderConfig.tiny(num_layers=1)).eval()
config = graphopt.GraphOptimizationConfig(graph_opt_level=2, freeze_parameters=True, use_cudagraph=False,
                                          cache_dir=None)
opt = graphopt.optimize(model, config)
with torch.inference_mode():
    for batch in (2, 3):
        ids = torch.randint(0, model.config.vocab_size, (batch,))
        args = (ids, torch.full((batch,), 5), torch.arange(batch))
        expected = model(*args)
        model.reset_cache()
        torch.testing.assert_close(opt(*args), expected, atol={atol}, rtol={rtol})
        model.reset_cache()
report = opt.report()
assert any(g.gemms for g in report.graphs) and not report.fallbacks, report.fallbacks
"""


@pytest.fixture(scope="module")
def level_2_process(tmp_path_factory):
    """The fresh process's result and the ISA checks' outcome ("ok" or their traceback)."""
    folder = tmp_path_factory.mktemp("level-2-process")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"))
    script = LEVEL_2_PROCESS.format(atol=ATOL, rtol=RTOL)
    done = subprocess.run([sys.executable, "-c", script, str(folder / "isa-checks")], capture_output=True,
                          text=True, timeout=600, env=env, check=False)
    outcome = folder / "isa-checks"
    return done, outcome.read_text() if outcome.exists() else "the process ended before the checks"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the checks are for CPU-only processes")
def test_a_level_2_backend_starts_inductors_cpu_isa_checks_at_once(level_2_process):
    """The C++ compiles Inductor's first CPU compile begins with run on a thread
    from the moment a level-2 Backend exists, beside Dynamo's trace (a fresh
    process: Inductor keeps their result for the process)."""
    done, outcome = level_2_process
    assert outcome == "ok", outcome + done.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the autotuned GEMMs of frozen weights are the CPU's")
def test_a_level_2_compile_with_autotuned_gemms_prints_nothing(level_2_process):
    """Inductor times each GEMM of a frozen weight; what it chose is in the report and
    nothing reaches stdout or stderr (a fresh process: some of it is printed once)."""
    done, _ = level_2_process
    assert done.returncode == 0, done.stderr[-3000:]
    assert (done.stdout, done.stderr) == ("", "")


@pytest.mark.parametrize("fails", [False, True])
def test_a_compile_runs_with_fewer_collections_and_puts_the_collector_back(monkeypatch, fails):
    """Inside a compile the collector's thresholds are COMPILE_GC_THRESHOLDS and the objects
    made before are frozen; after it, failed or not, both are as they were."""
    import gc

    from graphopt.backend import compile_graph

    seen = []
    level1 = compile_graph.GraphCompiler._level1

    def spy(self, *args):
        seen.append((gc.get_threshold(), gc.get_freeze_count() > 0))
        if fails:
            raise RuntimeError("the compile failed")
        return level1(self, *args)

    monkeypatch.setattr(compile_graph.GraphCompiler, "_level1", spy)
    before = gc.get_threshold()
    model = torch.nn.Linear(4, 4).eval()
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False,
                                                                     cache_dir=None))
    x = torch.randn(2, 4)
    with torch.no_grad():
        if fails:
            with pytest.raises(Exception, match="the compile failed"):
                opt(x)
        else:
            torch.testing.assert_close(opt(x), model(x))
    assert seen and seen[0] == (compile_graph.COMPILE_GC_THRESHOLDS, True)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
