"""What `graphopt bench` writes: one table per workload (rich on the terminal, or
Markdown), a JSON of every figure, and a plot when matplotlib is installed.

A table is built once as plain cells and rendered either way, so the Markdown
that goes into the README says exactly what the terminal said."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .measure import CaseResult, Row
from .suite import WorkloadResult


def duration(us: float) -> str:
    """A time in the unit that keeps three significant figures readable."""
    if us < 10_000:
        return f"{us:.0f} µs"
    if us < 10_000_000:
        return f"{us / 1e3:.1f} ms"
    return f"{us / 1e6:.2f} s"


def ratio(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}x"


def result_cells(results: list[CaseResult]) -> tuple[list[str], list[list[str]], list[bool]]:
    """(headers, one row of cells per contender and case, whether each row's outputs
    differ from eager's). The GEMM-floor column is there when some case has a floor."""
    floors = any(r.floor_us for r in results)
    headers = ["case", "contender", "median", "best", "throughput", "vs eager", "vs best competitor"]
    headers += ["vs GEMM floor"] if floors else []
    headers += ["outputs = eager", "note"]
    rows, mismatched = [], []
    for result in results:
        for i, row in enumerate(result.rows):
            per_s = result.items / (row.median_us * 1e-6)
            cells = [result.case if i == 0 else "", row.contender, duration(row.median_us),
                     duration(row.best_us), f"{per_s:,.0f} {result.unit}/s", ratio(row.vs_eager),
                     "(best)" if row.contender == result.best_competitor else ratio(row.vs_competitor)]
            cells += [ratio(row.vs_floor)] if floors else []
            cells += [equality(row), row.note]
            rows.append(cells)
            mismatched.append(not row.outputs_equal)
        if result.floor_us:
            rows.append(["", "GEMM floor", duration(result.floor_us), "", "", "", "", "1.00x", "",
                         result.floor_how])
            mismatched.append(False)
    return headers, rows, mismatched


def equality(row: Row) -> str:
    if row.outputs_equal:
        return "yes"
    return f"NO (max |diff| {row.max_diff:.2g})"


def startup_cells(startup: dict[str, dict[str, Any]], device: str) -> tuple[list[str], list[list[str]]]:
    memory = "peak allocated" if device.startswith("cuda") else "peak RSS"
    headers = ["contender", "cold start", "warm start", f"{memory} (cold)"]
    rows = []
    for name, found in startup.items():
        if "error" in found:
            rows.append([name, "failed", "", found["error"]])
        else:
            rows.append([name, f"{found['cold_s']:.1f} s", f"{found['warm_s']:.1f} s",
                         f"{found['peak_mib']:,.0f} MiB"])
    return headers, rows


def rich_table(title: str, caption: str, headers: list[str], rows: list[list[str]],
               mismatched: list[bool] | None = None) -> Table:
    table = Table(title=title, caption=caption, caption_justify="left")
    for header in headers:
        table.add_column(header, justify="left" if header in ("case", "contender", "note") else "right",
                         overflow="fold")
    for i, cells in enumerate(rows):
        if i and headers[0] == "case" and cells[0]:  # a new case
            table.add_section()
        table.add_row(*cells, style="bold red" if mismatched and mismatched[i] else None)
    return table


def markdown(title: str, caption: str, headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub Markdown table: a bold title line, the table, the caption in italics."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    body = [line(headers), line(["---"] * len(headers))] + [line(cells) for cells in rows]
    return "\n".join([f"**{title}**", "", *body, "", f"_{caption}_"])


def to_json(setup: dict[str, Any], workloads: dict[str, dict[str, Any]]) -> str:
    """Every figure: per workload its cases (each contender's per-round µs, medians,
    ratios, output check and note), its start-up runs and its skipped contenders."""
    def case(result: CaseResult) -> dict[str, Any]:
        return {"case": result.case, "unit": result.unit, "items_per_run": result.items,
                "floor_us": result.floor_us, "floor_how": result.floor_how,
                "best_competitor": result.best_competitor,
                "rows": [{"contender": r.contender, "competitor": r.competitor, "median_us": r.median_us,
                          "best_us": r.best_us, "times_us": [round(t, 2) for t in r.times_us],
                          "vs_eager": r.vs_eager, "vs_best_competitor": r.vs_competitor,
                          "vs_floor": r.vs_floor, "outputs_equal": r.outputs_equal, "max_abs_diff": r.max_diff,
                          "note": r.note, "warmup_s": r.warmup_s} for r in result.rows]}

    out = {name: {**found, "cases": [case(r) for r in found["cases"]]} for name, found in workloads.items()}
    return json.dumps({"setup": setup, "workloads": out}, indent=2, allow_nan=True)


def plot(workloads: dict[str, dict[str, Any]], path: Path) -> str:
    """Speed-up against eager of every contender in every case, one panel per case."""
    try:
        import matplotlib
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'graphopt[bench]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [(name, r) for name, found in workloads.items() for r in found["cases"]]
    if not cases:
        return "plot skipped: nothing was measured"
    columns = min(len(cases), 3)
    rows = math.ceil(len(cases) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.5 * rows), squeeze=False)
    for ax, (name, result) in zip(axes.flat, cases):
        bars = ax.barh([r.contender for r in result.rows], [r.vs_eager for r in result.rows],
                       color=["tab:red" if not r.outputs_equal else "tab:blue" if r.competitor else "tab:green"
                              for r in result.rows])
        ax.bar_label(bars, labels=[ratio(r.vs_eager) for r in result.rows], padding=3)
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.invert_yaxis()
        ax.margins(x=0.2)  # room for the labels
        ax.set_title(f"{name}: {result.case}", fontsize=9)
        ax.set_xlabel("speed-up over eager (median)")
    for ax in list(axes.flat)[len(cases):]:
        ax.set_visible(False)
    fig.suptitle("green: graphopt · blue: the others · red: outputs differ from eager's", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def present(results: list[WorkloadResult], setup: dict[str, Any], out: Path, as_markdown: bool,
            console: Console, readme: Path | None = None) -> int:
    """Print every workload's tables (rich, or Markdown on stdout) and one line per
    contender without a row, write bench.json and bench.png under `out`, and with
    `readme` the Markdown tables into that file's measured section; 1 when some
    contender's outputs differ from eager's, else 0."""
    info = Console(stderr=True, soft_wrap=True) if as_markdown else console
    blocks: list[str] = []
    caption = (f"{setup['device']} ({setup['device_name']}) · torch {setup['torch']} · {setup['threads']} "
               f"thread(s) · median of {setup['rounds']} interleaved rounds · vs: speed-up of medians, "
               f"> 1 is faster · outputs within rtol/atol {tolerance_text(setup)} of eager's")
    for result in results:
        tables = [(result.title, caption, *result_cells(result.cases))]
        if result.startup:
            tables.append((f"{result.name}: start-up to the first output, in fresh processes",
                           "cold: an empty GRAPHOPT_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR; warm: the same "
                           "command again with that cache; every child imports graphopt, eager's too",
                           *startup_cells(result.startup, setup["device"]), None))
        for title, text, headers, rows, mismatched in tables:
            blocks.append(markdown(title, text, headers, rows))
            if as_markdown:
                print(blocks[-1] + "\n")
            else:
                console.print(rich_table(title, text, headers, rows, mismatched))
        for name, why in result.skipped.items():
            info.print(f"{result.name}: {name} left out: {why}", highlight=False, markup=False, soft_wrap=True)
        blocks.extend(f"- {result.name}: {name} left out: {why}" for name, why in result.skipped.items())
    out.mkdir(parents=True, exist_ok=True)
    workloads = {r.name: {"title": r.title, "cases": r.cases, "startup": r.startup, "skipped": r.skipped}
                 for r in results}
    (out / "bench.json").write_text(to_json(setup, workloads))
    info.print(f"figures: {out / 'bench.json'}", highlight=False, markup=False)
    info.print(plot(workloads, out / "bench.png"), highlight=False, markup=False)  # "graphopt[bench]" is no markup
    if readme is not None:
        replace_measured(readme, "\n\n".join(blocks), setup)
        info.print(f"tables written into {readme}", highlight=False, markup=False)
    differ = [(r.name, c.case, row.contender) for r in results for c in r.cases for row in c.rows
              if not row.outputs_equal]
    for workload, case, contender in differ:
        info.print(f"[bold red]{workload}, {case}: {contender}'s outputs differ from eager's[/]")
    return 1 if differ else 0


def tolerance_text(setup: dict[str, Any]) -> str:
    return ", ".join(f"{dtype.removeprefix('torch.')} {rtol:g}/{atol:g}"
                     for dtype, (rtol, atol) in setup["tolerance"].items())


MEASURED_START = "<!-- graphopt bench: start -->"
MEASURED_END = "<!-- graphopt bench: end -->"


def measured_section(text: str) -> tuple[int, int]:
    """Where the two markers of a README's measured section are in `text`; ValueError without them."""
    start, end = text.find(MEASURED_START), text.find(MEASURED_END)
    if start < 0 or end < start:
        raise ValueError(f"it has no measured section: add a line {MEASURED_START!r} and, below it, "
                         f"a line {MEASURED_END!r} where graphopt bench should write its tables")
    return start, end


def replace_measured(readme: Path, tables: str, setup: dict[str, Any]) -> None:
    """Put `tables` between the two markers of `readme`, with the command that made
    them, replacing what was there; the rest of the file stays as it is."""
    text = readme.read_text()
    start, end = measured_section(text)
    made = (f"_Written by `{setup['command']}` on {setup['date']}; edit the command's output, "
            "not these lines._")
    readme.write_text(f"{text[:start]}{MEASURED_START}\n{made}\n\n{tables}\n{text[end:]}")
