"""GraphOptimizationConfig: the one configuration every layer of graphopt reads.

The key names mirror FastDeploy's ``--graph-optimization-config`` (``graph_opt_level``,
``use_cudagraph``, ``cudagraph_capture_sizes``, ``max_num_seqs``) and TorchAir's
aclgraph options (``capture_error_mode``, ``clone_input``, ...), so a config written for
those engines reads the same here. Nothing is coerced: a wrong type or value is an
error that names the key and says what is accepted.

This module is also the one place where numerical tolerances are stated, and where
torch.compile's `mode=` is read as graphopt's keys (`MODES`, `with_mode`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from .config_checks import (
    aten_op_names,
    capture_sizes,
    check_bool,
    check_budget,
    check_choice,
    check_dump_dir,
    check_int,
    check_tolerance,
    describe,
    executors,
    inductor_compile_config,
    op_names,
    pass_names,
)

# Tolerances for comparing an optimized graph's outputs with eager's, by dtype: (atol, rtol).
TOLERANCES: Final[dict[torch.dtype, tuple[float, float]]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for comparing outputs of ``dtype``; integer and bool outputs must match exactly."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"tolerance() expects a torch.dtype, got {describe(dtype)}")
    if dtype.is_complex:
        dtype = dtype.to_real()
    if not dtype.is_floating_point:
        return (0.0, 0.0)
    return TOLERANCES.get(dtype, TOLERANCES[torch.float32])


GRAPH_OPT_LEVELS: Final = (0, 1, 2)
# graph_opt_level="auto": each graph compiled at levels 1 and 2, both timed on its first
# call's inputs, the faster kept (tiers.py).
AUTO_LEVEL: Final = "auto"
# When "auto" chooses: "first_call", before the first call returns (both levels compiled in
# it); "background", level 1 serves from the first call while level 2's code is generated
# in a child process, and the first call after it arrives chooses (CPU only).
LEVEL_CHOICES: Final = ("first_call", "background")
CAPTURE_ERROR_MODES: Final = ("global", "thread_local", "relaxed")
CUDAGRAPH_MODES: Final = ("none", "piecewise", "full")
# cudagraph_capture_sizes="auto": sizes chosen from traffic (runtime/capture_plan.py).
AUTO_CAPTURE_SIZES: Final = "auto"
ON_RECOMPILE: Final = ("recompile", "warn", "error")
GUARDS: Final = ("all", "inputs")
COMPUTE_DTYPES: Final = ("bfloat16",)
WEIGHT_QUANTIZATIONS: Final = ("int8", "int4")


CACHE_DIR_ENV: Final = "GRAPHOPT_CACHE_DIR"


def default_cache_dir() -> str | None:
    """`$GRAPHOPT_CACHE_DIR` (set but empty: no cache), else `graphopt` under the
    user's cache directory (`$XDG_CACHE_HOME`, or `~/.cache`)."""
    if CACHE_DIR_ENV in os.environ:
        return os.environ[CACHE_DIR_ENV] or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "graphopt")


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """The capture sizes used when none are given: FastDeploy's candidates up to ``max_num_seqs``.

    ``max_num_seqs`` itself is always captured, so the largest batch never runs without a graph.
    """
    check_int("max_num_seqs", max_num_seqs, minimum=1)
    candidates = (
        [1, 2, 4]
        + [8 * i for i in range(1, 17)]  # 8 .. 128
        + [16 * i for i in range(9, 17)]  # 144 .. 256
        # FastDeploy's code has range(17, 33), which skips 288..512 against its own comment.
        + [32 * i for i in range(9, 33)]  # 288 .. 1024
    )
    sizes = [size for size in candidates if size <= max_num_seqs]
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


