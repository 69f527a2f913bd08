"""The cleanup passes as a pipeline: rounds to a fixed point, their report, both levels."""

import pytest
import torch
from support import targets

import graphopt
from graphopt._compat import inductor
from graphopt.passes import manager
from graphopt.passes.base import PassResult
from graphopt.passes.canonical import canonical_passes
from graphopt.passes.constant_fold import refresh_folded_constants
from graphopt.passes.fusion import fusion_passes

aten = torch.ops.aten


def optimized(fn, level=1, **config):
    return graphopt.optimize(fn, graphopt.GraphOptimizationConfig(
        graph_opt_level=level, use_cudagraph=False, **config))


def needs_two_rounds(x):
    ones = torch.zeros(8).cos()        # folded in round 1 into a tensor of ones,
    return (x * ones).relu()           # which makes x * ones an identity in round 2


def test_cleanup_runs_to_a_fixed_point_and_reports_each_pass_once(tmp_path):
    opt = optimized(needs_two_rounds, verify=True, debug_dump_dir=str(tmp_path))
    x = torch.randn(3, 8)
    torch.testing.assert_close(opt(x), needs_two_rounds(x))

    (gm,) = opt.graphs()
    assert targets(gm) == [aten.relu.default]
    passes = opt.report().to_dict()["passes"]
    assert [p["name"] for p in passes] == manager.PIPELINES[1]
    by_name = {p["name"]: p for p in passes}
    assert by_name["fold_constants"]["counts"] == {"folded": 1}
    assert by_name["simplify_algebra"]["counts"] == {"identities": 1}
    assert all(set(p) == {"graph", "name", "changed", "counts", "seconds"} for p in passes)
    (folder,) = tmp_path.iterdir()
    step = manager.PIPELINES[1].index("simplify_algebra") + 1
    assert (folder / f"{step:02d}_simplify_algebra_round2.py").exists()


def test_rounds_are_bounded(monkeypatch):
    calls = []

    def always_changes(gm):
        calls.append(1)
        return PassResult(changed=True, counts={"pretended": 1})

    passes = manager.builtin_passes()
    monkeypatch.setattr(manager, "builtin_passes", lambda: {**passes, "always_changes": always_changes})
    monkeypatch.setattr(manager, "CLEANUP", ["dce", "always_changes"])
    monkeypatch.setitem(manager.PIPELINES, 1, ["dce", "always_changes", "recompose_linear"])
    opt = optimized(lambda x: x * 2)
    opt(torch.randn(3))
    assert len(calls) == manager.CLEANUP_ROUNDS
    record = next(p for p in opt.report().passes if p.name == "always_changes")
    assert record.counts == {"pretended": manager.CLEANUP_ROUNDS}


def test_both_levels_run_the_cleanup_passes():
    assert manager.PIPELINES[1][:len(manager.CLEANUP)] == manager.CLEANUP
    assert manager.PIPELINES[2][:len(manager.CLEANUP)] == manager.CLEANUP
    assert manager.PIPELINES[2][len(manager.CLEANUP):] == [*canonical_passes(), *fusion_passes(),
                                                           "store_transposed_weights"]


def test_canonicalization_runs_between_cleanup_and_the_fusions():
    for level in (1, 2):
        pipeline = manager.PIPELINES[level]
        canonical = [pipeline.index(name) for name in canonical_passes()]
        assert pipeline.index("fold_constants") < min(canonical)
        assert max(canonical) < min(pipeline.index(name) for name in fusion_passes())
    fusions = ("recompose_linear", "recompose_matmul")
    assert all(manager.PIPELINES[1].index("fold_constants") < manager.PIPELINES[1].index(f) for f in fusions)


class Projection(torch.nn.Module):
    def __init__(self, outputs: int = 5, inputs: int = 4):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(outputs, inputs))

    def forward(self, x):
        return x @ (self.weight * 0.5).t()


