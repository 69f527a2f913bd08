"""What of a Backend's work goes through the compile cache (`cache.py`): whether its
graphs may be stored at all, their keys, the records stored beside them, and the spec a
later process builds a stored trace's graph from (`GraphSpec`).

Frozen graphs (freeze_parameters=True) are stored without the weights:

    level 1: entry = the graphs with every value folded from frozen parameters left
             out, and per value its recipe (constant_fold.py); a later process
             recomputes the values from its own weights (`bind`)
    level 2: entry = Inductor's compiled code with its constants left out, and per
             constant how it is made from the folded values (frozen_code.py); a later
             process folds the values, makes the constants and loads the code
             (`frozen_code`). Where Inductor made a constant graphopt cannot trace
             back, the entry holds it by value under a key of the weights' values
             (`frozen_key`), and the weight-free key says so.

A folded value a pass may have read to decide a rewrite (a small one: a fill value;
an integral one: an index range) is stored as a digest, and an entry whose values
recompute differently is compiled again, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx

from .. import cache
from .._compat import fake, inductor_constants, trace_graph
from ..config import GraphOptimizationConfig
from ..passes.constant_fold import FOLDED_RECIPES, FROZEN_INPUTS, may_be_read
from ..passes.fusion.replacement import USER_PATTERNS, Unkeyable
from ..report import FallbackKind, GraphRecord, Report
from . import frozen_code, tiers


@dataclass
class GraphSpec:
    """How a later process builds again what `Backend.__call__` returned for one
    Dynamo graph (traces.py stores it with the graph's Dynamo trace)."""

    key: str                         # the graph's compile cache key: its records, its level-1 code
    level: int
    signature: Any = None            # with device graphs: the GraphRunner's Signature
    inductor: bytes | None = None    # level 2: Inductor's compiled graph, serialized
    passes: str | None = None        # BackendCache.pass_uuid() it was compiled under
    # Frozen weights: where the graph's weight inputs come from (graph input -> Dynamo's
    # source, read from a later call's frame: Backend.rebuild), and each input's kind.
    weights: dict[int, str] | None = None
    kinds: list[str] | None = None
    # Level 2, in the compiling process: Inductor's compiled graph, which `inductor` serializes
    # when a trace is stored; never pickled.
    compiled: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name != "compiled"}


WEIGHT_KINDS = ("parameter", "buffer")


class NotStorable(Exception):
    """Why a stored trace cannot be used: its graph is gone from the compile cache."""


def device_type(inputs: Sequence[Any]) -> str:
    """The device a graph runs on: its first tensor input off the CPU, else the CPU."""
    return next((x.device.type for x in inputs if isinstance(x, torch.Tensor) and x.device.type != "cpu"), "cpu")


