"""Frozen graphs (freeze_parameters=True) in the compile cache: a second start loads
them, folds their constants from its own weights (never from the first start's),
and a changed weight never gives a stale answer; cache export and import between
two directories, refusing entries another torch wrote. A "start" is a fresh
optimized step after `torch._dynamo.reset()`, or a subprocess where two start at once."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tarfile
import textwrap

import pytest
import torch
import torch._dynamo
from cache_starts import Kept
from support import cache_entries as entries

import graphopt
from graphopt import FallbackKind, cache, cache_transfer
from graphopt._compat import inductor
from graphopt.backend import frozen_code, inductor_options
from graphopt.cli import main as cli
from graphopt.config import tolerance
from graphopt.models import Decoder, DecoderConfig, generate

PROMPTS = torch.randint(500, (3, 6), generator=torch.Generator().manual_seed(0))


def start(model, cache_dir, **config):
    torch._dynamo.reset()
    cfg = graphopt.GraphOptimizationConfig(**{"graph_opt_level": 1, "cache_dir": str(cache_dir), "use_cudagraph": False,
                                              "freeze_parameters": True, **config})
    return graphopt.optimize(model, cfg, pad_values={"slots": model.scratch_slot} if hasattr(model, "scratch_slot")
                             else None)


def generated(decoder, cache_dir, **config):
    step = start(decoder, cache_dir, **config)
    return generate(decoder, PROMPTS, 6, step=step), step.report()


def stored(cache_dir) -> list[dict]:
    payloads = []
    for path in entries(cache_dir):
        _, body = cache.split_entry(path.read_bytes(), path.name)
        with cache.compat.real_tensors():
            payloads.append(pickle.loads(body))
    return payloads


@pytest.fixture(scope="module")
def first_start(tmp_path_factory) -> tuple[Kept, torch.Tensor, graphopt.Report]:
    """A first level-1 start's cache of frozen graphs, put back as it was for each test
    (`restore()`), with that start's tokens and report."""
    torch.manual_seed(0)  # the weights of conftest's `decoder`
    model = Decoder(DecoderConfig.tiny()).eval()
    directory = tmp_path_factory.mktemp("first-start") / "cache"
    tokens, report = generated(model, directory)
    torch._dynamo.reset()
    return Kept(directory), tokens, report


def test_level_1_frozen_second_start_loads_without_the_weights(decoder, first_start):
    expected = generate(decoder, PROMPTS, 6)
    kept, tokens, first = first_start
    cache_dir = kept.restore()
    tokens_again, second = generated(decoder, cache_dir)
    assert torch.equal(tokens, expected) and torch.equal(tokens_again, expected)
    assert (first.cache_hits, first.cache_misses, second.cache_hits, second.cache_misses) == (0, 1, 1, 0)
    assert (first.traces_stored, second.traces_used) == (1, 1)
    assert second.graphs[0].cache_hit and "loaded from the compile cache with its stored Dynamo trace" in str(second)
    [entry] = [e for e in stored(cache_dir) if "frozen" in e]
    folded = entry["frozen"]["values"]
    assert folded  # the decoder's fused projections are folded from its weights
    kept = {**entry["lowered"]["attributes"], **entry["graph"]["attributes"]}
    assert not set(folded) & set(kept)
    weights = sum(p.numel() * p.element_size() for p in decoder.parameters())
    assert sum(t.numel() * t.element_size() for t in kept.values()) < weights / 10


def test_level_1_a_changed_weight_refolds_on_the_second_start(decoder, first_start):
    cache_dir = first_start[0].restore()
    with torch.no_grad():
        for layer in decoder.layers:
            layer.mlp.up_proj.weight.mul_(1.5)
            layer.self_attn.k_proj.weight.neg_()
    expected = generate(decoder, PROMPTS, 6)
    tokens, report = generated(decoder, cache_dir)
    assert torch.equal(tokens, expected) and report.cache_hits == 1
    with torch.no_grad():  # refresh() after a hit reaches the values it folded
        decoder.layers[0].mlp.gate_proj.weight.mul_(-2)
    step = start(decoder, cache_dir)
    generate(decoder, PROMPTS, 2, step=step)
    decoder.layers[0].mlp.down_proj.weight.data.mul_(3)
    assert step.refresh() > 0
    assert torch.equal(generate(decoder, PROMPTS, 6, step=step), generate(decoder, PROMPTS, 6))


