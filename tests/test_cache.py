"""The persistent compile cache: a second "process" (a fresh Backend after
`torch._dynamo.reset()`) loads what the first stored, gives the same outputs and
the same report, and broken, foreign or concurrent entries never give a wrong one.
These start with `cache_traces=False`: the graphs come from the cache, Dynamo still
traces (stored traces: tests/test_traces.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.fx
from cache_starts import PROMPTS, Filled, copy_filled, fill, run
from support import assert_gradients_match
from support import cache_entries as entries

import graphopt
from graphopt import FallbackKind, cache
from graphopt._compat import aot_autograd
from graphopt.backend.backend import Backend
from graphopt.config import GraphOptimizationConfig
from graphopt.models import Decoder, DecoderConfig, generate
from graphopt.report import Report


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> Filled:
    return fill(tmp_path_factory)


def test_second_start_loads_the_graph_and_its_report(decoder, filled, tmp_path):
    expected = generate(decoder, PROMPTS, 6)
    tokens, first = filled.tokens, filled.report
    assert (first.cache_hits, first.cache_misses) == (0, 1)
    assert len(entries(filled.directory)) == 1
    tokens_again, second = run(decoder, copy_filled(filled, tmp_path / "cache"))
    assert torch.equal(tokens, expected) and torch.equal(tokens_again, expected)
    assert (second.cache_hits, second.cache_misses) == (1, 0)
    assert second.graphs[0].cache_hit and not first.graphs[0].cache_hit
    same = ("nodes_before", "nodes_after", "fused_ops")
    assert [getattr(second.graphs[0], f) for f in same] == [getattr(first.graphs[0], f) for f in same]
    passes = [(p.name, p.changed, p.counts) for p in first.passes]
    assert [(p.name, p.changed, p.counts) for p in second.passes] == passes
    assert [m.planned_bytes for m in second.memory] == [m.planned_bytes for m in first.memory]
    assert "loaded from the compile cache" in str(second) and "1 hits" in str(second)


@pytest.mark.parametrize("cache_traces", [False, True])
def test_a_step_that_records_autograd_keeps_its_backward_out_of_the_cache(tmp_path, cache_traces):
    """AOTAutograd compiles a training step's forward, then at its first backward
    the backward, through one compiler: a cache entry holding the forward's key
    would end up with the backward graph, which a later start then ran as its
    forward. Such graphs are compiled without the cache, and say so."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for start in range(2):
        torch._dynamo.reset()
        cfg = graphopt.GraphOptimizationConfig(
            graph_opt_level=1, cache_dir=str(tmp_path), use_cudagraph=False, cache_traces=cache_traces)
        step = graphopt.optimize(model, cfg)
        for _ in range(2):
            assert_gradients_match(step, model, torch.randn(3, 8))
        report = step.report()
        assert (report.cache_hits, report.cache_misses) == (0, 0), start
        assert report.fallback_counts[FallbackKind.CACHE_OFF] >= 1
    with torch.no_grad():  # the inference graph of the same step still goes through the cache
        torch._dynamo.reset()
        step = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
            graph_opt_level=1, cache_dir=str(tmp_path), use_cudagraph=False))
        x = torch.randn(3, 8)
        torch.testing.assert_close(step(x), model(x))
        assert step.report().cache_misses == 1


def test_level_1_hit_skips_aot_autograd_and_the_passes(decoder, filled, tmp_path, monkeypatch):
    cache_dir = copy_filled(filled, tmp_path / "cache")

    def refuse(*args, **kwargs):
        raise AssertionError("a level-1 hit traced again")

    monkeypatch.setattr(aot_autograd, "aot_inference", refuse)
    monkeypatch.setattr(graphopt.passes.manager.PassManager, "run", refuse)
    tokens, report = run(decoder, cache_dir)
    assert torch.equal(tokens, generate(decoder, PROMPTS, 6)) and report.cache_hits == 1


class CacheState:
    def __init__(self):
        self.length = torch.tensor(3)


def write_cache(x: torch.Tensor, cache: torch.Tensor, slot: torch.Tensor, state: CacheState) -> torch.Tensor:
    """The shape of a transformers StaticCache step: a no-op `.to` on a cache tensor,
    stored back on the cache object, makes the graph return one of its inputs."""
    state.length = state.length.to(x.device)
    cache.index_copy_(0, slot, x * 2)
    return x.sum(-1)


