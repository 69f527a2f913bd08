"""The torch.compile backend: Dynamo graph -> AOTAutograd -> graphopt's passes.

Level 1 runs the rewritten functional ATen graph as FX code. Level 2 hands the
Dynamo graph to Inductor with graphopt's pipeline installed as Inductor's post-grad
custom pass, so Inductor generates kernels for the graph graphopt rewrote.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx

from . import _compat
from .config import GraphOptimizationConfig
from .lowering import lower_to_bindings
from .passes.fusion import fused_op_counts
from .passes.manager import PassManager, check_pass_names
from .passes.memory_plan import memory_record
from .report import GraphRecord, Report


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


class GraphoptCompiler:
    """A torch.compile backend bound to one config; it records every graph it
    compiles, and what the passes did to it, in `report`."""

    def __init__(self, config: GraphOptimizationConfig | None = None, report: Report | None = None):
        self.config = config or GraphOptimizationConfig()
        check_pass_names(self.config.disabled_passes)
        self.report = report or Report(self.config.graph_opt_level)
        self.graph_modules: list[torch.fx.GraphModule] = []
        # Set once Dynamo hands over a graph with a symbolic size: from then on a new
        # batch size finds that graph, so callers can stop marking dynamic dims.
        self.compiled_dynamic = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        self.compiled_dynamic |= any(isinstance(x, torch.SymInt) for x in example_inputs)
        level = self.config.graph_opt_level
        if level == 0:
            return gm.forward
        record = GraphRecord(index=len(self.report.graphs))
        self.report.graphs.append(record)
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

            device = _device_type(real_inputs)
            compiled = _compat.inductor_compile(gm, example_inputs, post_grad_pass,
                                                self._pass_uuid(), inductor_options(device))
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
                if kind in ("parameter", "buffer")}
        verify_inputs = None
        if self.config.verify:
            if matched:
                verify_inputs = inputs
            else:
                self.report.fallback("verify skipped: the ATen graph's inputs do not match Dynamo's "
                                     "example inputs (AOTAutograd added or merged inputs)")
        if self.config.freeze_parameters and not matched:
            self.report.fallback("freeze_parameters: the ATen graph's inputs do not match Dynamo's "
                                 "example inputs, so parameters stay live inputs")
        PassManager(self.config, self.report).run(gm, record.index, verify_inputs)
        record.nodes_after = _count_ops(gm.graph)
        memory = memory_record(gm, record.index)  # set by the plan_memory pass
        if memory is not None:
            self.report.memory.append(memory)
        record.fused_ops = fused_op_counts(gm.graph)
        self.graph_modules.append(gm)

    def _pass_uuid(self) -> str:
        sources = sorted(Path(__file__).parent.rglob("*.py"))
        digest = hashlib.sha256(json.dumps(self.config.to_dict(), default=str, sort_keys=True).encode())
        for path in sources:
            digest.update(path.read_bytes())
        return digest.hexdigest()


def graphopt_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                     options: dict[str, Any] | None = None) -> Callable:
    """`torch.compile(model, backend="graphopt", options={...})`: options are
    GraphOptimizationConfig keys."""
    config = GraphOptimizationConfig.from_dict(options or {})
    return GraphoptCompiler(config)(gm, example_inputs)


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


def _device_type(inputs: list) -> str:
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            return x.device.type
    return "cpu"