class Scaled(torch.nn.Module):
    """Folds `1 + scale` (small: a pass may read its values) and `2 * weight` (large)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.zeros(64))
        self.weight = torch.nn.Parameter(torch.randn(64, 5000))

    def forward(self, x):
        return (x * (1 + self.scale)) @ (2 * self.weight)


@pytest.mark.parametrize("level, kept", [(1, "frozen"), (2, "code")])
def test_a_changed_value_the_passes_read_compiles_again(level, kept, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model, x = Scaled().eval(), torch.randn(4, 64)
    with torch.no_grad():
        start(model, tmp_path / "graphopt", graph_opt_level=level)(x)
        [entry] = [e for e in stored(tmp_path / "graphopt") if kept in e]
        assert entry["frozen"]["read"]  # 1 + scale: small, so a pass may read it (kept by digest)
        model.scale.fill_(0.5)
        step = start(model, tmp_path / "graphopt", graph_opt_level=level)
        out = step(x)
    atol, rtol = tolerance(torch.float32)
    torch.testing.assert_close(out, model(x), atol=atol, rtol=rtol)
    report = step.report()
    assert (report.cache_hits, report.cache_misses) == (0, 1)
    assert report.fallback_counts[FallbackKind.CACHE_NOT_LOADED] >= 1


@pytest.mark.parametrize("level", [1, 2])
def test_a_trace_whose_folded_value_a_pass_may_read_is_stored_and_a_change_to_it_traces_again(
        level, tmp_path, monkeypatch):
    """`1 + scale` is small enough that a pass may have read it (transformers' rotary
    tables at a short prompt are too): the trace is stored all the same, and a second
    start runs it without Dynamo. An in-place change of `scale` after that start gives
    eager's answer: level 1 recomputes the folded value, as after a compile; level 2's
    code may rest on the old value, so the graph's code is let go and the step traced
    and compiled again, as a first start would."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model, x = Scaled().eval(), torch.randn(4, 64)
    atol, rtol = tolerance(torch.float32)
    with torch.no_grad():
        first = start(model, tmp_path / "graphopt", graph_opt_level=level)
        first(x.clone())  # a tensor of its own: the first call marks its batch dim dynamic
        step = start(model, tmp_path / "graphopt", graph_opt_level=level)
        torch.testing.assert_close(step(x), model(x), atol=atol, rtol=rtol)
        assert (first.report().traces_stored, step.report().traces_used) == (1, 1), step.report().fallbacks
        model.scale.fill_(0.5)
        out = step(x)
        torch.testing.assert_close(out, model(x), atol=atol, rtol=rtol)
        torch.testing.assert_close(step(x), model(x), atol=atol, rtol=rtol)
    report = step.report()
    refused = [reason for reason in report.fallbacks if "may have read changed" in reason]
    assert (len(refused), report.recompiles) == ((1, 1) if level == 2 else (0, 0)), report.fallbacks
    assert report.weight_refreshes


def level_2_decoder(monkeypatch, tmp_path) -> Decoder:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    return Decoder(DecoderConfig.tiny(num_layers=1)).eval()  # level 2's C++ code for one layer: compiled faster


