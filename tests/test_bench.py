"""`graphopt bench`: a --quick run through the command line, and the pure parts
(ratios, the GEMM floor, output checks, tables). No timing is asserted."""

import contextlib
import io
import json
import math

import pytest
import torch

from graphopt.bench import measure, output
from graphopt.bench.measure import CaseResult, Row, compare, fill_ratios, gemm_floor
from graphopt.bench.startup import measure_startup
from graphopt.bench.workloads import Sizes, decoder
from graphopt.cli import main

# Level 2 compiles with Inductor (10-20 s a graph on a small CPU), too slow for the
# smoke run; every other contender runs.
SMOKE_CONTENDERS = ["eager", "torch.compile", "graphopt L0", "graphopt L0 + host graphs", "graphopt L1",
                    "graphopt L1 + host graphs", "ONNX Runtime"]


README = "# A project\n\n## Measured\n\n<!-- graphopt bench: start -->\nold tables\n<!-- graphopt bench: end -->\n\n## Layout\n"
SMOKE = ["bench", "--quick", "--workloads", "resnet", "--contenders",
         "eager,compile,L0,L0+graphs,L1,L1+graphs,onnxruntime", "--threads", "1", "--markdown", "--no-startup"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """A --quick run of the resnet workload, as Markdown and into a README:
    (exit code, stdout, stderr, JSON, the README after)."""
    out = tmp_path_factory.mktemp("bench")
    readme = out / "README.md"
    readme.write_text(README)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([*SMOKE, "--out", str(out), "--readme", str(readme)])
    return (code, stdout.getvalue(), stderr.getvalue(), json.loads((out / "bench.json").read_text()),
            readme.read_text())


def test_quick_run_has_a_row_per_contender_with_outputs_equal_to_eager(smoke):
    code, stdout, stderr, _, _ = smoke
    assert code == 0
    rows = {cells[1]: cells for cells in (line.strip("|").split(" | ") for line in stdout.splitlines()
                                          if line.startswith("| "))}
    onnx_left_out = "ONNX Runtime left out:" in stderr  # without onnxruntime installed: one line says so
    expected = [name for name in SMOKE_CONTENDERS if not (name == "ONNX Runtime" and onnx_left_out)]
    for name in expected:
        assert name.strip() in {key.strip() for key in rows}, f"no row for {name}"
    for key, cells in rows.items():
        if key.strip() in expected:
            assert "yes" in [c.strip() for c in cells], f"{key} outputs not marked equal: {cells}"
    assert "NO (" not in stdout


def test_readme_section_is_replaced_by_the_tables_and_the_command(smoke):
    _, stdout, _, _, readme = smoke
    before, _, rest = readme.partition("<!-- graphopt bench: start -->\n")
    section, _, after = rest.partition("<!-- graphopt bench: end -->")
    assert before == "# A project\n\n## Measured\n\n" and after == "\n\n## Layout\n"
    assert "old tables" not in section
    assert section.startswith("_Written by `graphopt bench --quick --workloads resnet")
    tables = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert tables and all(line in section.splitlines() for line in tables)


def test_readme_without_the_markers_is_refused_before_anything_runs(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# no section\n")
    assert main([*SMOKE, "--out", str(tmp_path), "--readme", str(readme)]) == 2
    assert "has no measured section: add a line '<!-- graphopt bench: start -->'" in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


def test_quick_run_writes_every_figure_to_json(smoke):
    _, _, _, figures, _ = smoke
    assert {"setup", "workloads"} <= figures.keys()
    assert {"device", "torch", "threads", "rounds", "tolerance", "quick"} <= figures["setup"].keys()
    resnet = figures["workloads"]["resnet"]
    assert {"title", "cases", "startup", "skipped"} <= resnet.keys()
    case = resnet["cases"][0]
    assert {"case", "unit", "items_per_run", "floor_us", "best_competitor", "rows"} <= case.keys()
    names = [row["contender"] for row in case["rows"]]
    assert names[0] == "eager" and "graphopt L1 + host graphs" in names
    for row in case["rows"]:
        assert {"median_us", "best_us", "times_us", "vs_eager", "vs_best_competitor", "outputs_equal",
                "max_abs_diff", "note", "warmup_s"} <= row.keys()
        assert len(row["times_us"]) == 2 and row["outputs_equal"]
    by_name = {row["contender"]: row for row in case["rows"]}
    assert "replays" in by_name["graphopt L1 + host graphs"]["note"]


def _row(name, median, competitor=True, equal=True):
    return Row(name, competitor, [median, median * 2, median / 2], equal, 0.0)


def test_ratios_are_against_eager_the_fastest_matching_competitor_and_the_floor():
    result = CaseResult("step", "tokens", 1, [
        _row("eager", 100.0), _row("torch.compile", 50.0),
        _row("wrong and fast", 10.0, equal=False),           # a wrong answer sets no bar
        _row("graphopt L1", 40.0, competitor=False)], floor_us=20.0)
    fill_ratios(result)
    rows = {row.contender: row for row in result.rows}
    assert result.best_competitor == "torch.compile"
    assert rows["graphopt L1"].vs_eager == pytest.approx(2.5)
    assert rows["graphopt L1"].vs_competitor == pytest.approx(1.25)
    assert rows["graphopt L1"].vs_floor == pytest.approx(2.0)
    assert rows["eager"].vs_competitor == pytest.approx(0.5)
    assert rows["wrong and fast"].vs_eager == pytest.approx(10.0)


def test_compare_allows_rounding_but_not_wrong_values_shapes_or_tokens():
    x = torch.randn(4, 8)
    assert compare([x + 1e-6], [x]) == (True, pytest.approx(1e-6, rel=0.1))
    equal, diff = compare([x + 0.5], [x])
    assert not equal and diff == pytest.approx(0.5)
    assert compare(x[:2], x) == (False, math.inf)
    tokens = torch.tensor([[3, 4]])
    assert not compare(tokens + 1, tokens)[0]          # integer outputs must be equal
    assert compare(x.bfloat16() * 1.02, x.bfloat16())[0]  # bfloat16 tolerance


def test_decode_step_floor_is_its_linears_on_cpu_and_weight_bytes_over_bandwidth_on_cuda(monkeypatch):
    workload = decoder(Sizes(quick=True, device="cpu"))
    step_case = next(c for c in workload.cases if c.name == "decode step, batch 16")
    linears = [m for m in workload.model.modules() if isinstance(m, torch.nn.Linear)]
    floor, floor_us, how = gemm_floor(step_case, "cpu")
    assert floor_us is None and f"{len(linears)} linears" in how
    floor()  # runs every GEMM once

    monkeypatch.setattr(measure, "hbm_bandwidth", lambda device: 1e9)  # 1 GB/s
    _, floor_us, how = gemm_floor(step_case, "cuda")
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    assert floor_us == pytest.approx(weight_bytes / 1e9 * 1e6)
    stream_case = workload.cases[0]
    assert gemm_floor(stream_case, "cpu") == (None, None, "")


def test_tables_show_a_floor_row_mark_mismatches_and_render_as_markdown():
    result = CaseResult("decode step, batch 1", "tokens", 1,
                        [_row("eager", 100.0), _row("graphopt L1", 50.0, competitor=False, equal=False)],
                        floor_us=25.0, floor_how="the step's 2 linears alone")
    result.rows[1].max_diff = 0.25
    fill_ratios(result)
    headers, rows, mismatched = output.result_cells([result])
    assert "vs GEMM floor" in headers
    assert [r[1] for r in rows] == ["eager", "graphopt L1", "GEMM floor"]
    assert mismatched == [False, True, False]
    assert rows[1][headers.index("outputs = eager")] == "NO (max |diff| 0.25)"
    assert rows[1][headers.index("vs eager")] == "2.00x"
    assert rows[1][headers.index("vs GEMM floor")] == "2.00x"
    text = output.markdown("decoder", "cpu", ["a", "b|c"], [["1", "x|y"]])
    assert text == "**decoder**\n\n| a | b\\|c |\n| --- | --- |\n| 1 | x\\|y |\n\n_cpu_"


def test_durations_keep_a_readable_unit():
    assert [output.duration(us) for us in (812.4, 12_345.0, 23_456_789.0)] == ["812 µs", "12.3 ms", "23.46 s"]


def test_startup_runs_the_command_cold_then_warm_in_fresh_processes():
    found = measure_startup("resnet", "eager", quick=True, device="cpu", threads=1)
    assert found.keys() == {"cold_s", "warm_s", "peak_mib"}, found
    assert found["cold_s"] > 0 and found["warm_s"] > 0 and found["peak_mib"] > 10


@pytest.mark.parametrize("args, message", [
    (["--workloads", "decoder,gpt"], "unknown 'gpt'; choose from decoder, hf-llama, resnet, bert"),
    (["--contenders", "L3"], "unknown 'L3'"),
])
def test_unknown_names_are_usage_errors_that_list_the_choices(args, message, capsys):
    with pytest.raises(SystemExit):
        main(["bench", *args])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_cuda_without_a_gpu_says_so(capsys):
    assert main(["bench", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.slow
def test_level_2_rows_say_host_graphs_fall_back_on_cpu(tmp_path, capsys):
    assert main(["bench", "--quick", "--workloads", "resnet", "--contenders", "eager,L2,L2+graphs",
                 "--threads", "1", "--out", str(tmp_path), "--no-startup"]) == 0
    figures = json.loads((tmp_path / "bench.json").read_text())
    rows = {row["contender"]: row for row in figures["workloads"]["resnet"]["cases"][0]["rows"]}
    assert rows["graphopt L2"]["outputs_equal"] and rows["graphopt L2 + host graphs"]["outputs_equal"]
    assert rows["graphopt L2 + host graphs"]["note"].startswith("fallback (")
    assert "use_cudagraph with graph_opt_level=2 on CPU" in rows["graphopt L2 + host graphs"]["note"]
    assert "fallback" in capsys.readouterr().out