@pytest.mark.skipif(not inductor.inductor_available(), reason="Inductor needs a C++ compiler")
def test_level_2_folds_and_refreshes_inside_inductor():
    model = Projection().eval()
    opt = optimized(model, level=2, freeze_parameters=True)
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        counts = {p.name: p.counts for p in opt.report().passes}
        assert list(counts)[:len(manager.CLEANUP)] == manager.CLEANUP
        assert counts["fold_constants"] == {"folded": 1}

        model.weight.mul_(-2)
        # The folded weight is a constant Inductor's GEMM template packs: refresh() compiles again.
        assert opt.refresh() == 1 and opt.report().repacks == 1
        torch.testing.assert_close(opt(x), model(x))


@pytest.mark.skipif(not inductor.inductor_available(), reason="Inductor needs a C++ compiler")
def test_level_2_takes_inductor_options_and_refresh_repacks_packed_weights(monkeypatch):
    """inductor_compile_config reaches Inductor on top of graphopt's options; with
    the C++ GEMM template packing frozen weights at compile time, refresh() compiles
    the graph again (without Inductor's FX graph cache), so the output follows an in-place
    weight update instead of reading stale packed copies."""
    seen = []
    compile_ = inductor.inductor_compile
    monkeypatch.setattr(inductor, "inductor_compile",
                        lambda gm, inputs, post, uuid, options: seen.append(options) or
                        compile_(gm, inputs, post, uuid, options))
    model = Projection().eval()
    options = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
    opt = optimized(model, level=2, freeze_parameters=True, inductor_compile_config=options, cache_dir=None)
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        assert seen and all(o.items() >= options.items() and o["cpp_wrapper"] for o in seen)
        compiled, graphs = len(seen), opt.graphs()
        model.weight.data.mul_(-2)  # through .data: not noticed, so the call does not refresh by itself
        assert sum(refresh_folded_constants(gm) for gm in graphs) == len(graphs)  # graphopt's own copy only
        assert not torch.allclose(opt(x), model(x))  # Inductor's packed copy: why refresh() compiles again
        opt.refresh()
        torch.testing.assert_close(opt(x), model(x))
    again = seen[compiled:]
    assert len(again) == compiled and all(o["fx_graph_cache"] is False and o.items() >= options.items() for o in again)
    report = opt.report()
    assert report.repacks == compiled and len(opt.graphs()) == len(graphs) and opt.graphs() != graphs
    assert len(report.passes) == len({(p.graph, p.name) for p in report.passes})  # the first compile's records


@pytest.mark.skipif(not inductor.inductor_available(), reason="Inductor needs a C++ compiler")
@pytest.mark.parametrize("asked", [{}, {"max_autotune_gemm": False}], ids=["default", "switched-off"])
def test_level_2_with_frozen_weights_times_each_gemm_and_keeps_the_faster(monkeypatch, asked):
    """On the CPU with freeze_parameters=True, level 2 lets Inductor time each GEMM with
    its C++ template (packed weights) and with ATen's, and keep the faster; the report
    lists each choice with its times. The user's inductor_compile_config can switch it off."""
    seen = []
    compile_ = inductor.inductor_compile
    monkeypatch.setattr(inductor, "inductor_compile",
                        lambda gm, inputs, post, uuid, options: seen.append(options) or
                        compile_(gm, inputs, post, uuid, options))
    model = Projection(96, 64).eval()  # a weight folded into a constant, which the C++ template packs
    opt = optimized(model, level=2, freeze_parameters=True, inductor_compile_config=asked, cache_dir=None)
    x = torch.randn(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    tuned = not asked
    assert seen and all(o.get("max_autotune_gemm", False) == tuned for o in seen)
    gemms = {k: v for g in opt.report().graphs for k, v in g.gemms.items()}
    if tuned:
        assert gemms and all(v.split(" ")[0] in ("ATen", "C++") and " us" in v for v in gemms.values()), gemms
        assert "\n    GEMM mm " in str(opt.report()), str(opt.report())
    else:
        assert gemms == {}