def test_level_1_hit_on_a_step_that_returns_an_input_skips_aot_autograd(tmp_path, monkeypatch):
    def start():
        torch._dynamo.reset()
        step = graphopt.optimize(write_cache, graphopt.GraphOptimizationConfig(
            graph_opt_level=1, use_cudagraph=False, cache_dir=str(tmp_path), cache_traces=False))
        x, kv, slot, state = torch.randn(2, 4), torch.zeros(5, 4), torch.tensor([1, 3]), CacheState()
        length = state.length
        total = step(x, kv, slot, state)
        assert state.length is length, "the input the graph returns must be the caller's tensor, as in eager"
        torch.testing.assert_close(kv[slot], x * 2)
        torch.testing.assert_close(total, x.sum(-1))
        return step.report()

    assert start().cache_misses == 1

    def refuse(*args, **kwargs):
        raise AssertionError("a level-1 hit traced AOTAutograd again")

    monkeypatch.setattr(aot_autograd, "aot_inference", refuse)
    assert start().cache_hits == 1


def test_hit_with_host_graphs(decoder, tmp_path):
    expected = generate(decoder, PROMPTS, 6)
    run(decoder, tmp_path, use_cudagraph=True, cudagraph_capture_sizes=[1, 4])
    tokens, report = run(decoder, tmp_path, use_cudagraph=True, cudagraph_capture_sizes=[1, 4])
    assert torch.equal(tokens, expected)
    assert report.cache_hits == 1 and report.replays > 0 and [c.size for c in report.captures] == [4]


def test_a_changed_config_or_version_is_a_miss(decoder, filled, tmp_path, monkeypatch):
    cache_dir = copy_filled(filled, tmp_path / "cache")
    _, other_config = run(decoder, cache_dir, disabled_passes=["fuse_rotary"])
    assert other_config.cache_misses == 1 and "rotary_embedding" not in other_config.graphs[0].fused_ops
    monkeypatch.setattr(cache, "versions", lambda: {"graphopt": "0", "torch": "9.9", "python": "3.11"})
    tokens, other_torch = run(decoder, cache_dir)
    assert other_torch.cache_misses == 1 and torch.equal(tokens, generate(decoder, PROMPTS, 6))
    assert len(entries(cache_dir)) == 3


def test_inductor_options_are_in_the_key():
    """Level 2's code depends on inductor_compile_config: two configs never share an entry."""
    plain = Backend(GraphOptimizationConfig(graph_opt_level=2))
    tuned = Backend(GraphOptimizationConfig(graph_opt_level=2, inductor_compile_config={"max_autotune": True}))
    assert plain.cache.pass_uuid(2, plain.cache.fingerprint()) != tuned.cache.pass_uuid(2, tuned.cache.fingerprint())


@pytest.mark.parametrize("damage", ["truncated", "garbage", "foreign"])
def test_a_broken_entry_is_reported_and_rebuilt(decoder, filled, tmp_path, damage, caplog):
    cache_dir = copy_filled(filled, tmp_path / "cache")
    [entry] = entries(cache_dir)
    data = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        entry.write_bytes(b"\x00not a cache entry" * 10)
    else:  # another key's entry copied over this one
        header, _, body = data.partition(b"\n")
        entry.write_bytes(json.dumps({**json.loads(header), "key": "0" * 64}).encode() + b"\n" + body)
    tokens, report = run(decoder, cache_dir)
    assert torch.equal(tokens, generate(decoder, PROMPTS, 6))
    assert (report.cache_hits, report.cache_misses, report.cache_rebuilt) == (0, 1, 1)
    [reason] = report.reasons(FallbackKind.CACHE_NOT_LOADED)
    assert str(entry) in reason
    assert {"truncated": "signature", "garbage": "header", "foreign": "another key"}[damage] in reason
    _, repaired = run(decoder, cache_dir)
    assert repaired.cache_hits == 1


VERSIONS = {"graphopt": "test", "torch": torch.__version__, "python": "3"}


def _write(directory: str, key: str, fill: int, times: int) -> None:
    store = cache.CompileCache(directory, Report(1))
    for _ in range(times):
        store.store(key, {"fill": fill, "data": torch.full((1 << 18,), fill)})


def _write_many(directory: str, key: str, fill: int, times: int) -> None:
    cache.versions = lambda: VERSIONS  # the same in every process, whatever the checkout holds
    _write(directory, key, fill, times)


