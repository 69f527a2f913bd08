"""`print(report)`: a Report in words, a line per record (the records are report.py's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .report import GraphRecord, PlanRecord, Report


def render(report: Report) -> str:
    """The report as `print(report)` shows it: a block per graph, then the cache, level
    choices, executors, device graphs, notes and fallbacks."""
    lines = [f"graphopt report: graph_opt_level={report.level}, {len(report.graphs)} graph(s), "
             f"compile {report.compile_seconds:.2f}s"]
    lines.extend(line for g in report.graphs for line in _graph_lines(report, g))
    if report.cache_hits or report.cache_misses:
        lines.append(f"  compile cache: {report.cache_hits} hits, {report.cache_misses} misses"
                     + (f" ({report.cache_rebuilt} broken entries rebuilt)" if report.cache_rebuilt else "")
                     + f", {report.traces_used} stored traces used, {report.traces_stored} stored")
    if report.repacks:
        lines.append(f"  refresh(): {report.repacks} graph(s) compiled again for Inductor's packed weights")
    lines.extend(f"  frozen weights changed, refreshed {n} time(s): {why}"
                 for why, n in report.weight_refreshes.items())
    lines.extend(_choice_line(c) for c in report.level_choices)
    lines.extend(line for e in report.executors for line in _executor_lines(e))
    if report.captures or report.pieces:
        sizes = ", ".join(str(c.size) for c in report.captures)
        lines.append(f"  device graphs: {len(report.captures)} captured (sizes {sizes or '-'}), pool "
                     f"{report.pool_bytes / 2**20:.2f} MiB, {report.replays} replays, "
                     f"{report.recaptures} recaptures, {report.rebinds} rebinds, {report.recompiles} recompiles")
        lines.extend(f"    {n} x recaptured: {reason}" for reason, n in report.recapture_reasons.items())
        lines.append(f"    {report.steps_replayed} of {report.steps} steps replayed, {report.padded_rows} padded rows, "
                     f"{report.held_copies} held outputs copied out, capture {report.capture_seconds:.2f}s")
        lines.extend(f"    {r.piece} at size {r.size}: capture refused by graph_memory_budget, needed "
                     f"{r.needed} bytes, {r.available} available" for r in report.budget_refusals)
        lines.extend(_plan_lines(p) for p in report.plans)
        lines.extend(f"    graph {graph}: {how}" for graph, how in report.batches.items())
        for piece in (p for graph in report.pieces for p in graph if len(graph) > 1):
            how = "captured" if piece.split_reason is None else f"runs between replays: {piece.split_reason}"
            lines.append(f"    {piece.name}: {how} ({piece.captures} captures, {piece.replays} replays)")
    if report.notes:
        lines.append("  notes:")
        lines.extend(f"    {note}" for note in report.notes)
    if report.fallbacks:
        lines.append("  fallbacks:")
        lines.extend(f"    {n} x {report.fallback_kinds[reason].value}: {reason}"
                     for reason, n in report.fallbacks.items())
    lines.extend(f"  {n} x recompiled: {reason}" for reason, n in report.recompile_reasons.items())
    return "\n".join(lines)


def _graph_lines(report: Report, g: GraphRecord) -> list[str]:
    """Graph `g`'s block: its compile, fused ops, weights, GEMMs, precision, passes and memory plan."""
    lines = []
    how = "compiled in"
    if g.cache_hit:
        how = "loaded from the compile cache in" if g.traced else \
            "loaded from the compile cache with its stored Dynamo trace in"
    level = f" (level {g.level})" if report.level == "auto" else ""
    lines.append(f"  graph {g.index}{level}: {g.nodes_before} -> {g.nodes_after} nodes, "
                 f"{how} {g.compile_seconds:.2f}s")
    if g.fused_ops:
        lines.append("    fused ops: " + ", ".join(f"{k}={v}" for k, v in g.fused_ops.items()))
    if any(g.weight_bytes.values()):
        lines.append(f"    weights beyond the parameters: {g.weight_bytes['new'] / 2**20:.2f} MiB computed, "
                     f"{g.weight_bytes['shared'] / 2**20:.2f} MiB shared with earlier graphs")
    lines.extend(f"    GEMM {gemm}: {choice}" for gemm, choice in g.gemms.items())
    if g.precision:
        lines.append(_precision_line(g.precision))
    for p in (p for p in report.passes if p.graph == g.index):
        counts = ", ".join(f"{k}={v}" for k, v in p.counts.items()) or "-"
        mark = "changed" if p.changed else "no change"
        lines.append(f"    {p.name:<28} {mark:<10} {counts}")
    lines.extend(f"    memory at {', '.join(f'{k}={v}' for k, v in m.sizes.items()) or 'static sizes'}: "
                 f"{m.buffers} buffers, naive {m.naive_bytes / 1024:.1f} KiB, planned "
                 f"{m.planned_bytes / 1024:.1f} KiB, largest {m.largest_buffer_bytes / 1024:.1f} KiB"
                 for m in report.memory if m.graph == g.index)
    return lines


