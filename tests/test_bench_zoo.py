"""`graphopt bench --workloads zoo`: timm and transformers models with random
weights through the bench's machinery, the zoo's table, and how --workloads,
--models and --contenders pick them. No timing is asserted."""

import sys

import pytest
from rich.console import Console

from graphopt.bench import OPT_IN, Options, output, run, zoo
from graphopt.bench.suite import WorkloadResult
from graphopt.cli import main as cli
from graphopt.report import GraphRecord, Report


def _timm_or_skip() -> None:
    try:
        zoo.import_timm()
    except zoo.ZooUnavailable as why:
        pytest.skip(f"timm cannot be imported here: {why}")


@pytest.fixture(scope="module")
def zoo_run() -> list[WorkloadResult]:
    """A --quick run of one transformers and one timm model by eager and graphopt's defaults
    (torch.compile's rows would add a minute of Inductor compiles)."""
    models = ["zoo-bert"]
    try:
        zoo.import_timm()
        models.append("zoo-mobilenetv3")
    except zoo.ZooUnavailable:
        pass  # the timm test skips with the reason
    options = Options(models, ["eager", "default"], quick=True, rounds=1, startup=False)
    return run(options, Console(quiet=True))


def test_a_transformers_model_runs_with_outputs_equal_to_eager_and_says_what_graphopt_chose(zoo_run):
    bert = next(r for r in zoo_run if r.name == "zoo-bert")
    assert bert.title.startswith("transformers BertModel (random weights)")
    assert not bert.skipped
    rows = {row.contender: row for row in bert.cases[0].rows}
    assert set(rows) == {"eager", "graphopt default"}
    assert all(row.outputs_equal for row in rows.values())
    assert rows["eager"].choice == ""
    # The defaults are level "auto": each graph names the level it chose.
    assert rows["graphopt default"].choice.startswith("auto; g0 (level "), rows["graphopt default"].choice
    # BERT's attention fuses at either level (its norms are fused ops at level 1 only:
    # at level 2 Inductor generates them)
    assert "scaled_dot_product_attention" in rows["graphopt default"].choice


def test_a_timm_model_runs_with_outputs_equal_to_eager(zoo_run):
    _timm_or_skip()
    mobilenet = next(r for r in zoo_run if r.name == "zoo-mobilenetv3")
    assert mobilenet.title.startswith("timm mobilenetv3_small_050 (random weights)")
    rows = mobilenet.cases[0].rows
    assert [row.contender for row in rows] == ["eager", "graphopt default"]
    assert all(row.outputs_equal for row in rows)


def test_zoo_table_has_a_row_per_model_and_case_with_medians_ratios_and_the_choice(zoo_run):
    table = output.zoo_cells(zoo_run)
    assert table.headers == ["model", "case", "eager", "graphopt default", "graphopt default vs torch.compile",
                             "graphopt chose"]
    assert [cells[:2] for cells in table.rows][0] == ["bert", "batch 2"]
    assert len(table.rows) == sum(len(r.cases) for r in zoo_run)
    assert all(cells[4] == "-" for cells in table.rows)  # no torch.compile row to compare with
    assert all(cells[5].startswith("auto; g0 (level ") for cells in table.rows)
    assert table.mismatched == [False] * len(table.rows)


def test_zoo_table_compares_each_graphopt_row_with_torch_compile():
    from graphopt.bench.measure import CaseResult, Row

    case = CaseResult("batch 1", "images", 1, rows=[
        Row("eager", True, [300.0] * 3, True, 0.0), Row("torch.compile", True, [200.0] * 3, True, 0.0),
        Row("graphopt default", False, [250.0] * 3, True, 0.0, choice="L1; g0: no fusion"),
        Row("graphopt L2", False, [100.0, 100.0, 150.0], True, 0.0, choice="L2; g0: no fusion")])
    table = output.zoo_cells([WorkloadResult("zoo-resnet50", "timm resnet50", [case])])
    assert table.headers[-3:] == ["graphopt default vs torch.compile", "graphopt L2 vs torch.compile",
                                  "graphopt chose"]
    assert table.rows == [["resnet50", "batch 1", "300 µs", "200 µs", "250 µs", "100 µs", "0.80x", "2.00x*",
                           "L1; g0: no fusion"]]