def test_level_2_frozen_entry_holds_the_code_without_the_weights(tmp_path, monkeypatch):
    """A second start loads Inductor's code from graphopt's entry and packs its own
    weights for it; a changed weight loads the same code with the new weight packed."""
    decoder = level_2_decoder(monkeypatch, tmp_path)
    expected = generate(decoder, PROMPTS, 6)
    tokens, first = generated(decoder, tmp_path / "graphopt", graph_opt_level=2)
    tokens_again, second = generated(decoder, tmp_path / "graphopt", graph_opt_level=2)
    assert torch.equal(tokens, expected) and torch.equal(tokens_again, expected)
    assert (first.cache_misses, second.cache_hits, second.cache_misses) == (1, 1, 0)
    assert (first.traces_stored, second.traces_used) == (1, 1)  # no Dynamo trace on the second start
    assert second.graphs[0].gemms == first.graphs[0].gemms  # the choices, from graphopt's entry
    [entry] = [e for e in stored(tmp_path / "graphopt") if "code" in e]
    kinds = [spec[0] for spec in entry["constants"].values()]
    assert sorted(kinds) in (["folded", "folded"], ["folded", "packed"], ["packed", "packed"])  # QKV, gate-up
    templates = [choice for choice in first.graphs[0].gemms.values() if choice.startswith("C++ template")]
    assert kinds.count("packed") == len(templates), (kinds, first.graphs[0].gemms)  # the template packs its weight
    weights = sum(p.numel() * p.element_size() for p in decoder.parameters())
    assert len(pickle.dumps(entry)) < weights / 2  # the code and recipes: the tiny decoder's is 40% of its weights
    with torch.no_grad():
        decoder.layers[0].mlp.up_proj.weight.mul_(1.5)
        decoder.layers[0].self_attn.q_proj.weight.neg_()
    step = start(decoder, tmp_path / "graphopt", graph_opt_level=2)
    tokens = generate(decoder, PROMPTS, 6, step=step)
    assert torch.equal(tokens, generate(decoder, PROMPTS, 6)) and not torch.equal(tokens, expected)
    assert (step.report().cache_hits, step.report().cache_misses, step.report().traces_used) == (1, 0, 1)
    with torch.no_grad():  # noticed before the next call: the constants made again, nothing compiled
        decoder.layers[0].mlp.down_proj.weight.mul_(-1)
        decoder.layers[0].mlp.gate_proj.weight.mul_(2)
    assert torch.equal(generate(decoder, PROMPTS, 6, step=step), generate(decoder, PROMPTS, 6))
    assert step.report().weight_refreshes and step.report().repacks == 0
    # The entry is whole: exported to a directory beside an empty Inductor cache, it loads.
    archive, imported = tmp_path / "cache.tar.gz", tmp_path / "imported"
    assert cache_transfer.export(tmp_path / "graphopt", archive).moved == len(entries(tmp_path / "graphopt"))
    assert not cache_transfer.import_(archive, imported).refused
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-of-another-machine"))
    tokens, moved = generated(decoder, imported, graph_opt_level=2)
    assert torch.equal(tokens, generate(decoder, PROMPTS, 6)) and (moved.cache_hits, moved.cache_misses) == (1, 0)


def test_a_graph_past_the_cpp_wrapper_bound_is_stored_and_loaded_with_the_python_wrapper(tmp_path, monkeypatch):
    """A graph reading more weights than CPP_WRAPPER_MAX_WEIGHT_BYTES is compiled with
    Inductor's Python wrapper (below it, the C++ one); its frozen entry loads the same way."""
    decoder = level_2_decoder(monkeypatch, tmp_path)
    weights = sum(p.numel() * p.element_size() for p in decoder.parameters())
    wrappers = []
    compile_ = inductor.inductor_compile
    monkeypatch.setattr(inductor, "inductor_compile", lambda gm, inputs, post, uuid, options:
                        wrappers.append(options.get("cpp_wrapper", False)) or compile_(gm, inputs, post, uuid, options))
    expected = generate(decoder, PROMPTS, 6)
    for bound, cpp_wrapper in ((weights + 1, True), (weights, False)):
        monkeypatch.setattr(inductor_options, "CPP_WRAPPER_MAX_WEIGHT_BYTES", bound)
        cache_dir, wrappers[:] = tmp_path / f"graphopt-{bound}", []
        tokens, first = generated(decoder, cache_dir, graph_opt_level=2)
        tokens_again, second = generated(decoder, cache_dir, graph_opt_level=2)
        assert wrappers == [cpp_wrapper]  # one compile, at the first start
        assert torch.equal(tokens, expected) and torch.equal(tokens_again, expected)
        assert (first.cache_misses, second.cache_hits, second.cache_misses) == (1, 1, 0), second.fallbacks


def test_gemm_timings_are_kept_per_cpu_model():
    """Inductor's local autotune cache is one file per GPU kind: within graphopt's compiles
    it is one per CPU model too, so one machine's timings never choose another's kernels."""
    from torch._inductor.codecache import CacheBase

    from graphopt._compat import autotune

    shared = CacheBase.get_local_cache_path()
    with autotune.timings_kept_per("AMD EPYC (AVX512)"):
        epyc = CacheBase.get_local_cache_path()
    with autotune.timings_kept_per("Intel Xeon (AVX512)"):
        xeon = CacheBase.get_local_cache_path()
    assert epyc.parent == xeon.parent == shared.parent
    assert len({epyc.name, xeon.name, shared.name}) == 3 and epyc.name.startswith(shared.name)
    assert CacheBase.get_local_cache_path() == shared