def test_concurrent_writers_never_leave_a_broken_entry(tmp_path, monkeypatch):
    """A child process and a thread of this one store one entry at once while this
    one's main thread reads it."""
    monkeypatch.setattr(cache, "versions", lambda: VERSIONS)
    key = cache.cache_key("concurrent")
    theirs = multiprocessing.get_context("spawn").Process(target=_write_many, args=(str(tmp_path), key, 1, 60))
    theirs.start()
    report = Report(1)
    reader = cache.CompileCache(tmp_path, report)
    seen = set()
    while not reader.path(key).exists() and theirs.is_alive():
        time.sleep(0.05)  # the child imports torch first: the thread starts with its first entry
    ours = threading.Thread(target=_write, args=(str(tmp_path), key, 2, 30))
    ours.start()
    while theirs.is_alive() or ours.is_alive():
        payload = reader.load(key)
        if payload is not None:
            assert torch.equal(payload["data"], torch.full((1 << 18,), payload["fill"]))
            seen.add(payload["fill"])
    theirs.join(timeout=60)
    ours.join()
    assert theirs.exitcode == 0
    assert report.cache_rebuilt == 0 and not report.fallbacks
    assert reader.load(key)["fill"] in (1, 2) and seen
    assert [p.name for p in entries(tmp_path)] == [key]  # no temporary file left behind


def test_verify_bypasses_the_cache(decoder, tmp_path):
    """Frozen graphs go through it: tests/test_cache_frozen.py."""
    _, verified = run(decoder, tmp_path, verify=True)
    assert verified.fallback_counts[FallbackKind.CACHE_OFF] >= 1 and not entries(tmp_path)