def test_zoo_table_shows_what_level_auto_chose_where_it_ran():
    from graphopt.bench.measure import CaseResult, Row

    case = CaseResult("batch 1", "images", 1, rows=[
        Row("eager", True, [300.0] * 3, True, 0.0),
        Row("graphopt default", False, [250.0] * 3, True, 0.0, choice="L1; g0: no fusion"),
        Row("graphopt auto", False, [150.0] * 3, True, 0.0, choice="auto; g0 (level 2 chosen): no fusion")])
    table = output.zoo_cells([WorkloadResult("zoo-resnet50", "timm resnet50", [case])])
    assert table.rows[0][-1] == "auto; g0 (level 2 chosen): no fusion"


def test_choice_names_the_level_and_each_graphs_fused_ops():
    report = Report(level=1, graphs=[GraphRecord(0, fused_ops={"rms_norm": 9, "attention": 4}), GraphRecord(1)])
    assert zoo.chosen(report) == "L1; g0: attention x4, rms_norm x9; g1: no fusion"
    assert zoo.chosen(Report(level=2)) == "L2; no graph compiled"
    # Two Dynamo graphs under "auto": the first compiled at both levels (records 0 and 1),
    # the second's level loaded from the compile cache (record 2); only chosen levels show.
    auto = Report(level="auto", graphs=[GraphRecord(0, level=1, fused_ops={"rms_norm": 2}),
                                        GraphRecord(1, level=2, fused_ops={"attention": 4}), GraphRecord(2, level=1)],
                  level_choices=[{"graph": 0, "level": 2}, {"graph": 2, "level": 1, "cached": True}])
    assert zoo.chosen(auto) == "auto; g0 (level 2 chosen): attention x4; g2 (level 1 chosen): no fusion"


def test_zoo_and_models_expand_to_the_zoos_workloads_and_contenders():
    assert zoo.expand(["zoo"], None) == [f"zoo-{m}" for m in zoo.MODELS]
    assert zoo.expand(["zoo"], ["vit", "bert"]) == ["zoo-vit", "zoo-bert"]
    assert zoo.expand(["resnet"], ["bert"]) == ["resnet", "zoo-bert"]
    assert cli._workloads(None, False, ["llama"]) == ["zoo-llama"]
    assert cli._contenders(None, ["zoo-llama"]) == zoo.CONTENDERS == ["eager", "compile", "compile-max", "default",
                                                                       "L1+graphs", "L2"]
    usual = cli._contenders(None, ["resnet", "zoo-llama"])
    assert "compile" in usual and not set(OPT_IN) & set(usual)
    assert cli._contenders(["eager"], ["zoo-llama"]) == ["eager"]
    assert cli._contenders(["auto", "compile"], ["zoo-llama"]) == ["eager", "auto", "compile"]  # the reference


def test_unknown_model_is_a_usage_error_listing_the_zoo(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--models", "resnet50,alexnet"])
    assert exit_.value.code == 2
    assert "unknown 'alexnet'; choose from mobilenetv3, efficientnet_b0, resnet50" in capsys.readouterr().err


def test_without_transformers_the_model_is_left_out_with_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    result, = run(Options(["zoo-gpt2"], ["eager"], quick=True, rounds=1, startup=False), Console(quiet=True))
    assert result.cases == []
    assert result.skipped == {"every contender": "transformers is not installed (pip install 'graphopt[zoo]')"}


def test_timm_imports_beside_a_torchvision_whose_ops_do_not_load():
    _timm_or_skip()
    import torch
    import torchvision.extension

    if torchvision.extension._has_ops():
        pytest.skip("this torchvision's C++ ops load: there is nothing to work around")
    assert hasattr(torch.ops.torchvision, "nms")  # the schema import_timm defined; no kernel behind it
    with pytest.raises(RuntimeError, match="Couldn't load custom C\\+\\+ ops"):
        torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