@dataclass
class GraphOptimizationConfig:
    """How graphopt optimizes and replays a model. See DESIGN.md for the vocabulary."""

    # "auto": each graph runs the faster of levels 1 and 2, by measurement (backend/tiers.py).
    graph_opt_level: int | str = AUTO_LEVEL
    # With "auto": when the level is chosen, one of LEVEL_CHOICES.
    level_choice: str = "first_call"
    use_cudagraph: bool = True
    # Resolved in __post_init__: a sorted list without duplicates afterwards, or "auto".
    cudagraph_capture_sizes: list[int] | str | None = None
    max_num_seqs: int = 256
    # With "auto" sizes: calls between two plans of the capture sizes.
    capture_replan_interval: int = 64
    # Bytes the graph pools (CUDA pools, host arenas) of one Backend may hold together; None: no limit.
    graph_memory_budget: int | None = None
    # What a recompile (a Dynamo guard failed) does: "recompile", "warn" once per guard, or "error".
    on_recompile: str = "recompile"
    cudagraph_num_of_warmups: int = 1
    # None: "full" where the whole graph can be captured, else "piecewise".
    cudagraph_mode: str | None = None
    # ATen ops ("aten.index_put_" or "aten.index_put_.default") a graph is split at
    # in piecewise mode, besides the ops no device graph can replay.
    cudagraph_splitting_ops: list[str] = field(default_factory=list)
    # Custom ops ("mylib::op" or "mylib.op") whose outputs' rows come from the same rows of
    # their inputs: padding a batch through them is legal (runtime/analysis/rows.py).
    rowwise_ops: list[str] = field(default_factory=list)
    capture_error_mode: str = "thread_local"
    # An opaque pool handle shared by every device graph of this config; never serialised.
    graph_pool: object = None
    reuse_pool_in_same_graph: bool = True
    clone_input: bool = True
    clone_output: bool = False
    # False keeps parameters as live inputs so in-place weight updates are seen.
    freeze_parameters: bool = False
    disabled_passes: list[str] = field(default_factory=list)
    debug_dump_dir: str | None = None
    verify: bool = False
    # The persistent compile cache (cache.py); None switches it off.
    cache_dir: str | None = field(default_factory=default_cache_dir)
    # With the cache on: also store Dynamo's trace of each step (traces.py), so a later
    # process does not trace it again.
    cache_traces: bool = True
    # Inductor config keys for level 2, on top of graphopt's own (vLLM's inductor_compile_config).
    inductor_compile_config: dict[str, Any] = field(default_factory=dict)
    # Engines ("onnxruntime", "openvino") each stateless graph is also timed on at compile
    # time; the fastest whose outputs equal eager's runs it (executors.py). Empty: graphopt only.
    executors: list[str] = field(default_factory=list)
    # Which of Dynamo's guards a call checks (guards.py): "all", or "inputs" where the
    # module's Python state is trusted not to change after the first call.
    guards: str = "all"
    # The dtype matmuls, convolutions and attention compute in (passes/precision.py); None:
    # the model's own. Inputs, outputs, norms' statistics and softmax keep the model's dtype.
    compute_dtype: str | None = None
    # With compute_dtype or weight_quantization: the error allowed, measured at compile time
    # (passes/lowered_error.py): for a causal LM's graph the mean KL divergence of its next-token
    # distributions in nats, else the largest error as a fraction of the output's largest
    # magnitude; past it the graph keeps full precision. None: no bound.
    precision_tolerance: float | None = 0.05
    # Linears' frozen weights in fewer bits (passes/quantize.py), level 1, 2 or auto: "int8", a scale per
    # output channel; "int4", a scale and a zero per group of 32 input channels (CPU only).
    weight_quantization: str | None = None
    # With compute_dtype or weight_quantization, for a causal LM: how many positions of each
    # sequence the greedy-token agreement with full precision compares (reported, not bounded).
    token_agreement_steps: int = 32

    def __post_init__(self) -> None:
        if self.graph_opt_level != AUTO_LEVEL:
            check_int("graph_opt_level", self.graph_opt_level, choices=GRAPH_OPT_LEVELS, or_else=AUTO_LEVEL)
        check_choice("level_choice", self.level_choice, LEVEL_CHOICES)
        check_bool("use_cudagraph", self.use_cudagraph)
        # max_num_seqs is checked first because the default sizes are derived from it.
        check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        if self.cudagraph_capture_sizes is None:
            self.cudagraph_capture_sizes = default_capture_sizes(self.max_num_seqs)
        elif self.cudagraph_capture_sizes != AUTO_CAPTURE_SIZES:
            self.cudagraph_capture_sizes = capture_sizes(self.cudagraph_capture_sizes)
        check_int("capture_replan_interval", self.capture_replan_interval, minimum=1)
        check_budget(self.graph_memory_budget)
        check_choice("on_recompile", self.on_recompile, ON_RECOMPILE)
        check_choice("guards", self.guards, GUARDS)
        check_choice("compute_dtype", self.compute_dtype, COMPUTE_DTYPES, optional=True)
        check_tolerance("precision_tolerance", self.precision_tolerance)
        check_choice("weight_quantization", self.weight_quantization, WEIGHT_QUANTIZATIONS, optional=True)
        if self.weight_quantization is not None and (not self.freeze_parameters or self.graph_opt_level == 0):
            raise ValueError(f"weight_quantization={self.weight_quantization!r} quantizes frozen weights at compile "
                             "time, at level 1, 2 or 'auto': it needs freeze_parameters=True and a level above 0")
        check_int("token_agreement_steps", self.token_agreement_steps, minimum=1)
        check_int("cudagraph_num_of_warmups", self.cudagraph_num_of_warmups, minimum=0)
        check_choice("cudagraph_mode", self.cudagraph_mode, CUDAGRAPH_MODES, optional=True)
        self.cudagraph_splitting_ops = aten_op_names(self.cudagraph_splitting_ops)
        self.rowwise_ops = op_names("rowwise_ops", self.rowwise_ops)
        check_choice("capture_error_mode", self.capture_error_mode, CAPTURE_ERROR_MODES)
        for key in ("reuse_pool_in_same_graph", "clone_input", "clone_output", "freeze_parameters", "cache_traces"):
            check_bool(key, getattr(self, key))
        self.disabled_passes = pass_names(self.disabled_passes)
        check_dump_dir(self.debug_dump_dir)
        check_bool("verify", self.verify)
        self.cache_dir = _cache_dir(self.cache_dir)
        self.inductor_compile_config = inductor_compile_config(self.inductor_compile_config,
                                                                self.freeze_parameters)
        self.executors = executors(self.executors, self.freeze_parameters)

    @property
    def auto_capture_sizes(self) -> bool:
        """Whether capture sizes are chosen from traffic (`cudagraph_capture_sizes="auto"`)."""
        return self.cudagraph_capture_sizes == AUTO_CAPTURE_SIZES

    def largest_capture_size(self) -> int:
        """The largest batch that may get a device graph: with "auto", max_num_seqs."""
        return self.max_num_seqs if self.auto_capture_sizes else max(self.cudagraph_capture_sizes)

    def pass_enabled(self, name: str) -> bool:
        """Whether the graph pass ``name`` should run ("*" in disabled_passes turns all off)."""
        return "*" not in self.disabled_passes and name not in self.disabled_passes

    def replace(self, **changes: Any) -> GraphOptimizationConfig:
        """A new, validated config with ``changes`` applied.

        Sizes that were the defaults for the old ``max_num_seqs`` follow a new one;
        sizes given explicitly stay as they are.
        """
        _check_keys(changes, _KEYS)
        if (
            "max_num_seqs" in changes
            and "cudagraph_capture_sizes" not in changes
            and self.cudagraph_capture_sizes == default_capture_sizes(self.max_num_seqs)
        ):
            changes["cudagraph_capture_sizes"] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it would deep-copy graph_pool, which must stay the same handle.
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        sizes = self.cudagraph_capture_sizes
        data["cudagraph_capture_sizes"] = sizes if sizes == AUTO_CAPTURE_SIZES else list(sizes or ())
        data["disabled_passes"] = list(self.disabled_passes)
        data["cudagraph_splitting_ops"] = list(self.cudagraph_splitting_ops)
        data["rowwise_ops"] = list(self.rowwise_ops)
        data["inductor_compile_config"] = dict(self.inductor_compile_config)
        data["executors"] = list(self.executors)
        return data

    def to_json(self) -> str:
        """The command-line form of this config; graph_pool is left out (it is not data)."""
        data = self.to_dict()
        del data["graph_pool"]
        return json.dumps(data)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GraphOptimizationConfig:
        if not isinstance(d, Mapping):
            raise TypeError(f"graph optimization config must be a mapping of keys to values, got {describe(d)}")
        _check_keys(d, _KEYS)
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> GraphOptimizationConfig:
        """Parse the command-line form, e.g. ``'{"graph_opt_level": 1, "cudagraph_capture_sizes": [1, 3]}'``."""
        if not isinstance(text, str):
            raise TypeError(f"graph optimization config JSON must be a str, got {describe(text)}")
        try:
            data = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"graph optimization config is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
            ) from None
        if not isinstance(data, dict):
            raise ValueError(
                'graph optimization config JSON must be an object like {"graph_opt_level": 1}, '
                f"got a JSON {_json_kind(data)}"
            )
        if "graph_pool" in data:
            raise ValueError(
                "graph_pool cannot come from JSON: a pool handle is a live Python object; "
                "pass it in Python, e.g. cfg.replace(graph_pool=pool)"
            )
        return cls.from_dict(data)