class GatedLayer(torch.nn.Module):
    """Two projections of one input: with frozen weights, one GEMM on their concatenation."""

    def __init__(self):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return torch.nn.functional.silu(self.gate(x)) * self.up(x)


def test_with_the_cache_off_each_gemm_shape_is_timed_once_and_nothing_is_kept(tmp_path, monkeypatch):
    """Inductor keeps no GEMM timing in memory: without its local autotune cache each layer
    timed its GEMM shapes again. With graphopt's cache off the timings are kept for this
    process only, in a directory of its own, never beside Inductor's cache."""
    from torch._inductor import select_algorithm

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[GatedLayer() for _ in range(3)]).eval()
    timed = []
    saver = lambda timings, name, inputs, *rest: timed.append(sorted(timings.values()))  # noqa: E731
    select_algorithm.add_feedback_saver(saver)
    try:
        opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
            graph_opt_level=2, freeze_parameters=True, cache_dir=None, use_cudagraph=False))
        x = torch.randn(1, 64)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x), **dict(zip(("atol", "rtol"), tolerance(torch.float32))))
    finally:
        select_algorithm.get_algorithm_selector_cache().feedback_saver_fns.remove(saver)
    assert len(opt.report().graphs[0].gemms) == 1  # three layers, one shape
    # Each layer's GEMM gets the first one's timings, not timings of its own.
    assert len(timed) == 3 and timed[0] == timed[1] == timed[2], timed
    assert not list((tmp_path / "inductor").rglob("*autotune*")) and not list((tmp_path / "inductor").rglob("*local*"))


def test_a_frozen_level_2_graph_that_cannot_be_stored_still_serves_and_says_why(tmp_path, monkeypatch):
    from graphopt.backend import graph_cache

    def refused(graph, inputs):
        raise ValueError("its frozen input w is not one of the graph's inputs")

    monkeypatch.setattr(graph_cache, "frozen_entry", refused)
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(GatedLayer(), GatedLayer()).eval(), torch.randn(1, 64)
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=2, freeze_parameters=True, cache_dir=str(tmp_path), use_cudagraph=False))
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), **dict(zip(("atol", "rtol"), tolerance(torch.float32))))
    [why] = opt.report().reasons(FallbackKind.CACHE_NOT_STORED)
    assert "a frozen graph could not be stored (its frozen input w is not one of the graph's inputs)" in why
    assert not entries(tmp_path)


def test_level_2_a_constant_without_a_recipe_keys_the_entry_on_the_weights(tmp_path, monkeypatch):
    """Where Inductor made a constant graphopt cannot trace back to the weights, the
    entry holds it by value under a key of the weights' values: the same weights load
    it, a changed weight compiles again."""
    decoder = level_2_decoder(monkeypatch, tmp_path)
    traced = frozen_code.constant_specs

    def untraced(recorded, gm):
        specs, _ = traced(recorded, gm)
        return {name: ("value", recorded.constants[0][name]) for name in specs}, "untraced, for the test"

    monkeypatch.setattr(frozen_code, "constant_specs", untraced)
    expected = generate(decoder, PROMPTS, 6)
    tokens, first = generated(decoder, tmp_path / "graphopt", graph_opt_level=2)
    tokens_again, second = generated(decoder, tmp_path / "graphopt", graph_opt_level=2)
    assert torch.equal(tokens, expected) and torch.equal(tokens_again, expected)
    assert (first.cache_misses, second.cache_hits, second.cache_misses) == (1, 1, 0)
    assert [e["keyed_on_weights"] for e in stored(tmp_path / "graphopt") if "keyed_on_weights" in e] \
        == ["untraced, for the test"]
    with torch.no_grad():
        decoder.layers[0].mlp.up_proj.weight.mul_(1.5)
    tokens, changed = generated(decoder, tmp_path / "graphopt", graph_opt_level=2)
    assert torch.equal(tokens, generate(decoder, PROMPTS, 6)) and not torch.equal(tokens, expected)
    assert (changed.cache_hits, changed.cache_misses) == (0, 1)


