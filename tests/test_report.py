"""The report's fallbacks: counted by kind beside their reasons, shown with their kind,
and carried through the compile cache's stored records."""

from __future__ import annotations

import logging

from graphopt import FallbackKind, Report
from graphopt.cache import CompileCache
from graphopt.report import GraphRecord


def test_fallbacks_are_counted_by_kind_and_by_reason(caplog):
    report = Report(1)
    with caplog.at_level(logging.WARNING, logger="graphopt"):
        for _ in range(3):
            report.fallback(FallbackKind.NO_DEVICE_GRAPH, "batch too large")
        report.fallback(FallbackKind.NO_DEVICE_GRAPH, "batch unknown")
        report.fallback(FallbackKind.CACHE_NOT_STORED, "disk full")
    assert report.fallback_counts == {FallbackKind.NO_DEVICE_GRAPH: 4, FallbackKind.CACHE_NOT_STORED: 1}
    assert report.fallbacks == {"batch too large": 3, "batch unknown": 1, "disk full": 1}
    assert report.reasons(FallbackKind.NO_DEVICE_GRAPH) == ["batch too large", "batch unknown"]
    assert report.reasons(FallbackKind.EAGER) == []
    assert len(caplog.records) == 3  # the first of each reason is logged, the rest only counted


def test_the_text_report_and_its_dict_show_the_kind():
    report = Report(1)
    report.fallback(FallbackKind.PASS_UNDONE, "a pass broke the graph")
    report.fallback(FallbackKind.PASS_UNDONE, "a pass broke the graph")
    assert "2 x pass_undone: a pass broke the graph" in str(report)
    assert report.to_dict()["fallback_counts"] == {"pass_undone": 2}
    assert report.to_dict()["fallbacks"] == {"a pass broke the graph": 2}


def test_a_stored_compiles_fallbacks_come_back_with_their_kinds(tmp_path):
    compiled = Report(1)
    compiled.fallback(FallbackKind.EAGER, "before the graph")
    before = compiled.fallbacks.copy()
    compiled.fallback(FallbackKind.PRECISION, "over tolerance")
    compiled.fallback(FallbackKind.PRECISION, "over tolerance")
    stored = compiled.fallbacks_since(before)
    assert stored == [(FallbackKind.PRECISION, "over tolerance", 2)]

    loaded = Report(1)
    CompileCache(str(tmp_path), loaded).restore(
        {"record": {}, "passes": [], "memory": [], "fallbacks": stored}, GraphRecord(0))
    assert loaded.fallback_counts == {FallbackKind.PRECISION: 2} and loaded.cache_hits == 1
