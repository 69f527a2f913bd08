"""What of a Backend's work goes through the compile cache (`cache.py`): whether its
graphs may be stored at all, their keys, the records stored beside them, and the spec a
later process builds a stored trace's graph from (`GraphSpec`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx

from . import cache
from .config import GraphOptimizationConfig
from .passes.fusion.replacement import USER_PATTERNS, Unkeyable
from .report import GraphRecord, Report


@dataclass
class GraphSpec:
    """How a later process builds again what `Backend.__call__` returned for one
    Dynamo graph (traces.py stores it with the graph's Dynamo trace)."""

    key: str                         # the graph's compile cache key: its records, its level-1 code
    level: int
    signature: Any = None            # with device graphs: the GraphRunner's Signature
    inductor: bytes | None = None    # level 2: Inductor's compiled graph, serialized
    passes: str | None = None        # BackendCache.pass_uuid() it was compiled under


class NotStorable(Exception):
    """Why a stored trace cannot be used: its graph is gone from the compile cache."""


def device_type(inputs: Sequence[Any]) -> str:
    """The device a graph runs on: its first tensor input off the CPU, else the CPU."""
    return next((x.device.type for x in inputs if isinstance(x, torch.Tensor) and x.device.type != "cpu"), "cpu")


class BackendCache:
    def __init__(self, config: GraphOptimizationConfig, report: Report):
        self.config, self.report = config, report
        self.disk = cache.CompileCache(config.cache_dir, report) if config.cache_dir else None

    def bypass(self) -> str | None:
        """Why this Backend's graphs do not go through the compile cache, or None."""
        config = self.config
        if self.disk is None:
            return "the compile cache is off (cache_dir=None)"
        if config.freeze_parameters:
            return "freeze_parameters folds weight values into the graph"
        if config.verify or config.debug_dump_dir:
            return "verify and debug_dump_dir ask for every pass to run"
        try:
            USER_PATTERNS.fingerprint()
        except Unkeyable as why:
            return str(why)
        return None

    def key(self, gm: torch.fx.GraphModule, inputs: list, level: int | str | None = None) -> str | None:
        """The compile cache's key for `gm` at `level` (None: the config's), or None
        where the cache is not used."""
        bypass = self.bypass()
        if bypass is not None:
            if self.disk is not None:
                self.report.fallback(f"cache_dir: {bypass}, so graphs are compiled without the compile cache")
            return None
        device = device_type(inputs)
        # Dynamo guards on these, and AOTAutograd traces differently under them.
        modes = f"grad={torch.is_grad_enabled()} autocast={torch.is_autocast_enabled(device)}"
        return cache.cache_key(self.pass_uuid(level), cache.describe_graph(gm, inputs), device, modes)

    def load(self, key: str | None) -> dict | None:
        return None if key is None else self.disk.load(key)

    def store(self, key: str | None, records: dict, graph: torch.fx.GraphModule,
              lowered: torch.fx.GraphModule | None = None) -> None:
        if key is not None:
            self.disk.store_compile(key, records, graph, lowered)

    def restore(self, stored: dict, record: GraphRecord) -> Any:
        """The stored records into `record`; the stored graph, if any."""
        return self.disk.restore(stored, record)

    def store_choice(self, key: str | None, choice: dict) -> None:
        """graph_opt_level="auto": the level chosen for the graph of `key`, with its figures."""
        if key is not None and choice["level"] in (1, 2):
            self.disk.store(key, {k: v for k, v in choice.items() if k != "graph"})

    def load_choice(self, key: str | None) -> dict:
        """The choice `store_choice` stored for `key` (marked `cached`), or {}."""
        stored = self.load(key)
        if not isinstance(stored, dict) or stored.get("level") not in (1, 2):
            return {}
        return {**stored, "cached": True}

    def pass_uuid(self, level: int | str | None = None) -> str:
        """What, besides the graph, decides what the passes make of it: the config
        fields they read and the user's patterns (graphopt and torch's versions are in
        every cache key). Inductor's FX graph cache keys on it too; "" where the
        patterns cannot be keyed, which Inductor takes as a pass it must not cache."""
        config = self.config
        fields = {"graph_opt_level": config.graph_opt_level if level is None else level, "disabled_passes": sorted(config.disabled_passes),
                  "freeze_parameters": config.freeze_parameters,
                  "compute_dtype": config.compute_dtype, "precision_tolerance": config.precision_tolerance,
                  "weight_quantization": config.weight_quantization,
                  "inductor_compile_config": config.inductor_compile_config}
        try:
            patterns = USER_PATTERNS.fingerprint()
        except Unkeyable:
            return ""
        return cache.cache_key(json.dumps(fields, sort_keys=True), patterns)
