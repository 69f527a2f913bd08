"""graphopt: a graph optimization backend for PyTorch inference.

Capture a model's step as a graph, rewrite it (fold, fuse, re-inplace, plan memory),
optionally compile it with Inductor, and replay it as a device graph.
"""

from ._compat.dynamo import register_dynamo_backend
from .api.optimize import OptimizedFunction, OptimizedModule, optimize, support_graph_optimization
from .api.step import DynamicDims
from .backend.backend import Backend
from .backend.recompiles import RecompileError
from .backend.registry import backends, graphopt_backend
from .backend.tiers import wait_for_background
from .config import MODES, GraphOptimizationConfig
from .passes.base import PassResult
from .passes.checks import PassVerificationError
from .passes.fusion.replacement import fwd_only, register_replacement
from .report import FallbackKind, Report
from .runtime.analysis.safety import CaptureError, CaptureProblem, check
from .runtime.graphs import device_graph as DeviceGraph
from .runtime.graphs import graph_pool_handle

register_dynamo_backend("graphopt", graphopt_backend)

__all__ = [
    "Backend",
    "CaptureError",
    "CaptureProblem",
    "DeviceGraph",
    "DynamicDims",
    "FallbackKind",
    "GraphOptimizationConfig",
    "MODES",
    "OptimizedFunction",
    "OptimizedModule",
    "PassResult",
    "PassVerificationError",
    "RecompileError",
    "Report",
    "backends",
    "check",
    "fwd_only",
    "graph_pool_handle",
    "graphopt_backend",
    "optimize",
    "register_replacement",
    "support_graph_optimization",
    "wait_for_background",
]