def test_unwritable_directory_is_reported_not_raised(decoder, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    tokens, report = run(decoder, blocker / "cache")
    assert torch.equal(tokens, generate(decoder, PROMPTS, 6))
    assert report.fallback_counts[FallbackKind.CACHE_NOT_STORED] >= 1


def test_level_2_hit_keeps_the_report(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    decoder = Decoder(DecoderConfig.tiny(num_layers=1)).eval()  # level 2's C++ code for one layer: compiled faster
    expected = generate(decoder, PROMPTS, 6)
    tokens, first = run(decoder, tmp_path / "graphopt", graph_opt_level=2)
    tokens_again, second = run(decoder, tmp_path / "graphopt", graph_opt_level=2)
    assert torch.equal(tokens, expected) and torch.equal(tokens_again, expected)
    assert (first.cache_misses, second.cache_hits) == (1, 1)
    assert [p.name for p in second.passes] == [p.name for p in first.passes]
    assert second.graphs[0].fused_ops == first.graphs[0].fused_ops


def test_config_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    assert graphopt.GraphOptimizationConfig(graph_opt_level=1).cache_dir == str(tmp_path)
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", "")
    assert graphopt.GraphOptimizationConfig(graph_opt_level=1).cache_dir is None
    monkeypatch.delenv("GRAPHOPT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert graphopt.GraphOptimizationConfig(graph_opt_level=1).cache_dir == os.path.join(str(tmp_path), "graphopt")
    assert graphopt.GraphOptimizationConfig(graph_opt_level=1, cache_dir=tmp_path).cache_dir == str(tmp_path)
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="cache_dir must be a directory path .* which is a file"):
        graphopt.GraphOptimizationConfig(graph_opt_level=1, cache_dir=str(tmp_path / "f"))
    with pytest.raises(TypeError, match="cache_dir must be a directory path"):
        graphopt.GraphOptimizationConfig(graph_opt_level=1, cache_dir=3)


def test_subgraph_attributes_are_in_the_key_and_never_stored():
    """A get_attr that reads a subgraph (a higher-order op's body) keys on the body's
    code, and such a graph is refused for storing instead of failing when loaded."""

    def graph_reading(body: torch.nn.Module) -> torch.fx.GraphModule:
        root = torch.nn.Module()
        root.body = torch.fx.symbolic_trace(body)
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        graph.get_attr("body")
        graph.output(graph.call_function(torch.relu, (x,)))
        return torch.fx.GraphModule(root, graph)

    relu, tanh = graph_reading(torch.nn.ReLU()), graph_reading(torch.nn.Tanh())
    assert cache.describe_graph(relu, [torch.ones(2)]) != cache.describe_graph(tanh, [torch.ones(2)])
    with pytest.raises(ValueError, match="get_attr body reads .*only tensor attributes can be stored"):
        cache.dump_graph(relu)


# A user pattern whose extra_check reads a global (ALLOW) and calls a helper (`decide`,
# its source exec'd): two processes may differ in either and nothing else. One process
# runs several starts: argv[1] "first" fills a cache per mode (stored traces or graphs
# only) with the pattern allowed; "second" starts each (mode, ALLOW, helper) of argv[3]
# (JSON) on a fresh copy of its mode's filled cache, as a later process would.
PATTERN_CHILD = textwrap.dedent("""
    import json, shutil, sys, torch, graphopt
    role, base, variants = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

    def silu_search(x):
        return x * torch.sigmoid(x)

    def silu_replace(x):
        return torch.nn.functional.silu(x)

    def check(match):
        return decide(ALLOW)

    def step(x):
        return x * torch.sigmoid(x) + 1

    results = []
    for traces, allow, helper_source in variants:
        cache_dir = f"{base}/{traces}/cache"
        if role == "second":  # the first process's cache as it left it: the config keys the traces on its path
            shutil.rmtree(cache_dir, ignore_errors=True)
            shutil.copytree(f"{base}/{traces}/filled", cache_dir)
        ALLOW = allow == "allow"
        exec(helper_source)  # def decide(flag): ...
        registration = graphopt.register_replacement(silu_search, silu_replace, [torch.randn(2, 8)],
                                                     extra_check=check)
        torch._dynamo.reset()
        opt = graphopt.optimize(step, graphopt.GraphOptimizationConfig(
            graph_opt_level=1, cache_dir=cache_dir, use_cudagraph=False, cache_traces=traces == "traces"))
        x = torch.randn(4, 8)
        torch.testing.assert_close(opt(x), step(x))
        report = opt.report()
        silu = sum(n.target == torch.ops.aten.silu.default for gm in opt.graphs() for n in gm.graph.nodes)
        results.append({"hits": report.cache_hits, "misses": report.cache_misses, "silu": silu,
                        "matches": next(p.counts for p in report.passes if p.name == "user_replacements"),
                        "traces_used": report.traces_used,
                        "trace_refused": bool(report.reasons(graphopt.FallbackKind.TRACE_NOT_USED))})
        registration.remove()
    print(json.dumps(results))
""")
IDENTITY = "def decide(flag):\n    return flag"
NEGATION = "def decide(flag):\n    return not flag"
MODES = ["traces", "graphs only"]
VARIANTS = {"same registration": ("allow", IDENTITY), "global value vetoes": ("veto", IDENTITY),
            "helper code vetoes": ("allow", NEGATION)}


def pattern_process(role: str, base: Path, variants: list[tuple[str, str, str]]) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", PATTERN_CHILD, role, str(base), json.dumps(variants)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def second_starts(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """What a later process saw for each mode and variant, on a copy of the compile
    cache a first process filled with the pattern allowed (x * sigmoid(x) became silu):
    a stored trace is found under the same cache_dir only (the config is in its key)."""
    base = tmp_path_factory.mktemp("allowed")
    firsts = pattern_process("first", base, [(mode, "allow", IDENTITY) for mode in MODES])
    for mode, first in zip(MODES, firsts):
        assert (first["hits"], first["misses"], first["silu"], first["matches"]) == (0, 1, 1, {"silu_search": 1})
        shutil.copytree(base / mode / "cache", base / mode / "filled")
    # The same registration first: it must hit in a process that never compiled the step.
    runs = [(mode, name) for mode in MODES for name in VARIANTS]
    seconds = pattern_process("second", base, [(mode, *VARIANTS[name]) for mode, name in runs])
    return dict(zip(runs, seconds))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("traces", MODES)
def test_a_changed_extra_check_is_a_miss_in_another_process(second_starts, traces, variant):
    """Issue #25: an extra_check that decides otherwise in a later process, by a
    global it reads or a helper it calls, never loads the graph the first one
    shaped; the same registration still hits, through stored traces or not."""
    second = second_starts[traces, variant]
    if variant == "same registration":
        assert (second["hits"], second["misses"], second["silu"]) == (1, 0, 1)
        assert second["traces_used"] == (traces == "traces")
    else:
        assert (second["hits"], second["misses"], second["silu"], second["matches"]) == (0, 1, 0, {})
        assert second["trace_refused"] == (traces == "traces")
