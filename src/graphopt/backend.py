"""Backend: the torch.compile backend that owns graphopt's whole pipeline.

For each graph Dynamo hands it:

    Dynamo graph -> [split at splitting ops] -> AOTAutograd -> passes -> level 1 FX code | level 2 Inductor
                 -> GraphRunner (device graphs, one per capture size) -> back to Dynamo

Level 1 runs the rewritten functional ATen graph as FX code. Level 2 hands the
Dynamo graph to Inductor with graphopt's pipeline installed as Inductor's post-grad
custom pass. With device graphs on, what goes back to Dynamo is the runtime
wrapping the compiled graph, so Dynamo's guards run before every replay.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx

from . import _compat
from .config import GraphOptimizationConfig
from .lowering import lower_to_bindings
from .passes.fusion import fused_op_counts
from .passes.manager import PassManager, check_pass_names
from .passes.memory_plan import memory_record
from .report import GraphRecord, Report

# Graphs each Backend may add to Dynamo's per-function recompile limit: batch size 1
# (specialised), the dynamic graph, and recompiles after guarded changes.
RECOMPILE_BUDGET = 8


def inductor_options(device_type: str) -> dict[str, Any]:
    """The Inductor settings graphopt uses at level 2 (measured: README, "Level 2")."""
    options: dict[str, Any] = {
        # graphopt's report must describe every graph: a cache hit would skip the passes.
        "fx_graph_cache": False,
    }
    if device_type == "cpu":
        # A C++ wrapper instead of a Python one: the decode step of the tiny decoder
        # runs ~2x faster (100 vs 196 us at batch 1) for ~2x the compile time.
        options["cpp_wrapper"] = True
    if device_type == "cuda":
        # graphopt's GraphRunner owns device graphs; Inductor's own would nest inside it.
        options["triton.cudagraphs"] = False
    return options


class Backend:
    """A torch.compile backend bound to one config: `torch.compile(model, backend=Backend(cfg))`.

    `dynamic_dims` ({argument: dim}) says which dim of which `forward` argument is
    the batch (default: dim 0 of the first tensor argument with a symbolic one);
    `pad_values` ({argument: value}) what padded rows of that argument hold.
    `report()` describes every graph it compiled and every device graph it ran.
    """

    def __init__(self, config: GraphOptimizationConfig | None = None, *,
                 dynamic_dims: Mapping[str, int] | None = None,
                 pad_values: Mapping[str, float | int] | None = None):
        self.config = config or GraphOptimizationConfig()
        check_pass_names(self.config.disabled_passes)
        self.dynamic_dims = dynamic_dims
        self.pad_values = dict(pad_values or {})
        self._report = Report(self.config.graph_opt_level)
        self._report.capture_sizes = list(self.config.cudagraph_capture_sizes)
        self.graph_modules: list[torch.fx.GraphModule] = []
        # Set once Dynamo hands over a graph with a symbolic size: from then on a new
        # batch size finds that graph, so callers can stop marking dynamic dims.
        self.compiled_dynamic = False
        self._levels: dict[str, int] = {}
        _compat.allow_recompiles(RECOMPILE_BUDGET)
        _compat.on_recompile_limit(self._gave_up)

    def report(self) -> Report:
        return self._report

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        self.compiled_dynamic |= any(isinstance(x, torch.SymInt) for x in example_inputs)
        if _compat.is_recompile():
            self._report.recompiles += 1
        device = _device_type(example_inputs)
        level = self._level(device)
        mode = self._cudagraph_mode(level, device)
        if mode == "none":
            return self._compile(gm, example_inputs, level)
        from .runtime import piecewise
        from .runtime.capture import CapturedGraph, Pool
        from .runtime.fake_run import fake_run
        from .runtime.runner import GraphRunner
        from .runtime.signature import signature_of

        graph_index = len(self._report.pieces)
        try:
            findings = fake_run(gm, example_inputs, self.config.cudagraph_splitting_ops)
        except Exception as error:  # noqa: BLE001 - the graph still runs; only device graphs are lost
            self._report.fallback(f"use_cudagraph: graph {graph_index} could not be run on fake tensors to "
                                  f"find its splitting ops and written inputs ({type(error).__name__}: "
                                  f"{error}); it runs without device graphs")
            return self._compile(gm, example_inputs, level)
        signature = signature_of(gm, self.dynamic_dims, self.pad_values, findings.written)
        unsafe = findings.splitting_nodes
        pool = Pool(self.config)
        if unsafe and mode == "full":
            reasons = "; ".join(sorted(set(unsafe.values())))
            self._report.fallback(f"use_cudagraph: cudagraph_mode='full' and graph {graph_index} has ops a "
                                  f"device graph cannot replay, so it runs without one: {reasons}")
            return self._compile(gm, example_inputs, level)
        if not unsafe:
            record = self._report.piece(graph_index, None)
            captured = [CapturedGraph(self._compile(gm, example_inputs, level), record, self.config,
                                      self._report, pool, signature.static)]
            return GraphRunner(captured[0], signature, captured, self.config, self._report)
        split_gm, unsafe_pieces = piecewise.split(gm, unsafe)
        real = dict(zip([n.name for n in gm.graph.nodes if n.op == "placeholder"], example_inputs))
        captured = []

        def compile_piece(name: str, piece: torch.fx.GraphModule, fakes: list) -> Callable | None:
            inputs = [n.name for n in piece.graph.nodes if n.op == "placeholder"]
            # A number an earlier piece computes (`.item()`) changes every call: a capture would freeze it.
            numbers = [n for n, fake in zip(inputs, fakes) if not isinstance(fake, torch.Tensor) and n not in real]
            if numbers and name not in unsafe_pieces:
                unsafe_pieces[name] = f"it reads {numbers[0]}, a number computed at run time by an earlier piece"
            record = self._report.piece(graph_index, unsafe_pieces.get(name))
            if name in unsafe_pieces:
                return None
            # Top-level inputs are real (freezing and verify need values); intermediates stay fake.
            examples = [real.get(n, fake) for n, fake in zip(inputs, fakes)]
            # The graph's own inputs sit at fixed addresses; intermediates from eager pieces are copied in.
            wrapper = CapturedGraph(self._compile(piece, examples, level), record, self.config, self._report,
                                    pool, static=[n in real for n in inputs])
            captured.append(wrapper)
            return wrapper

        piecewise.compile_pieces(split_gm, example_inputs, compile_piece)
        return GraphRunner(split_gm, signature, captured, self.config, self._report)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], level: int) -> Callable:
        """Compile one Dynamo graph (or piece of one) at `level`."""
        if level == 0:
            return gm.forward
        record = GraphRecord(index=len(self._report.graphs))
        self._report.graphs.append(record)
        real_inputs = _aot_args(gm, [_compat.concrete(x) for x in example_inputs])
        kinds = ["parameter"] * (len(real_inputs) - len(example_inputs)) + _compat.input_kinds(gm)
        start = time.perf_counter()
        if level == 1:
            def fw_compiler(aot_gm: torch.fx.GraphModule, _fake_inputs: list) -> Callable:
                self._optimize(aot_gm, record, real_inputs, kinds)
                return _compat.boxed(lower_to_bindings(aot_gm))

            compiled = _compat.aot_inference(gm, example_inputs, fw_compiler)
        else:
            def post_grad_pass(graph: torch.fx.Graph) -> None:
                self._optimize(graph.owning_module, record, real_inputs, kinds)

            options = inductor_options(_device_type(real_inputs))
            compiled = _compat.inductor_compile(gm, example_inputs, post_grad_pass, self._pass_uuid(), options)
        record.compile_seconds = time.perf_counter() - start
        return compiled

    def _optimize(self, gm: torch.fx.GraphModule, record: GraphRecord, inputs: list, kinds: list[str]) -> None:
        """Run the level's passes on the ATen graph `gm`, whose placeholders take
        `inputs` (real tensors; `kinds` says which are parameters and buffers)."""
        record.nodes_before = _count_ops(gm.graph)
        gm.meta["graphopt_level"] = self.config.graph_opt_level
        matched = _inputs_match(gm, inputs)
        if self.config.freeze_parameters and matched:
            # Constant folding may treat these as constants; mutated buffers it must skip itself.
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            gm.meta["graphopt_frozen_inputs"] = {
                node.name: value for node, value, kind in zip(placeholders, inputs, kinds)
                if kind in ("parameter", "buffer") and isinstance(value, torch.Tensor)
                and not _compat.is_fake(value)}
        verify_inputs = None
        if self.config.verify:
            if matched and not any(isinstance(x, torch.Tensor) and _compat.is_fake(x) for x in inputs):
                verify_inputs = inputs
            else:
                self._report.fallback("verify skipped: the ATen graph's inputs do not match Dynamo's "
                                      "example inputs (AOTAutograd added or merged inputs, or a piece "
                                      "of a split graph reads intermediate values)")
        if self.config.freeze_parameters and not matched:
            self._report.fallback("freeze_parameters: the ATen graph's inputs do not match Dynamo's "
                                  "example inputs, so parameters stay live inputs")
        PassManager(self.config, self._report).run(gm, record.index, verify_inputs)
        record.nodes_after = _count_ops(gm.graph)
        memory = memory_record(gm, record.index)  # set by the plan_memory pass
        if memory is not None:
            self._report.memory.append(memory)
        record.fused_ops = fused_op_counts(gm.graph)
        self.graph_modules.append(gm)

    def _level(self, device: str) -> int:
        """The level that runs on `device`: level 2 needs a C++ compiler on the CPU."""
        if device not in self._levels:
            level = self.config.graph_opt_level
            if level == 2 and device == "cpu" and not _compat.inductor_available():
                self._report.fallback("graph_opt_level=2: Inductor found no C++ compiler for CPU code; "
                                      "running level 1 (install gcc or clang to compile)")
                level = 1
            self._levels[device] = level
        return self._levels[device]

    def _cudagraph_mode(self, level: int, device: str) -> str:
        config = self.config
        if not config.use_cudagraph or config.cudagraph_mode == "none":
            return "none"
        if level == 2 and device == "cpu":
            self._report.fallback("use_cudagraph with graph_opt_level=2 on CPU: Inductor's C++ kernels "
                                  "bypass the dispatcher and cannot be recorded on a host graph; the "
                                  "compiled kernels run directly")
            return "none"
        return config.cudagraph_mode or "auto"

    def _gave_up(self, message: str) -> None:
        if self._report.graphs or self._report.pieces:
            self._report.fallback(f"Dynamo gave up compiling and runs a frame eagerly: {message}; "
                                  "raise torch._dynamo.config.recompile_limit")

    def _pass_uuid(self) -> str:
        sources = sorted(Path(__file__).parent.rglob("*.py"))
        digest = hashlib.sha256(json.dumps(self.config.to_dict(), default=str, sort_keys=True).encode())
        for path in sources:
            digest.update(path.read_bytes())
        return digest.hexdigest()


# One Backend per torch.compile(backend="graphopt", options=...) call: torch hands
# the same options dict to every graph of that call.
_backends_by_options: dict[int, tuple[dict, Backend]] = {}


def graphopt_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                     options: dict[str, Any] | None = None) -> Callable:
    """`torch.compile(model, backend="graphopt", options={...})`: options are
    GraphOptimizationConfig keys."""
    options = options if options is not None else {}
    entry = _backends_by_options.get(id(options))
    if entry is None or entry[0] is not options:
        entry = _backends_by_options[id(options)] = (options, Backend(GraphOptimizationConfig.from_dict(options)))
    return entry[1](gm, example_inputs)


def _aot_args(gm: torch.fx.GraphModule, inputs: list) -> list:
    """AOTAutograd's inputs: the Dynamo graph's own parameters and buffers (none
    when Dynamo lifts them, as torch >= 2.5 does), then Dynamo's inputs."""
    return [*dict(gm.named_parameters(remove_duplicate=False)).values(),
            *dict(gm.named_buffers(remove_duplicate=False)).values(), *inputs]


def _inputs_match(gm: torch.fx.GraphModule, inputs: list) -> bool:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        return False
    for node, value in zip(placeholders, inputs):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) != isinstance(value, torch.Tensor):
            return False
        if isinstance(val, torch.Tensor) and (val.dim() != value.dim() or val.dtype != value.dtype):
            return False
    return True


def _count_ops(graph: torch.fx.Graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function")


def _device_type(inputs: Sequence[Any]) -> str:
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            return x.device.type
    return "cpu"