class BackendCache:
    def __init__(self, config: GraphOptimizationConfig, report: Report):
        self.config, self.report = config, report
        self.disk = cache.CompileCache(config.cache_dir, report) if config.cache_dir else None

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Inside, graphs are compiled without the compile cache (a compile whose code
        arrives later has nothing to store yet)."""
        disk, self.disk = self.disk, None
        try:
            yield
        finally:
            self.disk = disk

    @staticmethod
    def fingerprint() -> str | Unkeyable:
        """The user patterns' fingerprint, or why they cannot be keyed: what every key
        of a graph reads, so a compile asks for it once."""
        try:
            return USER_PATTERNS.fingerprint()
        except Unkeyable as why:
            return why

    def bypass(self, fingerprint: str | Unkeyable) -> str | None:
        """Why this Backend's graphs do not go through the compile cache, or None."""
        config = self.config
        if self.disk is None:
            return "the compile cache is off (cache_dir=None)"
        if config.verify or config.debug_dump_dir:
            return "verify and debug_dump_dir ask for every pass to run"
        return str(fingerprint) if isinstance(fingerprint, Unkeyable) else None

    def note_bypass(self, fingerprint: str | Unkeyable) -> None:
        """Log, once per compile, why a graph is compiled without the compile cache."""
        bypass = self.bypass(fingerprint)
        if bypass is not None and self.disk is not None:
            self.report.fallback(FallbackKind.CACHE_OFF,
                                 f"cache_dir: {bypass}, so graphs are compiled without the compile cache")

    def key(self, gm: torch.fx.GraphModule, inputs: list, level: int | str,
            fingerprint: str | Unkeyable) -> str | None:
        """The compile cache's key for `gm` at `level`, or None where the cache is not used."""
        if self.bypass(fingerprint) is not None:
            return None
        device = device_type(inputs)
        # Dynamo guards on these, and AOTAutograd traces differently under them.
        modes = f"grad={torch.is_grad_enabled()} autocast={torch.is_autocast_enabled(device)}"
        return cache.cache_key(self.pass_uuid(level, fingerprint), cache.describe_graph(gm, inputs), device, modes)

    def load(self, key: str | None) -> dict | None:
        return None if key is None else self.disk.load(key)

    def store(self, key: str | None, records: dict, graph: torch.fx.GraphModule,
              lowered: torch.fx.GraphModule | None = None, inputs: list | None = None) -> dict | None:
        """Store a compile; returns the entry stored, None where none was. With frozen
        weights at level 1, `inputs` (the graph's real inputs) says where they are."""
        if key is None:
            return None
        if not self.config.freeze_parameters or lowered is None:
            return self.disk.store_compile(key, records, graph, lowered)
        try:
            frozen = frozen_entry(graph, inputs or [])
        except ValueError as error:
            return self._not_stored(error)
        return self.disk.store_compile(key, {**records, "frozen": frozen}, graph, lowered, leave_out=frozen["values"])

    def store_frozen_code(self, key: str, weight_key: Callable[[], str] | None, records: dict,
                          graph: torch.fx.GraphModule, compiled: Any, recorded: Any) -> dict | None:
        """Level 2 with frozen weights: store the records (with `frozen_entry`'s, taken
        before lowering) and Inductor's code `compiled` (its constants left out:
        `recorded`) with how each constant is made from the weights (frozen_code.py).
        Where a constant is kept by value, the entry goes under the key of the weights'
        values (`weight_key()`), and `key` says so; `weight_key` is None where `key`
        already is that key."""
        frozen = records.pop("frozen")
        if isinstance(frozen, str):
            return self._not_stored(frozen)
        try:
            specs, keyed_on_weights = frozen_code.constant_specs(recorded, graph)
            code = trace_graph.bundled_inductor(compiled)
            if code is None:
                raise ValueError("AOTAutograd kept no serializable entry for its code")
        except ValueError as error:
            return self._not_stored(error)
        entry = {**records, "frozen": frozen, "code": code, "constants": specs,
                 "weight_free": keyed_on_weights is None}
        if keyed_on_weights is not None and weight_key is not None:
            self.disk.store(key, {"keyed_on_weights": keyed_on_weights})
            key = weight_key()
        return self.disk.store_compile(key, entry, None)

    @staticmethod
    def frozen_entry(graph: torch.fx.GraphModule, inputs: list) -> dict | str:
        """`frozen_entry`, taken before lowering; or why a frozen graph cannot be stored."""
        try:
            return frozen_entry(graph, inputs)
        except ValueError as error:
            return str(error)

    def _not_stored(self, error: ValueError | str) -> None:
        self.report.cache_misses += 1
        self.report.fallback(FallbackKind.CACHE_NOT_STORED,
                             f"cache_dir: a frozen graph could not be stored ({error}); it is compiled "
                             "again in every process")

    def frozen_code(self, stored: dict, inputs: list, kinds: list[str]) -> frozen_code.LoadedCode | str:
        """A level-2 frozen entry's compiled code, its constants made from `inputs`
        (this process's weights); or why the entry does not fit them."""
        weights = frozen_weights(stored["frozen"], inputs, kinds)
        if isinstance(weights, str):
            return weights
        constants = frozen_code.make_constants(stored["constants"], stored["frozen"], weights)
        if isinstance(constants, str):
            return constants
        with inductor_constants.constants_supplied(constants):
            code = trace_graph.load_inductor(stored["code"])
        return frozen_code.LoadedCode(code, stored, weights, constants)

    def graphs(self, stored: dict | None, inputs: list,
               kinds: list[str]) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule | None] | None:
        """A level-1 entry's lowered and final graphs, the frozen values folded again
        from `inputs`; None without an entry or where the values differ from what the
        passes read (then reported: the graph is compiled again)."""
        if stored is None:
            return None
        if "frozen" not in stored:
            return cache.load_graph(stored["lowered"]), self.final_graph(stored)
        bound = bind(stored, inputs, kinds)
        if isinstance(bound, str):
            self.report.fallback(FallbackKind.CACHE_NOT_LOADED,
                                 f"cache_dir: a stored frozen graph is compiled again: {bound}")
            return None
        return bound

    def restore(self, stored: dict, record: GraphRecord) -> None:
        """The stored records into `record`."""
        self.disk.restore(stored, record)

    @staticmethod
    def final_graph(stored: dict) -> torch.fx.GraphModule | None:
        """The stored final graph; none for a frozen one, whose values `graphs` folds."""
        return cache.load_graph(stored["graph"]) if stored["graph"] is not None and "frozen" not in stored else None

    @staticmethod
    def frozen_key(key: str, inputs: list, covered: list[int]) -> str:
        """`key` covering the values of the inputs `covered` (`covered_weights`): for
        level-2 code that holds a constant made from them by value."""
        digest = hashlib.sha256("".join(f"{i}:{cache.tensor_digest(inputs[i])};" for i in covered).encode())
        return cache.cache_key(key, digest.hexdigest())

    @staticmethod
    def covered_weights(gm: torch.fx.GraphModule, inputs: list, kinds: list[str]) -> list[int]:
        """The inputs `frozen_key` covers: every parameter, and every buffer the Dynamo
        graph `gm` does not write (a KV cache changes every step). Found before the
        compile, which may rewrite `gm`."""
        lifted = len(inputs) - len(gm.graph.find_nodes(op="placeholder"))  # _aot_args' own parameters
        written = {lifted + i for i in written_buffers(gm, kinds[lifted:])}
        return [i for i in weight_indices(inputs, kinds) if i not in written]

    def store_choice(self, key: str | None, choice: dict) -> None:
        """graph_opt_level="auto": the level chosen for the graph of `key`, with its figures."""
        if key is not None and choice["level"] in tiers.LEVELS:
            self.disk.store(key, {k: v for k, v in choice.items() if k != "graph"})

    def load_choice(self, key: str | None) -> dict:
        """The choice `store_choice` stored for `key` (marked `cached`), or {}."""
        stored = self.load(key)
        if not isinstance(stored, dict) or stored.get("level") not in tiers.LEVELS:
            return {}
        return {**stored, "cached": True}

    def pass_uuid(self, level: int | str, fingerprint: str | Unkeyable) -> str:
        """What, besides the graph, decides what the passes make of it: the config
        fields they read and the user's patterns (`fingerprint`; graphopt and torch's
        versions are in every cache key). Inductor's FX graph cache keys on it too; ""
        where the patterns cannot be keyed, which Inductor takes as a pass it must not cache."""
        if isinstance(fingerprint, Unkeyable):
            return ""
        config = self.config
        fields = {"graph_opt_level": level, "disabled_passes": sorted(config.disabled_passes),
                  "freeze_parameters": config.freeze_parameters,
                  "compute_dtype": config.compute_dtype, "precision_tolerance": config.precision_tolerance,
                  "weight_quantization": config.weight_quantization,
                  "token_agreement_steps": config.token_agreement_steps,
                  "inductor_compile_config": config.inductor_compile_config}
        return cache.cache_key(json.dumps(fields, sort_keys=True), fingerprint)


