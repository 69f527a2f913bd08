"""`graphopt bench`: a --quick run through the command line, and the pure parts
(ratios, the GEMM floor, output checks, tables). No timing is asserted."""

import contextlib
import io
import json
import math
import re
import sys

import pytest
import torch
from rich.console import Console

from graphopt.bench import measure, output
from graphopt.bench.measure import CaseResult, Row, compare, fill_ratios, gemm_floor
from graphopt.bench.startup import measure_startup
from graphopt.bench.workloads import Sizes, decoder
from graphopt.cli.main import main

# Level 2 compiles with Inductor (10-20 s a graph on a small CPU), too slow for the
# smoke run; every other contender runs.
SMOKE_CONTENDERS = ["eager", "torch.compile", "graphopt L0", "graphopt L0 + host graphs", "graphopt L1",
                    "graphopt L1 + host graphs", "ONNX Runtime", "OpenVINO"]
# Installed with graphopt[bench]; without it the run says so in one line instead of a row.
OPTIONAL = ["ONNX Runtime", "OpenVINO"]


PAGE = "# Benchmarks\n\nHow.\n\n<!-- graphopt bench: start -->\nold tables\n<!-- graphopt bench: end -->\n\n## After\n"
SMOKE = ["bench", "--quick", "--workloads", "resnet", "--contenders",
         "eager,compile,L0,L0+graphs,L1,L1+graphs,onnxruntime,openvino", "--threads", "1", "--markdown",
         "--wide", "--no-startup"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """A --quick run of the resnet workload, as wide Markdown and into a docs page:
    (exit code, stdout, stderr, JSON, the page after)."""
    out = tmp_path_factory.mktemp("bench")
    page = out / "benchmarks.md"
    page.write_text(PAGE)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([*SMOKE, "--out", str(out), "--docs", str(page)])
    return (code, stdout.getvalue(), stderr.getvalue(), json.loads((out / "bench.json").read_text()),
            page.read_text())


def test_quick_run_has_a_row_per_contender_with_outputs_equal_to_eager(smoke):
    code, stdout, stderr, _, _ = smoke
    assert code == 0
    rows = {cells[1]: cells for cells in (line.strip("|").split(" | ") for line in stdout.splitlines()
                                          if line.startswith("| "))}
    left_out = {name for name in OPTIONAL
                if re.search(rf"resnet: {name} left out: \w+ is not installed \(pip install 'graphopt\[bench\]'\)",
                             stderr)}
    # OpenVINO's torch.compile backend fails on some torches (2.13: "sources must not be
    # empty for symbol s7"): reported in one line, with the error, instead of a row.
    if re.search(r"resnet: OpenVINO left out: failed on batch \d+: \w+", stderr):
        left_out.add("OpenVINO")
    expected = [name for name in SMOKE_CONTENDERS if name not in left_out]
    for name in expected:
        assert name.strip() in {key.strip() for key in rows}, f"no row for {name}"
    for key, cells in rows.items():
        if key.strip() in expected:
            assert "yes" in [c.strip() for c in cells], f"{key} outputs not marked equal: {cells}"
    assert "NO (" not in stdout


def test_docs_section_is_replaced_by_the_tables_and_the_command(smoke):
    _, stdout, _, _, page = smoke
    before, _, rest = page.partition("<!-- graphopt bench: start -->\n")
    section, _, after = rest.partition("<!-- graphopt bench: end -->")
    assert before == "# Benchmarks\n\nHow.\n\n" and after == "\n\n## After\n"
    assert "old tables" not in section
    assert section.startswith("_Written by `graphopt bench --quick --workloads resnet")
    tables = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert tables and all(line in section.splitlines() for line in tables)


def test_docs_page_without_the_markers_is_refused_before_anything_runs(tmp_path, capsys):
    page = tmp_path / "benchmarks.md"
    page.write_text("# no section\n")
    assert main([*SMOKE, "--out", str(tmp_path), "--docs", str(page)]) == 2
    assert "has no measured section: add a line '<!-- graphopt bench: start -->'" in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


def test_docs_without_a_file_writes_the_benchmarks_page(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)  # no docs/benchmarks.md here: refused, naming the default page
    assert main(["bench", "--docs"]) == 2
    assert "--docs docs/benchmarks.md:" in capsys.readouterr().err


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
    assert by_name["graphopt L1 + host graphs"]["reasons"] == []


def _row(name, median, competitor=True, equal=True, note="", reasons=(), spread=0.05):
    """A row whose rounds stray `spread` (a share of the median) either side of it."""
    return Row(name, competitor, [median, median * (1 + spread), median * (1 - spread)], equal, 0.0, note,
               list(reasons))


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


def test_a_row_whose_rounds_spread_past_ten_percent_is_marked_noisy_not_given_a_ratio():
    result = CaseResult("step", "tokens", 1, [
        _row("eager", 100.0), _row("torch.compile", 50.0, spread=0.25),
        _row("graphopt L1", 40.0, competitor=False), _row("graphopt L2", 30.0, competitor=False, spread=0.09)])
    fill_ratios(result)
    table = output.result_cells([result])
    cells = {row[1]: dict(zip(table.headers, row)) for row in table.rows}
    assert cells["torch.compile"]["vs eager"] == "noisy" and cells["torch.compile"]["note"] == "noisy: rounds ±25%"
    # Compared with a noisy row (the best competitor), a steady row's ratio is noisy too.
    assert cells["graphopt L1"]["vs eager"] == "2.50x" and cells["graphopt L1"]["vs best competitor"] == "noisy"
    assert cells["graphopt L2"]["vs eager"] == "3.33x" and cells["graphopt L2"]["note"] == ""
    # Five rounds or more: the fastest and the slowest are set aside, so one preempted round is not noise.
    assert measure.spread([100, 101, 99, 100, 300]) == pytest.approx(0.01)
    assert measure.spread([100, 115, 99, 100, 300, 60]) == pytest.approx(0.15)
    [record] = json.loads(output.to_json({}, {"w": {"cases": [result]}}))["workloads"]["w"]["cases"]
    assert [r["noisy"] for r in record["rows"]] == [False, True, False, False]


def test_compare_allows_rounding_but_not_wrong_values_shapes_or_tokens():
    x = torch.randn(4, 8)
    assert compare([x + 1e-6], [x]) == (True, pytest.approx(1e-6, rel=0.1))
    equal, diff = compare([x + 0.5], [x])
    assert not equal and diff == pytest.approx(0.5)
    assert compare(x[:2], x) == (False, math.inf)
    tokens = torch.tensor([[3, 4]])
    assert not compare(tokens + 1, tokens)[0]          # integer outputs must be equal
    assert compare(x.bfloat16() * 1.02, x.bfloat16())[0]  # bfloat16 tolerance


def test_half_precision_outputs_are_judged_against_a_float32_run():
    """Deep bfloat16 models round differently step by step: a contender as far from
    the float32 run as eager is passes though it differs from eager by more than any
    fixed tolerance; one twice as far and more fails."""
    generator = torch.Generator().manual_seed(0)
    truth = torch.randn(256, generator=generator) * 4
    noise = torch.randn(256, generator=generator).abs() * 0.2
    eager, other_rounding = (truth + noise).bfloat16(), (truth - noise).bfloat16()
    assert not compare(other_rounding, eager)[0]  # 0.4 apart: beyond bfloat16's fixed tolerance
    assert compare(other_rounding, eager, truth)[0]
    assert not compare((truth + 3 * noise.max()).bfloat16(), eager, truth)[0]


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
    table = output.result_cells([result], wide=True)
    headers, rows = table.headers, table.rows
    assert "vs GEMM floor" in headers
    assert [r[1] for r in rows] == ["eager", "graphopt L1", "GEMM floor"]
    assert table.mismatched == [False, True, False]
    assert rows[1][headers.index("outputs = eager")] == "NO (max |diff| 0.25)"
    assert rows[1][headers.index("vs eager")] == "2.00x"
    assert rows[1][headers.index("vs GEMM floor")] == "2.00x"
    assert rows[2][headers.index("note")] == "[1]" and table.notes == ["the step's 2 linears alone"]
    narrow = output.result_cells([result])  # no output-check column: the note says it
    assert narrow.rows[1][narrow.headers.index("note")] == "outputs differ: NO (max |diff| 0.25)"
    text = output.markdown("decoder", "cpu", output.Cells(["a", "b|c"], [["1", "x|y"]], [False], ["why"]))
    assert text == "**decoder**\n\n| a | b\\|c |\n| --- | --- |\n| 1 | x\\|y |\n\n_cpu_\n\n- [1] why"


def _worst_case() -> list[CaseResult]:
    """Every CUDA contender (the longest names) on the decoder's stream case and on a
    decode step with a floor, with long fallback reasons shared between rows."""
    from graphopt.bench.contenders import contenders

    why = ("use_cudagraph with graph_opt_level=2 on CPU: Inductor's C++ kernels bypass the dispatcher and "
           "cannot be recorded on a host graph; the compiled kernels run directly")
    cases = []
    for name, floor in (("stream of batches 13,16,6,1,4,12,4,8 x 4 steps", None), ("decode step, batch 16", 3854.0)):
        rows = [_row(c.name, 12_345.6 + i, c.competitor, note="36 captures, 784 replays, 34 recaptures, partly "
                     "fell back" if c.device_graphs else "", reasons=[why, why + " (2)"] if c.device_graphs else [])
                for i, c in enumerate(contenders("cuda"))]
        result = CaseResult(name, "tokens", 16, rows, floor_us=floor,
                            floor_how="the step's 29 linears alone, one aten mm each" if floor else "")
        fill_ratios(result)
        cases.append(result)
    return cases


def _rendered(table, wide):
    console = Console(width=400, record=True, file=io.StringIO())  # room to spare: the table's own width shows
    console.print(output.rich_table("decoder", "cpu (AMD EPYC) · torch 2.13.0+cpu · 1 thread(s) · median of "
                                    "10 interleaved rounds", table, wide))
    return console.export_text().splitlines()


def test_default_table_fits_120_columns_with_long_notes_numbered_below():
    table = output.result_cells(_worst_case())
    lines = _rendered(table, wide=False)
    assert max(map(len, lines)) <= 120, "\n".join(lines)
    assert table.headers == ["case", "contender", "median", "vs eager", "vs best competitor", "vs GEMM floor",
                             "note"]
    assert len(table.notes) == 3  # each reason once, however many rows share it; the floor's how
    assert output.numbered(table.notes)[0].startswith("[1] use_cudagraph with graph_opt_level=2")
    notes = [row[-1] for row in table.rows]
    assert "36 captures, 784 replays, 34 recaptures, partly fell back [1][2]" in notes and "[3]" in notes
    assert not any("Inductor" in cell for row in table.rows for cell in row)


def test_wide_table_has_every_column():
    table = output.result_cells(_worst_case(), wide=True)
    assert table.headers == ["case", "contender", "median", "best", "throughput", "vs eager",
                             "vs best competitor", "vs GEMM floor", "warm-up", "outputs = eager", "note"]
    assert all(len(row) == len(table.headers) for row in table.rows)
    assert max(map(len, _rendered(table, wide=True))) > 120  # nothing wraps: as wide as its cells


def test_openvino_is_left_out_with_the_reason_when_it_cannot_run(monkeypatch):
    from graphopt.bench.contenders import Unavailable, build, contenders

    openvino = next(c for c in contenders("cpu") if c.key == "openvino")
    workload = decoder(Sizes(quick=True, device="cpu"))
    with pytest.raises(Unavailable, match="CPU here; left out with --device cuda"):
        build(openvino, workload, "cuda")
    monkeypatch.setitem(sys.modules, "openvino", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "openvino.torch", None)
    with pytest.raises(Unavailable, match=r"openvino is not installed \(pip install 'graphopt\[bench\]'\)"):
        build(openvino, workload, "cpu")


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
    assert rows["graphopt L2 + host graphs"]["note"] == "fallback"
    assert "use_cudagraph with graph_opt_level=2 on CPU" in rows["graphopt L2 + host graphs"]["reasons"][0]
    out = capsys.readouterr().out
    assert "fallback [1]" in out and "[1] use_cudagraph with graph_opt_level=2 on CPU" in out


def test_dtype_bfloat16_runs_the_decoder_in_bfloat16(tmp_path, capsys):
    """`--dtype bfloat16`: the workload's weights and title are bfloat16, and every
    contender's outputs still match eager's (within bfloat16's tolerance)."""
    code = main(["bench", "--quick", "--workloads", "decoder", "--contenders", "eager,L1+graphs", "--dtype",
                 "bfloat16", "--threads", "1", "--rounds", "1", "--no-startup", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    figures = json.loads((tmp_path / "bench.json").read_text())
    decoder_run = figures["workloads"]["decoder"]
    assert "torch.bfloat16" in decoder_run["title"]
    rows = [row for case in decoder_run["cases"] for row in case["rows"] if row["contender"] != "GEMM floor"]
    assert {row["contender"] for row in rows} == {"eager", "graphopt L1 + host graphs"}
    assert all(row["outputs_equal"] for row in rows), rows
    assert decoder(Sizes(quick=True, device="cpu", precision="bfloat16")).model.lm_head.weight.dtype == torch.bfloat16


def test_op_classes_by_name():
    from graphopt.bench.profile import op_class

    assert [op_class(n) for n in ("aten::mkldnn_convolution", "mkldnn::_convolution_pointwise", "Conv",
                                  "aten::addmm", "mkldnn::_linear_pointwise", "FusedMatMul", "Gemm",
                                  "aten::native_layer_norm", "SkipLayerNormalization",
                                  "aten::_scaled_dot_product_flash_attention_for_cpu", "Softmax",
                                  "aten::gelu", "Add")] == [
        "conv", "conv", "conv", "GEMM", "GEMM", "GEMM", "GEMM", "norm", "norm", "attention", "attention",
        "elementwise", "elementwise"]


def test_a_torch_profile_splits_one_run_by_class():
    from graphopt.bench.profile import OP_CLASSES, torch_profile

    x, w = torch.randn(64, 64), torch.randn(64, 64)
    shares = torch_profile(lambda: torch.nn.functional.layer_norm(torch.relu(x @ w), [64]), 3)
    assert set(shares) == {"wall_s", *OP_CLASSES} and shares["wall_s"] > 0
    assert shares["GEMM"] > 0 and shares["norm"] > 0 and shares["conv"] == 0
    assert math.isclose(sum(shares[c] for c in OP_CLASSES), 1.0, rel_tol=1e-6)


def test_profile_table_has_a_row_per_contender():
    shares = {"wall_s": 0.002, "conv": 0.5, "GEMM": 0.2, "norm": 0.0, "attention": 0.0, "elementwise": 0.1,
              "outside ops": 0.2}
    table = output.profile_cells({"eager": shares, "ONNX Runtime": shares})
    assert table.headers[:2] == ["contender", "run"] and len(table.rows) == 2
    assert table.rows[0][:3] == ["eager", output.duration(2000), "50 %"]


def test_profile_flag_writes_each_contenders_classes(tmp_path):
    pytest.importorskip("onnxruntime")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["bench", "--quick", "--workloads", "resnet", "--contenders", "eager,L1,onnxruntime",
                     "--profile", "--threads", "1", "--markdown", "--no-startup", "--out", str(tmp_path)])
    assert code == 0
    profiles = json.loads((tmp_path / "bench.json").read_text())["workloads"]["resnet"]["cases"][0]["profiles"]
    assert set(profiles) == {"eager", "graphopt L1", "ONNX Runtime"}
    assert all(p["conv"] > 0 for p in profiles.values())  # every one of them spends time in convolutions
    assert "resnet, batch 4: where the time goes, by op class" in stdout.getvalue()


@pytest.fixture(scope="module")
def serving_run(tmp_path_factory):
    """A --quick run of the serving trace by eager, the default capture list and "auto":
    (exit code, stdout, the serving workload's JSON)."""
    out = tmp_path_factory.mktemp("serving")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        code = main(["bench", "--quick", "--workloads", "serving", "--contenders", "eager,L1+graphs,L1+auto",
                     "--threads", "1", "--rounds", "1", "--markdown", "--no-startup", "--out", str(out)])
    return code, stdout.getvalue(), json.loads((out / "bench.json").read_text())["workloads"]["serving"]


@pytest.mark.parametrize("quiet", ["PADDED_SIZES", "SMALL_SIZES"])
def test_serving_trace_is_seeded_quiet_sizes_with_rare_bursts(quiet):
    from graphopt.bench import serving
    from graphopt.bench.serving import BURST_SIZES, checked, trace

    sizes = getattr(serving, quiet)
    batches = trace(3000, quiet=sizes)
    assert batches == trace(3000, quiet=sizes) and batches != trace(3000, seed=1, quiet=sizes)
    assert len(batches) == 3000
    bursts = [b for b in batches if b not in sizes]
    assert set(batches) - set(bursts) == set(sizes)
    assert bursts and all(BURST_SIZES[0] <= b <= BURST_SIZES[1] for b in bursts) and len(bursts) < 0.05 * 3000
    kept = checked(batches)
    first_of_burst = [i for i, b in enumerate(batches) if b in bursts and (i == 0 or batches[i - 1] != b)]
    assert all(kept[i] for i in first_of_burst) and all(kept[::50])
    assert sum(kept) == len(set(range(0, 3000, 50)) | set(first_of_burst))


def test_serving_workloads_decode_their_own_traces_and_run_only_when_asked():
    from graphopt.bench.serving import BURST_SIZES, PADDED_SIZES, SMALL_SIZES
    from graphopt.bench.workloads import LARGE, WORKLOADS

    for name, quiet in (("serving", PADDED_SIZES), ("serving-small", SMALL_SIZES)):
        workload = WORKLOADS[name](Sizes(quick=True, device="cpu"))
        (case,) = workload.cases
        batches = [ids.shape[0] for ids, *_ in case.inputs]
        assert workload.name == name and name in LARGE
        assert {b for b in batches if b < BURST_SIZES[0]} == set(quiet) and case.items == sum(batches)


def test_serving_auto_sizes_pad_less_than_the_default_list_with_outputs_equal_to_eager(serving_run):
    code, stdout, serving = serving_run
    assert code == 0
    (case,) = serving["cases"]
    rows = {row["contender"]: row for row in case["rows"]}
    assert set(rows) == {"eager", "graphopt L1 + host graphs", "graphopt L1 + host graphs, auto sizes"}
    assert all(row["outputs_equal"] for row in rows.values()), rows
    default, auto = rows["graphopt L1 + host graphs"]["graphs"], rows["graphopt L1 + host graphs, auto sizes"]["graphs"]
    assert rows["eager"]["graphs"] is None
    assert default["steps"] == auto["steps"] == 400  # the checked run is one replay of the whole trace
    # The default list pads 9, 11, 13, 17, 20 and 26 to 16, 16, 16, 24, 24 and 32; "auto"
    # captures the quiet sizes it sees most and leaves the rare bursts without a graph.
    assert auto["padded_rows"] * 2 <= default["padded_rows"]
    assert auto["captures"] <= default["captures"] and auto["pool_bytes"] <= default["pool_bytes"]
    assert set(auto["sizes"]) <= {9, 11, 13, 17, 20, 26} and max(default["sizes"]) >= 150
    assert 0.85 <= auto["replayed_share"] < 1.0 and default["replayed_share"] == 1.0
    assert "**serving, trace of 400 steps, batches 9..193: device graphs**" in stdout
    table = stdout.split("device graphs**", 1)[1]
    assert "| contender | throughput | padded rows | replayed | captures | capture s | pool MiB |" in table
    assert "| graphopt L1 + host graphs, auto sizes | " in table and f"| {auto['padded_rows']:,} | " in table


def test_isolated_contenders_each_run_in_their_own_process_and_merge_into_one_table():
    from graphopt.bench import Options, run_isolated

    # resnet: one case, and its level-1 compile is the cheapest of the workloads'.
    options = Options(["resnet"], ["eager", "L0", "L1"], quick=True, rounds=1, startup=False)
    (workload,) = run_isolated(options)
    for case in workload.cases:
        rows = {row.contender: row for row in case.rows}
        assert list(rows) == ["eager", "graphopt L0", "graphopt L1"], case.case
        assert all(row.outputs_equal and row.vs_eager > 0 for row in rows.values())
    with pytest.raises(RuntimeError, match="no process reported .*its process failed: KeyError"):
        run_isolated(Options(["no-such-workload"], ["eager", "L0"], quick=True, rounds=1, startup=False))


def test_a_lowered_contender_is_judged_by_its_error_against_eager():
    eager = (torch.tensor([[1.0, -4.0], [2.0, 0.5]]), torch.tensor([3, 1]))
    close = (eager[0] + torch.tensor([[0.0, 0.1], [0.0, 0.0]]), eager[1].clone())
    assert measure.lowered_error(close, eager, 0.05) == (True, pytest.approx(0.1), pytest.approx(0.1 / 4))
    assert measure.lowered_error(close, eager, 0.01)[0] is False  # 2.5% of the largest |output|
    other_tokens = (close[0], torch.tensor([3, 2]))
    assert measure.lowered_error(other_tokens, eager, 0.05)[0] is False
    assert measure.lowered_error((eager[0][:1], eager[1]), eager, 0.05) == (False, math.inf, math.inf)


def test_the_error_column_appears_only_beside_lowered_contenders():
    def case(*rows):
        result = CaseResult("decode step, batch 1", "tokens", 1, rows=list(rows))
        fill_ratios(result)
        return result

    eager = Row("eager", True, [2.0], True, 0.0)
    int8 = Row("graphopt L1 int8 weights", False, [1.0], True, 0.0123, relative_error=0.0125)
    table = output.result_cells([case(eager, int8)])
    assert dict(zip(table.headers, table.rows[1]))["error vs eager"] == "0.012 (1.2%)"
    plain = Row("graphopt L1", False, [1.0], True, 0.0)
    assert "error vs eager" not in output.result_cells([case(eager, plain)]).headers


def test_int8_weights_run_in_the_bench_with_their_error_beside_the_speed(tmp_path):
    code = main(["bench", "--quick", "--workloads", "bert", "--contenders", "eager,L1+int8", "--threads", "1",
                 "--rounds", "1", "--no-startup", "--no-isolate", "--out", str(tmp_path)])
    rows = [row for case in json.loads((tmp_path / "bench.json").read_text())["workloads"]["bert"]["cases"]
            for row in case["rows"] if row["contender"] == "graphopt L1 int8 weights"]
    assert code == 0 and rows
    assert all(row["outputs_equal"] and 0 < row["relative_error"] <= 0.05 for row in rows), rows