_KEYS: Final = tuple(f.name for f in dataclasses.fields(GraphOptimizationConfig))


_AUTOTUNE = {"max_autotune": True}
# torch's meanings, in graphopt's keys: device graphs are graphopt's, not Inductor's.
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "reduce-overhead": {"use_cudagraph": True},
    "max-autotune-no-cudagraphs": {"graph_opt_level": 2, "use_cudagraph": False,
                                   "inductor_compile_config": _AUTOTUNE},
    "max-autotune": {"graph_opt_level": 2, "use_cudagraph": True, "inductor_compile_config": _AUTOTUNE},
}


def with_mode(config: GraphOptimizationConfig, mode: str | None) -> tuple[GraphOptimizationConfig, list[str]]:
    """`config` with `mode`'s keys where it keeps the default, and a sentence for
    each key where the user's value wins over the mode's. `options` and a Backend's
    own config are both "what the user gave"."""
    if mode is None:
        return config, []
    if mode not in MODES:
        raise ValueError(f"unknown torch.compile mode {mode!r} for backend 'graphopt'; known modes: "
                         f"{', '.join(repr(m) for m in MODES)}")
    defaults = GraphOptimizationConfig()
    changes: dict[str, Any] = {}
    kept: list[str] = []
    for key, wanted in MODES[mode].items():
        given, default = getattr(config, key), getattr(defaults, key)
        if key == "inductor_compile_config":
            merged = {**wanted, **given}
            kept += [f"mode={mode!r} sets inductor_compile_config[{k!r}]={v!r}, the config's {given[k]!r} is used"
                     for k, v in wanted.items() if k in given and given[k] != v]
            changes[key] = merged
        elif given == default:
            changes[key] = wanted
        elif given != wanted:
            kept.append(f"mode={mode!r} sets {key}={wanted!r}, the config's {given!r} is used")
    if not changes:
        return config, kept
    return config.replace(**changes), kept


def _cache_dir(value: object) -> str | None:
    accepted = ("cache_dir must be a directory path (str or os.PathLike) or null to switch the "
                f"compile cache off (${CACHE_DIR_ENV}='' does the same for the default)")
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{accepted}, got {describe(value)}")
    path = os.fspath(value)
    if path == "":
        raise ValueError(f"{accepted}, got an empty string")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{accepted}, got {path!r}, which is a file")
    return path


def _check_keys(d: Mapping[Any, Any], accepted: tuple[str, ...]) -> None:
    for key in d:
        if key in accepted:
            continue
        hint = "."
        if isinstance(key, str) and (close := difflib.get_close_matches(key, accepted, n=1)):
            hint = f"; did you mean {close[0]!r}?"
        raise ValueError(
            f"unknown graph optimization config key {key!r}{hint} Accepted keys: {', '.join(accepted)}"
        )


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json would otherwise keep the last value silently.
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"graph optimization config JSON gives key {key!r} more than once")
        seen[key] = value
    return seen


def _json_kind(value: object) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", type(None): "null"}
    return kinds.get(type(value), "number")
