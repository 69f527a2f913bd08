import re

import pytest
import torch
from support import decode_inputs

import graphopt
from graphopt import FallbackKind
from graphopt.config import tolerance
from graphopt.models import Decoder, DecoderConfig
from graphopt.passes import checks, manager
from graphopt.passes.base import PassResult

aten = torch.ops.aten


@pytest.fixture
def decoder() -> Decoder:
    """One layer: what these tests read (the pipeline, its dumps, a pass undone or named)
    is in every layer alike, and each layer adds its share to every compile."""
    torch.manual_seed(0)
    return Decoder(DecoderConfig.tiny(num_layers=1)).eval()


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


@pytest.mark.fresh_cache
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


def leave_a_constant(gm):
    """What a folding pass leaves besides the graph: a buffer and its refresh recipe."""
    gm.register_buffer("_folded_99", torch.zeros(1), persistent=False)
    gm.meta.setdefault("graphopt_folded_recipes", {})["_folded_99"] = None


def read_before_defined(gm):
    """A broken pass: it moves the graph's last op before everything it reads."""
    leave_a_constant(gm)
    last = gm.graph.output_node().prev
    gm.graph.find_nodes(op="placeholder")[0].prepend(last)
    return PassResult(changed=True, counts={"moved": 1})


LITERAL = torch.ones(())


def tensor_literal(gm):
    """A broken pass: a `cat` takes a tensor literal among the nodes of its list."""
    leave_a_constant(gm)
    cat = next(n for n in gm.graph.nodes if n.target is aten.cat.default)
    cat.args = ([LITERAL, *cat.args[0][1:]], *cat.args[1:])
    return PassResult(changed=True, counts={"replaced": 1})


def with_broken_pass(monkeypatch, name, fn):
    passes = manager.builtin_passes()
    pipeline = ["dce", "remove_noops", "recompose_linear", "reinplace_input_mutations"]
    monkeypatch.setattr(manager, "builtin_passes", lambda: {**passes, name: fn})
    monkeypatch.setitem(manager.PIPELINES, 1, [*pipeline[:2], name, *pipeline[2:]])
    return pipeline


@pytest.mark.parametrize("broken, problem", [
    pytest.param(read_before_defined, r"was used before it has been defined", id="read_before_defined"),
    pytest.param(tensor_literal, r"node 'cat\w*' takes a tensor of shape \(\) as a literal argument",
                 id="tensor_literal"),
])
@pytest.mark.fresh_cache
def test_a_pass_that_leaves_an_invalid_graph_is_undone(decoder, monkeypatch, broken, problem):
    name = broken.__name__
    pipeline = with_broken_pass(monkeypatch, name, broken)
    opt, out = run_decode(decoder, config())
    with torch.inference_mode():
        expected = decoder(*decode_inputs(3))
    atol, rtol = tolerance(expected.dtype)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)

    assert opt.report().fallback_counts == {FallbackKind.PASS_UNDONE: 1}
    (reason,) = opt.report().fallbacks  # the message users read: it names the fix
    assert re.fullmatch(rf"pass '{name}' left an invalid graph \(.*{problem}.*\); it was undone for this "
                        rf"graph\. Disable it with disabled_passes=\['{name}'\] and report the graph "
                        r"\(debug_dump_dir\)\.", reason)
    record = next(p for p in opt.report().passes if p.name == name)
    assert not record.changed and record.counts == {}

    # Undone exactly: the graph is the one the pipeline without the broken pass gives,
    # node names included, without the buffer and recipe the pass added.
    (gm,) = opt.graphs()
    assert not hasattr(gm, "_folded_99")
    assert "_folded_99" not in gm.meta.get("graphopt_folded_recipes", {})
    torch._dynamo.reset()
    monkeypatch.setitem(manager.PIPELINES, 1, pipeline)
    reference, _ = run_decode(decoder, config())
    (expected_gm,) = reference.graphs()
    assert [(n.name, n.op, n.target) for n in gm.graph.nodes] == \
        [(n.name, n.op, n.target) for n in expected_gm.graph.nodes]


def test_with_verify_an_invalid_graph_is_an_error(decoder, monkeypatch):
    with_broken_pass(monkeypatch, "read_before_defined", read_before_defined)
    with pytest.raises(Exception, match=r"PassVerificationError: pass 'read_before_defined' left an invalid "
                                        r"graph: .*used before it has been defined.*"
                                        r"disabled_passes=\['read_before_defined'\]"):
        run_decode(decoder, config(verify=True))


def relu_step(x):
    return torch.relu(x) + 1


def run_pipeline(monkeypatch, *passes):
    """`passes` as the level-1 pipeline, run by a PassManager on relu_step's graph."""
    monkeypatch.setattr(manager, "builtin_passes", lambda: {fn.__name__: fn for fn in passes})
    monkeypatch.setitem(manager.PIPELINES, 1, [fn.__name__ for fn in passes])
    gm = torch.fx.symbolic_trace(relu_step)
    recompiles = []
    recompile = type(gm).recompile
    monkeypatch.setattr(type(gm), "recompile", lambda self: recompiles.append(1) or recompile(self))
    manager.PassManager(config(), graphopt.Report(level=1)).run(gm, 0)
    return gm, len(recompiles)


def unchanged(name):
    """A pass called `name` that leaves the graph as it is."""
    def run(gm):
        return PassResult(changed=False)
    run.__name__ = name
    return run


def test_passes_that_change_nothing_share_one_copy_of_the_graph_and_one_compile(monkeypatch):
    snapshots = []
    init = checks.Snapshot.__init__
    monkeypatch.setattr(checks.Snapshot, "__init__", lambda self, *a: init(self, *a) or snapshots.append(self))

    def relu_to_sigmoid(gm):
        next(n for n in gm.graph.nodes if n.target is torch.relu).target = torch.sigmoid
        return PassResult(changed=True)

    gm, recompiles = run_pipeline(monkeypatch, unchanged("first"), unchanged("second"), relu_to_sigmoid,
                                  unchanged("after"))
    copies = {id(snapshot.metas) for snapshot in snapshots}
    assert len(snapshots) == 4 and len(copies) == 2, "one copy before the change, one after it"
    assert recompiles == 2, "compiled at the first pass and after the change"
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), torch.sigmoid(x) + 1)


def test_a_pass_that_recompiled_then_put_the_graph_back_is_compiled_again(monkeypatch):
    def sneaky(gm):
        node = next(n for n in gm.graph.nodes if n.target is torch.relu)
        node.target = torch.sigmoid
        gm.recompile()
        node.target = torch.relu  # back as it was, but the code is sigmoid's
        return PassResult(changed=False)

    gm, _ = run_pipeline(monkeypatch, unchanged("first"), sneaky)
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), torch.relu(x) + 1)