def weight_indices(inputs: list, kinds: list[str]) -> list[int]:
    """The inputs a frozen key may cover: real tensors that are parameters or buffers."""
    return [i for i, (x, kind) in enumerate(zip(inputs, kinds))
            if kind in WEIGHT_KINDS and isinstance(x, torch.Tensor) and not fake.is_fake(x)]


def written_buffers(gm: torch.fx.GraphModule, kinds: list[str]) -> set[int]:
    """The buffers a Dynamo graph writes in place (`cache[slots] = k`, `cache.copy_(...)`),
    found through the views of them it writes: their values are not the code's."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    written = set()
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", str(node.target))
        in_place = node.target is operator.setitem or (name.endswith("_") and not name.endswith("__"))
        if node.op in ("call_function", "call_method") and in_place:
            base = node.args[0] if node.args else None
            while isinstance(base, torch.fx.Node) and base.op != "placeholder" and base.args:
                base = base.args[0]
            if isinstance(base, torch.fx.Node) and base in placeholders:
                written.add(placeholders.index(base))
    return {i for i in written if i < len(kinds) and kinds[i] == "buffer"}


def frozen_entry(graph: torch.fx.GraphModule, inputs: list) -> dict:
    """What a later process needs to fold a frozen graph's values from its own weights:
    where each frozen input is among the graph's inputs, each folded value's recipe
    (in folding order, without the values it reads), and the digests of the values a
    pass may have read. Raises ValueError where a recipe cannot be stored."""
    frozen, recipes = graph.meta.get(FROZEN_INPUTS, {}), graph.meta.get(FOLDED_RECIPES, {})
    places = {}
    for name, value in frozen.items():
        places[name] = next((i for i, x in enumerate(inputs) if x is value), None)
        if places[name] is None:
            raise ValueError(f"its frozen input {name} is not one of the graph's inputs")
    read = {name: cache.tensor_digest(getattr(graph, name)) for name in recipes
            if may_be_read(getattr(graph, name))}
    return {"inputs": places, "values": list(recipes), "read": read,
            "recipes": [(name, cache.dump_graph(recipe, recipes)) for name, recipe in recipes.items()]}


def frozen_weights(frozen: dict, inputs: list, kinds: list[str]) -> dict[str, torch.Tensor] | str:
    """The weights a frozen entry's recipes read, by name, among `inputs`; or why they are not there."""
    if any(i >= len(inputs) or kinds[i] not in WEIGHT_KINDS for i in frozen["inputs"].values()):
        return "an input it froze is not a parameter or buffer here"
    return {name: inputs[i] for name, i in frozen["inputs"].items()}