CHILD = textwrap.dedent('''
    import json, sys, torch, graphopt
    from graphopt.models import Decoder, DecoderConfig, generate
    torch.manual_seed(0)
    decoder = Decoder(DecoderConfig.tiny()).eval()
    prompts = torch.randint(500, (3, 6), generator=torch.Generator().manual_seed(0))
    cfg = graphopt.GraphOptimizationConfig(graph_opt_level=int(sys.argv[2]), cache_dir=sys.argv[1],
                                           use_cudagraph=False, freeze_parameters=True)
    step = graphopt.optimize(decoder, cfg, pad_values={"slots": decoder.scratch_slot})
    print("ready", flush=True)  # imported: the test's own start begins with this one's compile
    tokens = generate(decoder, prompts, 6, step=step)
    print(json.dumps({"same": torch.equal(tokens, generate(decoder, prompts, 6)),
                      "hits": step.report().cache_hits, "misses": step.report().cache_misses,
                      "rebuilt": step.report().cache_rebuilt}))
''')


@pytest.mark.parametrize("level", [1, 2])
def test_two_processes_starting_at_once_on_one_cache(decoder, tmp_path, level):
    """A child process and this one compile and store the same entries at once (this
    one's start begins when the child has imported torch and is about to compile); a
    start after them loads their entry, folded (and at level 2 packed) from its own weights."""
    cache_dir = tmp_path / "cache"
    with open(tmp_path / "child.err", "w+") as err:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(cache_dir), str(level)], stdout=subprocess.PIPE,
                                 stderr=err, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        ready = child.stdout.readline()
        tokens, ours = generated(decoder, cache_dir, graph_opt_level=level) if ready == "ready\n" else (None, None)
        out, _ = child.communicate(timeout=600)
        err.seek(0)
        assert child.returncode == 0 and ready == "ready\n", err.read()[-3000:]
    theirs = json.loads(out.strip().splitlines()[-1])
    expected = generate(decoder, PROMPTS, 6)
    assert theirs["same"] and theirs["rebuilt"] == 0, theirs
    assert torch.equal(tokens, expected) and ours.cache_rebuilt == 0, ours.fallbacks
    tokens, after = generated(decoder, cache_dir, graph_opt_level=level)
    assert torch.equal(tokens, expected)
    assert (after.cache_hits, after.cache_rebuilt) == (1, 0), (theirs, ours.fallbacks, after.fallbacks)


def test_export_import_round_trip_between_two_directories(decoder, first_start, tmp_path, capsys):
    expected = generate(decoder, PROMPTS, 6)
    filled = first_start[0].restore()
    assert cli.main(["cache", "export", str(tmp_path / "a.tar.gz"), "--cache-dir", str(filled)]) == 0
    assert cli.main(["cache", "import", str(tmp_path / "a.tar.gz"), "--cache-dir", str(tmp_path / "b")]) == 0
    assert f"imported {len(entries(filled))} entries, refused 0" in capsys.readouterr().out
    assert (filled / "signing.key").read_bytes() != (tmp_path / "b" / "signing.key").read_bytes()
    tokens, report = generated(decoder, tmp_path / "b")
    assert torch.equal(tokens, expected) and (report.cache_hits, report.cache_misses, report.cache_rebuilt) == (1, 0, 0)


def test_an_entry_from_another_torch_is_refused_with_its_reason(first_start, tmp_path, monkeypatch, caplog):
    filled = first_start[0].restore()
    other = {**cache.versions(), "torch": "2.0.0"}
    monkeypatch.setattr(cache, "versions", lambda: other)  # the exporting machine's torch
    for path in entries(filled):  # rewritten as that torch would have written it
        line, _, body = path.read_bytes().partition(b"\n")
        header = json.loads(line)
        path.write_bytes(json.dumps({**header, "torch": "2.0.0"}).encode() + b"\n" + body)
    cache_transfer.export(filled, tmp_path / "a.tar.gz")
    monkeypatch.undo()
    done = cache_transfer.import_(tmp_path / "a.tar.gz", tmp_path / "b")
    assert done.moved == 0 and len(done.refused) == len(entries(filled))
    assert set(done.refused.values()) == {f"written by torch 2.0.0, this is {torch.__version__}"}
    assert "refused" in caplog.text and "written by torch 2.0.0" in caplog.text
    assert not entries(tmp_path / "b")


def test_import_refuses_a_file_that_is_not_an_export(tmp_path):
    with tarfile.open(tmp_path / "x.tar.gz", "w:gz"):
        pass
    with pytest.raises(ValueError, match="not a graphopt cache export"):
        cache_transfer.import_(tmp_path / "x.tar.gz", tmp_path / "b")
