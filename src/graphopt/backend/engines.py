"""The engines the executors' race runs a graph on (executors.py): the Dynamo graph
exported to ONNX once, then a session per engine and precision.

    ONNX model -> ONNX Runtime CPU session, ORT_ENABLE_ALL               (float32)
               -> OpenVINO CPU plugin, INFERENCE_PRECISION_HINT=f32      (float32)
               -> OpenVINO CPU plugin, INFERENCE_PRECISION_HINT=bf16     (compute_dtype="bfloat16" only)

Each engine runs at the precision the user allowed and no lower. OpenVINO's CPU plugin
computes a float32 model in bfloat16 by default where the CPU has bfloat16 units, so
float32 is always asked for by name; its bfloat16 hint (products in bfloat16, what its
plugin decides stays float32 stays so, as compute_dtype does) is a candidate only where
the user asked for bfloat16. ONNX Runtime's CPU provider has no bfloat16 compute mode
on x86: its one such option (`mlas.enable_gemm_fastmath_arm64_bfloat16`) is for ARM64's
GEMMs, and a model converted to bfloat16 tensors finds CPU kernels for few of its ops.
So it races in float32 only.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
from typing import Any, Callable, Iterator, Sequence

import torch

from .._compat import fake

# The precisions each engine runs a float32 graph at: its float32 one first.
PRECISIONS: dict[str, tuple[str, ...]] = {"onnxruntime": ("f32",), "openvino": ("f32", "bf16")}
# What a precision's name means, for the report.
DTYPES = {"f32": "float32", "bf16": "bfloat16"}


def candidates(engines: Sequence[str], bfloat16: bool) -> list[tuple[str, str]]:
    """(engine, precision) of each candidate: every engine in float32, and in bfloat16
    where `bfloat16` (the user allowed it and the CPU computes it natively)."""
    return [(engine, precision) for engine in engines for precision in PRECISIONS[engine]
            if precision == "f32" or bfloat16]


def name(engine: str, precision: str) -> str:
    """A candidate's name in the race and the report: the engine, and its precision below float32."""
    return engine if precision == "f32" else f"{engine}-{precision}"


def export(module: torch.nn.Module, live: Sequence[torch.Tensor], dynamic_shapes: tuple) -> bytes:
    """`module` (executors' _Bound) as a serialized ONNX model."""
    import onnx  # noqa: F401  (the exporter needs onnx and onnxscript)
    import onnxscript  # noqa: F401

    with quiet_export(), fake.outside_fake_mode(), torch.no_grad():
        program = torch.onnx.export(module, tuple(live), dynamo=True, dynamic_shapes=dynamic_shapes)
    return program.model_proto.SerializeToString()


def runner(engine: str, precision: str, model: bytes) -> Callable[[list], list]:
    """`model` run by `engine` at `precision` on the threads torch would use (a fair race):
    numpy arrays in, torch tensors out."""
    threads = torch.get_num_threads()
    if engine == "onnxruntime":
        session = onnxruntime_session(model, threads)
        names = [i.name for i in session.get_inputs()]
        return lambda arrays: [torch.from_numpy(o) for o in session.run(None, dict(zip(names, arrays)))]
    return openvino_runner(model, threads, precision)


def onnxruntime_session(model: bytes, threads: int, options: Any = None) -> Any:
    """An ONNX Runtime CPU session of an ONNX model at ORT_ENABLE_ALL on `threads` threads
    (on top of `options`, a SessionOptions, when given)."""
    import onnxruntime

    options = options or onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    # ORT's idle threads spin by default, which takes the cores from torch's own ops
    # (and from whichever contender runs next in a benchmark's round).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def openvino_runner(model: bytes, threads: int, precision: str = "f32") -> Callable[[list], list]:
    """An ONNX model compiled by OpenVINO's CPU plugin at `precision` ("f32" or "bf16",
    its INFERENCE_PRECISION_HINT), on `threads` threads: numpy arrays in, torch tensors out."""
    import openvino

    core = openvino.Core()
    with tempfile.TemporaryDirectory() as folder:  # OpenVINO reads an ONNX model from a file
        path = os.path.join(folder, "graph.onnx")
        with open(path, "wb") as f:
            f.write(model)
        compiled = core.compile_model(core.read_model(path), "CPU", openvino_config(threads, precision))
    request = compiled.create_infer_request()
    # The request's output buffers are its own, overwritten by the next run: copied out.
    return lambda arrays: [torch.from_numpy(o.copy()) for o in request.infer(arrays).values()]


def openvino_config(threads: int, precision: str) -> dict[str, str]:
    """The CPU plugin's settings: the precision always named, since its default on CPUs
    with bfloat16 units is bfloat16."""
    return {"INFERENCE_NUM_THREADS": str(threads), "INFERENCE_PRECISION_HINT": precision}


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """The exporter prints its progress and logs warnings that concern no user."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript", "onnx_ir")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