def fold(frozen: dict, inputs: list, kinds: list[str]) -> tuple[dict, dict, dict] | str:
    """A frozen entry's folded values computed from `inputs` (this process's weights),
    with the weights and recipes they came from; or why the entry does not fit them."""
    weights = frozen_weights(frozen, inputs, kinds)
    if isinstance(weights, str):
        return weights
    values: dict[str, torch.Tensor] = {}
    recipes: dict[str, torch.fx.GraphModule] = {}
    # Outside inference mode: refresh() updates the values in place later.
    with fake.outside_fake_mode(), torch.inference_mode(False), torch.no_grad():
        for name, dumped in frozen["recipes"]:
            recipe = recipes[name] = cache.load_graph(dumped, values)
            values[name] = recipe(*[weights[p.target] for p in recipe.graph.find_nodes(op="placeholder")])
    changed = frozen_code.read_changed(frozen, values.__getitem__)
    if changed is not None:
        return changed
    return weights, values, recipes


def bind(stored: dict, inputs: list, kinds: list[str]) -> tuple[torch.fx.GraphModule, Any] | str:
    """The stored level-1 graphs with their folded values computed from `inputs`, and
    the final graph set up for refresh(); or why the entry does not fit them."""
    folded = fold(stored["frozen"], inputs, kinds)
    if isinstance(folded, str):
        return folded
    weights, values, recipes = folded
    final = cache.load_graph(stored["graph"], values) if stored["graph"] is not None else None
    if final is not None:
        final.meta[FROZEN_INPUTS], final.meta[FOLDED_RECIPES] = weights, recipes
    return cache.load_graph(stored["lowered"], values), final
