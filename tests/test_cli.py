import contextlib
import io

import pytest
import torch

from graphopt.cli import main as cli
from graphopt.cli.main import DemoRow, main, run_demo

# Levels 0 and 1 only: level 2 compiles with Inductor, too slow for a unit test.
SMALL = ["--levels", "0,1", "--device-graphs", "1", "--batch-sizes", "1,3", "--new-tokens", "4", "--repeats", "1"]
# A variant's turn in a timed round: the tests read the rows and the table, never the speed.
SHORT_ROUND_S = 0.01


@pytest.fixture
def short_rounds(monkeypatch):
    monkeypatch.setattr(cli, "ROUND_S", SHORT_ROUND_S)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[int, str, list[DemoRow]]:
    """`graphopt demo` with SMALL, once, in its own compile cache:
    (exit code, what it printed, the rows run_demo gave it)."""
    rows: list[DemoRow] = []

    def recorded(*args, **kwargs):
        rows.extend(real(*args, **kwargs))
        return rows

    real, stdout = cli.run_demo, io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path_factory.mktemp("graphopt-cache")))
        patch.setattr(cli, "ROUND_S", SHORT_ROUND_S)
        patch.setattr(cli, "run_demo", recorded)
        torch._dynamo.reset()
        with contextlib.redirect_stdout(stdout):
            code = main(["demo", *SMALL])
        torch._dynamo.reset()
    return code, stdout.getvalue(), rows


def test_demo_prints_a_table_and_succeeds(demo):
    code, out, _ = demo
    assert code == 0
    for text in ("eager", "level 0", "level 1", "level 1 + graphs", "tokens/s", "yes", "prefill + decode"):
        assert text in out
    assert "NO" not in out


def test_run_demo_gives_one_row_per_variant_and_batch(demo):
    _, _, rows = demo
    assert [(r.variant, r.batch) for r in rows] == [
        (variant, batch) for variant in ("eager", "level 0", "level 1", "level 1 + graphs") for batch in (1, 3)
    ]
    assert all(r.tokens_equal for r in rows)
    assert all(r.tokens_per_s > 0 for r in rows)
    assert all(r.graphs is None for r in rows if r.variant == "eager")


def test_one_level_1_module_serves_every_batch_size(demo):
    level_1 = [r for r in demo[2] if r.variant == "level 1"]
    # Dynamo may specialise batch size 1; any other size must reuse the dynamic graph.
    assert level_1[-1].graphs <= 2


def test_verbose_prints_each_level_report_summary(capsys, short_rounds):
    assert main(["demo", *SMALL, "--levels", "0", "--device-graphs", "0", "--verbose"]) == 0
    assert "level 0: graphopt report: graph_opt_level=0" in capsys.readouterr().out


def test_tokens_that_differ_from_eager_fail_the_demo(monkeypatch, capsys):
    differing = [DemoRow("eager", 2, 10.0, 1.0, 0.0, None, True),
                 DemoRow("level 1", 2, 20.0, 2.0, 0.5, 1, False, "graphopt report: ...")]
    monkeypatch.setattr(cli, "run_demo", lambda *args, **kwargs: differing)
    assert main(["demo"]) == 1
    out = capsys.readouterr().out
    assert "NO" in out and "level 1, batch 2: tokens differ from eager's" in out


@pytest.mark.parametrize("args, option, allowed", [
    (["--batch-sizes", "1,17"], "--batch-sizes", "1..16"),
    (["--batch-sizes", "x"], "--batch-sizes", "1..16"),
    (["--levels", "3"], "--levels", "0..2"),
    (["--repeats", "0"], "--repeats", ">= 1"),
    (["--prompt-len", "100", "--new-tokens", "29"], "--new-tokens", "128"),
])
def test_bad_options_are_usage_errors_naming_the_option(args, option, allowed, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert option in err and allowed in err


def test_no_command_prints_help_and_returns_2(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_bench_runs_named_workloads_as_named_and_large_widens_only_the_default():
    from graphopt import bench

    usual = [w for w in bench.WORKLOADS if w not in bench.LARGE]
    assert cli._workloads(None, False) == usual
    assert cli._workloads(None, True) == list(bench.WORKLOADS)
    assert cli._workloads(["resnet18", "bert-base"], True) == ["resnet18", "bert-base"]
    assert cli._workloads(["bert"], False) == ["bert"]


def test_a_variant_whose_rounds_spread_is_marked_noisy(monkeypatch, capsys):
    """Timings injected: eager and level 0 take 1 s every round, level 1 0.6, 1.0 and
    1.4 s in turn (±40% around its median): its speed-up is not printed, eager's and
    level 0's are, and the run announced how long it would take."""
    real = cli._timed
    swings = iter([0.6, 1.0, 1.4] * 20)

    def timed(model, step, prompt, new_tokens):
        tokens, _ = real(model, step, prompt, new_tokens)
        level = getattr(getattr(step, "config", None), "graph_opt_level", None)
        return tokens, next(swings) if level == 1 else 1.0

    monkeypatch.setattr(cli, "_timed", timed)
    announced = []
    rows = run_demo(levels=[0, 1], batch_sizes=[2], prompt_len=4, new_tokens=4, repeats=3,
                    announce=announced.append)
    by_variant = {r.variant: r for r in rows}
    assert not by_variant["eager"].noisy and not by_variant["level 0"].noisy
    assert by_variant["level 1"].noisy and by_variant["level 1"].spread == pytest.approx(0.4)
    assert by_variant["level 1"].tokens_per_s == pytest.approx(2 * 4 / 1.0)  # the median round
    [announcement] = announced
    assert announcement.startswith("about ") and "3 variants at 1 batch sizes" in announcement
    cli.Console().print(cli._table(rows, 3))
    out = capsys.readouterr().out
    assert "noisy ±40%" in out and "1.00x" in out
