"""What `graphopt bench` writes: one table per workload (rich on the terminal, or
Markdown), a JSON of every figure, and a plot when matplotlib is installed.

A table is built once as plain cells and rendered either way, so the Markdown
that goes into the docs says exactly what the terminal said. The default table
fits a 120-column terminal: long notes (why a contender fell back) are numbered
below it, and `wide` adds every other column."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .measure import EAGER, NOISY_SPREAD, CaseResult, Row
from .suite import WorkloadResult


def duration(us: float) -> str:
    """A time in the unit that keeps three significant figures readable."""
    if us < 10_000:
        return f"{us:.0f} µs"
    if us < 10_000_000:
        return f"{us / 1e3:.1f} ms"
    return f"{us / 1e6:.2f} s"


def ratio(value: float | None, *rows: Row) -> str:
    """A ratio to two decimals, or "noisy" where a row it is taken from is noisy."""
    if value is None or math.isnan(value):
        return "-"
    return "noisy" if any(row.noisy for row in rows) else f"{value:.2f}x"


# The default table's wrapping columns and their widths: with them the worst case
# (the decoder's stream case, CUDA's longest contender names, a floor column) fits
# 120 terminal columns; tests/test_bench.py renders it.
WRAP = {"case": 15, "contender": 25, "vs best competitor": 10, "vs GEMM floor": 7, "note": 26}


@dataclass
class Cells:
    """One table as plain text. `mismatched[i]`: row i's outputs differ from eager's;
    `notes`: the long notes that cells refer to as [1], [2], ..."""

    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    mismatched: list[bool] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def refer(self, reasons: list[str]) -> str:
        """Markers for `reasons`, numbered once per table however many rows share one."""
        for reason in reasons:
            if reason not in self.notes:
                self.notes.append(reason)
        return "".join(f"[{self.notes.index(reason) + 1}]" for reason in reasons)


def result_cells(results: list[CaseResult], wide: bool = False) -> Cells:
    """A workload's cases as one table: a row per contender and case, and the GEMM
    floor's row where a case has one (its column only then). By default the columns a
    terminal needs; `wide` adds best time, throughput, warm-up and the output check."""
    floors = any(r.floor_us for r in results)
    lowered = any(row.relative_error is not None for r in results for row in r.rows)
    decoding = any(row.bandwidth_floor_us for r in results for row in r.rows)
    agreement = any(row.agreement is not None for r in results for row in r.rows)
    headers = ["case", "contender", "median"] + (["best", "throughput"] if wide else [])
    headers += ["vs eager", "vs best competitor"] + (["vs GEMM floor"] if floors else [])
    headers += (["throughput"] if not wide else []) + ["weights", "bandwidth floor", "of floor"] if decoding else []
    headers += ["error vs eager"] if lowered else []
    headers += ["tokens = eager"] if agreement else []
    headers += (["warm-up", "outputs = eager"] if wide else []) + ["note"]
    table = Cells(headers)
    for result in results:
        eager = next(row for row in result.rows if row.contender == EAGER)
        best = next((row for row in result.rows if row.contender == result.best_competitor), eager)
        for i, row in enumerate(result.rows):
            cells = {"case": result.case if i == 0 else "", "contender": row.contender,
                     "median": duration(row.median_us), "best": duration(row.best_us),
                     "throughput": f"{result.items / (row.median_us * 1e-6):,.0f} {result.unit}/s",
                     "vs eager": ratio(row.vs_eager, row, eager), "vs GEMM floor": ratio(row.vs_floor, row),
                     "vs best competitor": "(best)" if row.contender == result.best_competitor
                     else ratio(row.vs_competitor, row, best),
                     "warm-up": f"{row.warmup_s:.1f} s", "outputs = eager": equality(row),
                     "error vs eager": lowered_error_cell(row),
                     **floor_cells(result, row, table, first=i == 0),
                     "tokens = eager": "" if row.agreement is None else f"{row.agreement:.0%}",
                     "note": note(row, table, wide)}
            table.rows.append([cells[header] for header in headers])
            table.mismatched.append(not row.outputs_equal)
        if result.floor_us:
            floor = {"contender": "GEMM floor", "median": duration(result.floor_us), "vs GEMM floor": "1.00x",
                     "note": table.refer([result.floor_how])}
            table.rows.append([floor.get(header, "") for header in headers])
            table.mismatched.append(False)
    return table


def note(row: Row, table: Cells, wide: bool) -> str:
    """The note column: the row's short note and markers for its long reasons; in the
    default table, which has no output-check column, a mismatch first."""
    parts = [] if wide or row.outputs_equal else [f"outputs differ: {equality(row)}"]
    parts += [f"noisy: rounds ±{row.spread:.0%}"] if row.noisy else []
    parts += [row.note] if row.note else []
    return " ".join(parts + [table.refer(row.reasons)]).strip()


def floor_cells(result: CaseResult, row: Row, table: Cells, first: bool) -> dict[str, str]:
    """A decoding row's weight format, the throughput its format's memory-bandwidth floor
    allows (how it was found: a note on the case's first row) and its share of that."""
    if row.bandwidth_floor_us is None:
        return {}
    marker = table.refer([result.bandwidth_how]) if first else ""
    return {"weights": row.weight_format,
            "bandwidth floor": f"{result.items / (row.bandwidth_floor_us * 1e-6):,.0f} {result.unit}/s{marker}",
            "of floor": f"{row.bandwidth_floor_us / row.median_us:.0%}"}


def lowered_error_cell(row: Row) -> str:
    """A lower-precision row's error: its largest difference from eager's output, and that
    as a fraction of the output's largest magnitude (what precision_tolerance bounds)."""
    if row.relative_error is None:
        return ""
    return f"{row.max_diff:.2g} ({100 * row.relative_error:.2g}%)"  # two digits: a small error is not 0.0%


def equality(row: Row) -> str:
    if row.outputs_equal:
        return "yes"
    return f"NO (max |diff| {row.max_diff:.2g})"


def startup_cells(startup: dict[str, dict[str, Any]], device: str) -> Cells:
    """A workload's start-up runs; a failed run's error is a numbered note."""
    memory = "peak allocated" if device.startswith("cuda") else "peak RSS"
    tokens = any("first_token_cold_s" in found for found in startup.values())
    table = Cells(["contender", "cold start", "warm start", f"{memory} (cold)"]
                  + (["first token, cold", "first token, warm"] if tokens else []))
    for name, found in startup.items():
        if "error" in found:
            cells = [name, f"failed {table.refer([found['error']])}"]
        else:
            cells = [name, f"{found['cold_s']:.1f} s", f"{found['warm_s']:.1f} s", f"{found['peak_mib']:,.0f} MiB"]
            cells += [f"{found[k]:.1f} s" for k in ("first_token_cold_s", "first_token_warm_s") if k in found]
        table.rows.append(cells + [""] * (len(table.headers) - len(cells)))
        table.mismatched.append(False)
    return table


GRAPHS_CAPTION = ("graphopt with device graphs on the checked run (the last warm-up run, its output compared "
                  "with eager's): padded rows added to reach a capture size, steps whose graphs all replayed; "
                  "captures (recaptures included), their seconds and the graph pools' bytes after it; "
                  "throughput of the median timed run")


def graph_cells(result: CaseResult) -> Cells:
    """One row per graphopt contender with device graphs: what its graphs did on the case."""
    table = Cells(["contender", "throughput", "padded rows", "replayed", "captures", "capture s", "pool MiB"])
    for row in result.rows:
        if row.graphs is None:
            continue
        found = row.graphs
        table.rows.append([row.contender, f"{result.items / (row.median_us * 1e-6):,.0f} {result.unit}/s",
                           f"{found.padded_rows:,}", f"{found.replayed_share:.1%}", str(found.captures),
                           f"{found.capture_s:.2f}", f"{found.pool_bytes / 2**20:.2f}"])
        table.mismatched.append(not row.outputs_equal)
    return table


ZOO_CAPTION = ("median per run; vs torch.compile: torch.compile's (default mode) median / graphopt's, "
               "below 1.00x slower than it, * a noisy row (rounds stray more than ±10%); graphopt chose: "
               "the report of graphopt's level 'auto' where it ran (the level each graph chose), else of the "
               "first graphopt contender: its level and each graph's fused ops")


def zoo_cells(results: list[WorkloadResult]) -> Cells:
    """The zoo in one table: a row per model and case, every contender's median,
    each graphopt contender against torch.compile, and what graphopt chose."""
    cases = [(r.name.removeprefix("zoo-"), case) for r in results if r.name.startswith("zoo-") for case in r.cases]
    names = list(dict.fromkeys(row.contender for _, case in cases for row in case.rows))
    ours = [name for name in names if name.startswith("graphopt")]
    table = Cells(["model", "case", *names, *(f"{name} vs torch.compile" for name in ours), "graphopt chose"])
    for model, case in cases:
        rows = {row.contender: row for row in case.rows}
        compiled = rows.get("torch.compile")
        medians = [duration(rows[name].median_us) if name in rows else "-" for name in names]
        versus = [f"{compiled.median_us / rows[name].median_us:.2f}x" + "*" * (rows[name].noisy or compiled.noisy)
                  if name in rows and compiled else "-" for name in ours]
        choices = [rows[name].choice for name in ours if name in rows]
        choice = next((c for c in choices if "chosen)" in c), choices[0] if choices else "")
        table.rows.append([model, case.case, *medians, *versus, choice])
        table.mismatched.append(not all(row.outputs_equal for row in case.rows))
    return table


PROFILE_CAPTION = ("share of one run: torch's profiler (each op's own time) for torch's contenders, ONNX "
                   "Runtime's session profiling for it; 'outside ops' is framework overhead and code no "
                   "profiler names an op (Inductor's C++ kernels, an engine behind executors)")


def profile_cells(profiles: dict[str, dict[str, float]]) -> Cells:
    """One row per contender: its run's time and each op class's share of it."""
    from .profile import OP_CLASSES

    rows = [[name, duration(shares["wall_s"] * 1e6), *(f"{shares[c] * 100:.0f} %" for c in OP_CLASSES)]
            for name, shares in profiles.items()]
    return Cells(["contender", "run", *OP_CLASSES], rows, [False] * len(rows))


def rich_table(title: str, caption: str, table: Cells, wide: bool = False) -> Table:
    """The table for a terminal; without `wide`, the WRAP columns wrap at their widths."""
    found = Table(title=title, caption=caption, caption_justify="left")
    for header in table.headers:
        found.add_column(header, justify="left" if header in ("case", "contender", "note") else "right",
                         overflow="fold", max_width=None if wide else WRAP.get(header))
    for i, cells in enumerate(table.rows):
        if i and table.headers[0] == "case" and cells[0]:  # a new case
            found.add_section()
        found.add_row(*cells, style="bold red" if table.mismatched[i] else None)
    return found


def numbered(notes: list[str]) -> list[str]:
    return [f"[{i}] {text}" for i, text in enumerate(notes, 1)]


def markdown(title: str, caption: str, table: Cells) -> str:
    """A GitHub Markdown table: a bold title line, the table, the caption in italics,
    then the numbered notes as a list."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    body = [line(table.headers), line(["---"] * len(table.headers))] + [line(cells) for cells in table.rows]
    notes = ["", *(f"- {text}" for text in numbered(table.notes))] if table.notes else []
    return "\n".join([f"**{title}**", "", *body, "", f"_{caption}_", *notes])


def to_json(setup: dict[str, Any], workloads: dict[str, dict[str, Any]]) -> str:
    """Every figure: per workload its cases (each contender's per-round µs, medians,
    ratios, output check and note), its start-up runs and its skipped contenders."""
    def case(result: CaseResult) -> dict[str, Any]:
        return {"case": result.case, "unit": result.unit, "items_per_run": result.items,
                "floor_us": result.floor_us, "floor_how": result.floor_how, "bandwidth_how": result.bandwidth_how,
                "best_competitor": result.best_competitor,
                "rows": [{"contender": r.contender, "competitor": r.competitor, "median_us": r.median_us,
                          "best_us": r.best_us, "times_us": [round(t, 2) for t in r.times_us],
                          "vs_eager": r.vs_eager, "vs_best_competitor": r.vs_competitor,
                          "vs_floor": r.vs_floor, "spread": round(r.spread, 4), "noisy": r.noisy,
                          "outputs_equal": r.outputs_equal, "max_abs_diff": r.max_diff,
                          "relative_error": r.relative_error, "token_agreement": r.agreement,
                          "weight_format": r.weight_format, "bandwidth_floor_us": r.bandwidth_floor_us,
                          "note": r.note, "reasons": r.reasons, "warmup_s": r.warmup_s, "choice": r.choice,
                          "graphs": None if r.graphs is None else {**asdict(r.graphs), "replayed_share":
                                                                    r.graphs.replayed_share}}
                         for r in result.rows],
                "profiles": result.profiles}

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
        ax.bar_label(bars, labels=[ratio(r.vs_eager, r) for r in result.rows], padding=3)
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
            console: Console, docs: Path | None = None, wide: bool = False) -> int:
    """Print every workload's tables (rich, or Markdown on stdout), each followed by
    its numbered notes, and one line per contender without a row; write bench.json and
    bench.png under `out`, and with `docs` the Markdown tables into that file's
    measured section. 1 when some contender's outputs differ from eager's, else 0."""
    info = Console(stderr=True, soft_wrap=True) if as_markdown else console
    blocks: list[str] = []
    caption = (f"{setup['device']} ({setup['device_name']}) · torch {setup['torch']} · {setup['threads']} "
               f"thread(s) · median of {setup['rounds']} interleaved rounds · vs: speed-up of medians, "
               f"> 1 is faster; noisy: a row's rounds (or those of the row it is compared with) stray more "
               f"than ±{NOISY_SPREAD:.0%} from their median · {tolerance_text(setup)}")
    for result in results:
        tables = [(result.title, caption, result_cells(result.cases, wide))] if result.cases else []
        tables.extend((f"{result.name}, {case.case}: device graphs", GRAPHS_CAPTION, graph_cells(case))
                      for case in result.cases if case.graph_table and any(r.graphs for r in case.rows))
        tables.extend((f"{result.name}, {case.case}: where the time goes, by op class", PROFILE_CAPTION,
                       profile_cells(case.profiles)) for case in result.cases if case.profiles)
        if result.startup:
            tables.append((f"{result.name}: start-up to the first output, in fresh processes",
                           "cold: an empty GRAPHOPT_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR; warm: the same "
                           "command again with that cache; every child imports graphopt, eager's too",
                           startup_cells(result.startup, setup["device"])))
        for title, text, table in tables:
            blocks.append(markdown(title, text, table))
            if as_markdown:
                print(blocks[-1] + "\n")
                continue
            console.print(rich_table(title, text, table, wide))
            for line in numbered(table.notes):
                console.print(line, highlight=False, markup=False)
        for name, why in result.skipped.items():
            info.print(f"{result.name}: {name} left out: {why}", highlight=False, markup=False, soft_wrap=True)
        blocks.extend(f"- {result.name}: {name} left out: {why}" for name, why in result.skipped.items())
    zoo = zoo_cells(results)
    if zoo.rows:
        blocks.append(markdown("The zoo", ZOO_CAPTION, zoo))
        if as_markdown:
            print(blocks[-1] + "\n")
        else:
            console.print(rich_table("The zoo", ZOO_CAPTION, zoo, wide=True))
    out.mkdir(parents=True, exist_ok=True)
    workloads = {r.name: {"title": r.title, "cases": r.cases, "startup": r.startup, "skipped": r.skipped}
                 for r in results}
    (out / "bench.json").write_text(to_json(setup, workloads))
    info.print(f"figures: {out / 'bench.json'}", highlight=False, markup=False)
    info.print(plot(workloads, out / "bench.png"), highlight=False, markup=False)  # "graphopt[bench]" is no markup
    if docs is not None:
        replace_measured(docs, "\n\n".join(blocks), setup)
        info.print(f"tables written into {docs}", highlight=False, markup=False)
    differ = [(r.name, c.case, row.contender) for r in results for c in r.cases for row in c.rows
              if not row.outputs_equal]
    for workload, case, contender in differ:
        info.print(f"[bold red]{workload}, {case}: {contender}'s outputs differ from eager's[/]")
    return 1 if differ else 0


def tolerance_text(setup: dict[str, Any]) -> str:
    (atol, rtol), = setup["tolerance"].values()
    return (f"outputs within atol/rtol {atol:g}/{rtol:g} of eager's; half precision: no further from a "
            f"float32 run than {setup.get('half_error_factor', 2):g}x eager's own output; lowered precision "
            f"(int8 weights, bfloat16 math): error vs eager = largest |difference| (as a share of the largest "
            f"|output|), within {setup.get('lowered_bound', 0.05):g} of it")


MEASURED_START = "<!-- graphopt bench: start -->"
MEASURED_END = "<!-- graphopt bench: end -->"


def measured_section(text: str) -> tuple[int, int]:
    """Where the two markers of a page's measured section are in `text`; ValueError without them."""
    start, end = text.find(MEASURED_START), text.find(MEASURED_END)
    if start < 0 or end < start:
        raise ValueError(f"it has no measured section: add a line {MEASURED_START!r} and, below it, "
                         f"a line {MEASURED_END!r} where graphopt bench should write its tables")
    return start, end


def replace_measured(page: Path, tables: str, setup: dict[str, Any]) -> None:
    """Put `tables` between the two markers of `page`, with the command that made
    them, replacing what was there; the rest of the file stays as it is."""
    text = page.read_text()
    start, end = measured_section(text)
    made = (f"_Written by `{setup['command']}` on {setup['date']}; edit the command's output, "
            "not these lines._")
    page.write_text(f"{text[:start]}{MEASURED_START}\n{made}\n\n{tables}\n{text[end:]}")
