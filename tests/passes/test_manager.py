import pytest
import torch

import graphopt
from graphopt.passes import manager
from graphopt.passes.base import PassResult
from support import decode_inputs

aten = torch.ops.aten


def config(**kw):
    return graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False, **kw)


def run_decode(decoder, cfg, batch=3):
    opt = graphopt.optimize(decoder, cfg)
    with torch.inference_mode():
        out = opt(*decode_inputs(batch))
    return opt, out


def test_level_pipelines_run_in_order_and_are_reported(decoder):
    opt, _ = run_decode(decoder, config())
    names = [p["name"] for p in opt.report().to_dict()["passes"]]
    assert names == manager.PIPELINES[1]
    for record in opt.report().to_dict()["passes"]:
        assert set(record) >= {"name", "changed", "counts"}


def test_disabled_passes(decoder):
    opt, _ = run_decode(decoder, config(disabled_passes=["recompose_linear", "dce"]))
    names = [p["name"] for p in opt.report().to_dict()["passes"]]
    assert "recompose_linear" not in names and "dce" not in names and "remove_noops" in names

    torch._dynamo.reset()
    opt, _ = run_decode(decoder, config(disabled_passes=["*"]))
    assert opt.report().passes == []
    assert aten.copy_.default in [n.target for n in opt.graphs()[0].graph.nodes]


def test_unknown_pass_name_is_an_error(decoder):
    with pytest.raises(ValueError, match=r"unknown pass\(es\) \['fuse_everything'\].*known passes"):
        graphopt.optimize(decoder, config(disabled_passes=["fuse_everything"]))


def test_dump_files_before_and_after_every_pass(decoder, tmp_path):
    run_decode(decoder, config(debug_dump_dir=str(tmp_path)))
    (graph_dir,) = tmp_path.iterdir()
    names = sorted(p.name for p in graph_dir.iterdir())
    expected_stems = ["00_input"] + [f"{i:02d}_{n}" for i, n in enumerate(manager.PIPELINES[1], start=1)]
    assert names == sorted(f"{s}{ext}" for s in expected_stems for ext in (".py", ".txt"))
    assert "torch.ops.aten.copy_.default" in (graph_dir / "00_input.py").read_text()
    final = (graph_dir / f"{expected_stems[-1]}.py").read_text()
    assert "index_put_" in final and "copy_" not in final
    table = (graph_dir / "00_input.txt").read_text().splitlines()
    assert table[0].split() == ["name", "op", "target", "value", "users"]
    assert any("placeholder" in row for row in table)


@pytest.mark.parametrize("variable", ["GRAPHOPT_DEBUG", "TORCH_COMPILE_DEBUG"])
def test_dumps_switched_on_by_environment(decoder, tmp_path, monkeypatch, variable):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(variable, "1")
    with torch._dynamo.config.patch(debug_dir_root=str(tmp_path / "torch_compile_debug")):
        run_decode(decoder, config())
    dumped = list((tmp_path / "graphopt_debug").glob("graph_*/00_input.py"))
    assert len(dumped) == 1


def break_the_graph(gm):
    """A deliberately wrong pass: every multiplication becomes an addition."""
    for node in gm.graph.nodes:
        if node.target is aten.mul.Tensor:
            node.target = aten.add.Tensor
    return PassResult(changed=True)


def test_verify_names_the_pass_that_changed_the_results(decoder, monkeypatch):
    passes = manager.builtin_passes()
    monkeypatch.setattr(manager, "builtin_passes", lambda: {**passes, "break_the_graph": break_the_graph})
    monkeypatch.setitem(manager.PIPELINES, 1, ["dce", "remove_noops", "break_the_graph", "recompose_linear"])
    # Dynamo wraps a backend's exception in BackendCompilerFailed, keeping its text.
    with pytest.raises(Exception, match=r"PassVerificationError: pass 'break_the_graph' changed the "
                                        r"graph's results: value 0 differs.*"
                                        r"disabled_passes=\['break_the_graph'\]"):
        run_decode(decoder, config(verify=True))


def test_verify_passes_for_the_builtin_pipeline(decoder):
    opt, out = run_decode(decoder, config(verify=True))
    assert "verify skipped" not in str(opt.report())
    assert len(opt.report().passes) == len(manager.PIPELINES[1])