def _choice_line(choice: dict[str, Any]) -> str:
    head = f"  level of graph {choice['graph']}: "
    if "level" not in choice:
        return head + ("not chosen yet: level 1 serves until level 2 has compiled and a call chooses "
                       "(graphopt.wait_for_background() waits for it)")
    timed = ", ".join(f"level {k} {v * 1e6:.0f} us" for k, v in choice["seconds"].items() if v)
    when = ", chosen in an earlier process" if choice.get("cached") else \
        f", chosen {choice['chosen_after_s']:g} s after its compile began" if "chosen_after_s" in choice else ""
    return head + f"{choice['level']} ({choice['reason']}{'; ' + timed if timed else ''}{when})"


def _executor_lines(e: dict[str, Any]) -> list[str]:
    """A graph's executor and each candidate's median; a candidate below float32's error."""
    timed = ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in e["seconds"].items())
    return [f"  executor of graph {e['graph']}: {e['executor']} ({timed or e['reason']})",
            *(f"    {name} ({err['dtype']}): {_error_figures(err)}"
              + (" (over precision_tolerance: not a candidate)" if err["fell_back"] else "")
              for name, err in e.get("precision", {}).items())]


def _error_figures(error: dict[str, Any]) -> str:
    """A lowering's error (passes/lowered_error.py's record) in words; for a causal LM's
    logits also the next-token KL it was judged by, and the greedy-token agreement."""
    figures = (f"max abs error {error['max_abs_error']:.3g}, mean {error['mean_abs_error']:.3g}, "
               f"{error['relative_error']:.3g} of the output's magnitude")
    if "logits_kl" in error:
        figures += (f", next-token KL {error['logits_kl']:.3g} nats, greedy tokens agree on "
                    f"{round(error['token_agreement'] * error['tokens_compared'])} of "
                    f"{error['tokens_compared']} ({100 * error['token_agreement']:.3g}%)")
    return figures


def _precision_line(error: dict[str, Any]) -> str:
    kept = "kept" if not error["fell_back"] else f"over {bound_name(error)}: full precision"
    projection = f", the logits' projection in {error['logits_weights']}" if "logits_weights" in error else ""
    return f"    lower precision ({error['dtype']}): {_error_figures(error)}{projection} ({kept})"


def bound_name(error: dict[str, Any]) -> str:
    """The bound a lowering's error record (passes/lowered_error.py's) was held to, as the
    user sets it: precision_tolerance, or a multiple of it (int4's, passes/precision.py)."""
    slack = error.get("slack", 1.0)
    if slack == 1.0:
        return f"precision_tolerance={error['tolerance']:g}"
    return f"{slack:g}x precision_tolerance={error['tolerance'] / slack:g} (int4's bound, {error['tolerance']:g})"


def _plan_lines(plan: PlanRecord) -> str:
    histogram = ", ".join(f"{size}: {n}" for size, n in sorted(plan.histogram.items()))
    lines = [f"    graph {plan.graph} capture sizes \"auto\": {plan.sizes or '-'} after {plan.replans} plans "
             f"({plan.released} sizes released), expected padding {plan.expected_padded_rows:g} rows",
             f"      batch sizes seen: {histogram or '-'}"]
    lines.extend(f"      {reason}" for reason in plan.reasons)
    return "\n".join(lines)
