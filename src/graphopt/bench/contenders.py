"""The contenders: eager, `torch.compile`, graphopt's levels with and without
device graphs, and ONNX Runtime and OpenVINO's `torch.compile` backend when they
are installed. Each one turns a workload's target into a step the workload's cases
can call."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..api.optimize import optimize
from ..backend.engines import onnxruntime_session, openvino_runner, quiet_export
from ..config import GraphOptimizationConfig
from ..config_checks import EXECUTORS
from ..report import FallbackKind, Report, first_line
from .measure import GraphFigures
from .workloads import Step, Workload


class Unavailable(Exception):
    """A contender that cannot run a workload here; the message says why (one line)."""


@dataclass(frozen=True)
class Contender:
    """`key` is what `--contenders` takes; `name` is what the tables show."""

    key: str
    name: str
    kind: str                 # eager | torch.compile | torchao | graphopt | onnxruntime | openvino(-onnx) | llama.cpp
    level: int | str = 0      # graph_opt_level: 0, 1, 2 or "auto"
    device_graphs: bool = False
    mode: str | None = None   # torch.compile's mode
    tuned: bool = False       # graphopt with frozen weights and Inductor's autotuned GEMMs (TUNED)
    frozen: bool = False      # graphopt with freeze_parameters=True (folded and packed weights)
    engines: bool = False     # and executors= the installed engines: each stateless graph on the fastest
    auto_sizes: bool = False  # cudagraph_capture_sizes="auto": capture sizes chosen from the traffic
    trusted: bool = False     # guards="inputs": only the guards on the step's arguments are checked
    defaults: bool = False    # optimize(model) with no config: what a user gets without options
    compute_dtype: str | None = None        # lower-precision math (frozen weights converted once)
    weight_quantization: str | None = None  # weight-only quantized linears (frozen weights; torchao's too)
    model_dtype: str | None = None          # the model cast to it before compiling
    tolerance: float | None = None          # graphopt's precision_tolerance, and the bound its error is judged by

    @property
    def lowered(self) -> bool:
        """Whether it computes in less than the model's precision: its outputs are judged by
        their error against eager's, not by eager's rounding."""
        return any(x is not None for x in (self.compute_dtype, self.weight_quantization, self.model_dtype))

    @property
    def weight_format(self) -> str | None:
        """The format its linears' weights are read in; None: the model's own."""
        return self.weight_quantization or self.compute_dtype or self.model_dtype

    @property
    def model_torch_dtype(self) -> torch.dtype | None:
        """The dtype the model is cast to before compiling; None: the model's own."""
        return getattr(torch, self.model_dtype) if self.model_dtype else None

    @property
    def competitor(self) -> bool:
        """Whether graphopt is measured against it (everything that is not graphopt)."""
        return self.kind != "graphopt"


# Level 2's opt-in Inductor options per device (docs/configuration.md, "Level 2: Inductor"):
# GEMMs autotuned over Inductor's templates, which pack the frozen weights.
TUNED = {"cpu": {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"},
         "cuda": {"max_autotune": True}}


# Left out of a run unless named (the zoo runs them by default): they would lengthen
# every workload's run and table.
OPT_IN = ("compile-max", "default", "auto", "L1+int8", "L2+bf16", "compile-bf16", "torchao-int8", "torchao-int4",
          "L2+int8", "L2+int4", "llama.cpp")
# On random weights int4's error is a sizeable share of the logits' magnitude: past graphopt's default
# precision_tolerance, which would undo it. Its contender accepts this much, and the table shows the error.
INT4_TOLERANCE = 0.5
# int8's too, through the ~1B decoder's 22 random layers (0.061 of the logits' magnitude at batch 1).
INT8_TOLERANCE = 0.1
# The fallbacks that change how a step's device graphs run, which `describe` lists below the table.
DEVICE_GRAPH_KINDS = (FallbackKind.NO_DEVICE_GRAPH, FallbackKind.CAPTURE_REFUSED, FallbackKind.EXACT_SIZE,
                      FallbackKind.SLOW_REPLAY)


def contenders(device: str) -> list[Contender]:
    """Every contender, in table order, for `device`."""
    cuda = device.startswith("cuda")
    graphs = "CUDA graphs" if cuda else "host graphs"
    found = [Contender("eager", "eager", "eager"), Contender("compile", "torch.compile", "torch.compile")]
    if cuda:  # torch.compile's own CUDA graphs: the competitor to graphopt's device graphs on a GPU
        found.append(Contender("compile-ro", "torch.compile reduce-overhead", "torch.compile",
                               mode="reduce-overhead"))
    # Inductor's autotuned kernels without its CUDA graphs: the zoo's second torch.compile.
    found.append(Contender("compile-max", "torch.compile max-autotune", "torch.compile",
                           mode="max-autotune-no-cudagraphs"))
    # Fewer bytes per weight the way users get them from torch: a bfloat16 model, torchao's weight-only formats.
    found.append(Contender("compile-bf16", "torch.compile bfloat16", "torch.compile", model_dtype="bfloat16"))
    # On a bfloat16 copy (torchao's CPU recipe: on float32 activations its kernels ran slower than eager).
    for fmt in ("int8", "int4"):
        found.append(Contender(f"torchao-{fmt}", f"torchao {fmt} + torch.compile", "torchao",
                               weight_quantization=fmt, model_dtype="bfloat16",
                               tolerance=INT4_TOLERANCE if fmt == "int4" else INT8_TOLERANCE))
    found.append(Contender("llama.cpp", "llama.cpp, same GGUF", "llama.cpp", weight_quantization="gguf"))
    # What a user gets with no options: level "auto" with device graphs, the default capture sizes.
    found.append(Contender("default", "graphopt default", "graphopt", "auto", True, defaults=True))
    # Level "auto" on the workload's own config (its capture sizes): what a server sets.
    found.append(Contender("auto", "graphopt auto", "graphopt", "auto", True))
    for level in (0, 1, 2):
        found.append(Contender(f"L{level}", f"graphopt L{level}", "graphopt", level))
        found.append(Contender(f"L{level}+graphs", f"graphopt L{level} + {graphs}", "graphopt", level, True))
        if level == 1:  # the workload's capture list against sizes chosen from the traffic
            found.append(Contender("L1+auto", f"graphopt L1 + {graphs}, auto sizes", "graphopt", 1, True,
                                   auto_sizes=True))
    found.append(Contender("L1+frozen", "graphopt L1 frozen", "graphopt", 1, frozen=True))
    found.append(Contender("L1+engines", "graphopt L1 + engines", "graphopt", 1, frozen=True, engines=True))
    # A serving step's module does not change: guards="inputs" drops Dynamo's guards on it.
    found.append(Contender("L1+frozen+inputs", "graphopt L1 frozen, guards on inputs", "graphopt", 1, frozen=True,
                           trusted=True))
    found.append(Contender("L1+engines+inputs", "graphopt L1 + engines, guards on inputs", "graphopt", 1,
                           frozen=True, engines=True, trusted=True))
    # Level 2's defaults with freeze_parameters (GEMMs on packed weights where they win); at "auto" after level 1.
    found.append(Contender("L2+frozen", "graphopt L2 frozen", "graphopt", 2, frozen=True))
    found.append(Contender("auto+frozen", f"graphopt auto frozen + {graphs}", "graphopt", "auto", True, frozen=True))
    # Fewer bytes or cheaper math, where the user accepts the error the table shows beside them.
    found.append(Contender("L1+int8", "graphopt L1 int8 weights", "graphopt", 1, frozen=True,
                           weight_quantization="int8"))
    found.append(Contender("L2+bf16", "graphopt L2 bfloat16 math", "graphopt", 2, frozen=True,
                           compute_dtype="bfloat16"))
    found.append(Contender("L2+int8", "graphopt L2 int8 weights", "graphopt", 2, frozen=True,
                           weight_quantization="int8", tolerance=INT8_TOLERANCE))
    found.append(Contender("L2+int4", "graphopt L2 int4 weights", "graphopt", 2, frozen=True,
                           weight_quantization="int4", tolerance=INT4_TOLERANCE))
    if cuda:  # frozen weights let Q/K/V and gate/up run as one GEMM each: what pays on a GPU
        found.append(Contender("L2+frozen+graphs", f"graphopt L2 frozen + {graphs}", "graphopt", 2, True,
                               frozen=True))
    # "tuned": frozen weights and Inductor's autotuned GEMMs (TUNED); a short name keeps the table narrow.
    found.append(Contender("L2+tuned", "graphopt L2 tuned" + (f" + {graphs}" if cuda else ""),
                           "graphopt", 2, device_graphs=cuda, tuned=True))
    found.append(Contender("onnxruntime", "ONNX Runtime", "onnxruntime"))
    found.append(Contender("openvino", "OpenVINO", "openvino"))
    # OpenVINO's torch.compile backend fails on some torches (2.13: "sources must not be empty");
    # the same model exported to ONNX and read by OpenVINO's CPU plugin runs on all of them.
    found.append(Contender("openvino-onnx", "OpenVINO (ONNX)", "openvino-onnx"))
    return found


def build(contender: Contender, workload: Workload, device: str) -> Step:
    """`contender`'s step for `workload`; raises Unavailable with the reason when it has none."""
    if contender.kind == "eager":
        return workload.bind(lambda target: target)
    if contender.kind == "torch.compile":
        return workload.bind(lambda target: torch.compile(target, mode=contender.mode), contender.model_torch_dtype)
    if contender.kind == "torchao":
        return _torchao(contender, workload, device)
    if contender.kind == "llama.cpp":
        return _llama_cpp(workload, device)
    if contender.defaults:
        return workload.bind(lambda target: optimize(target, pad_values=workload.pad_values))
    if contender.kind == "graphopt":
        extra = dict(freeze_parameters=True, inductor_compile_config=TUNED[device.split(":")[0]]) \
            if contender.tuned else dict(freeze_parameters=True) if contender.frozen else {}
        if contender.engines and device.startswith("cuda"):
            raise Unavailable("the engines of executors= run on the CPU here; left out with --device cuda")
        if contender.engines:
            extra["executors"] = [e for e in EXECUTORS if importlib.util.find_spec(e) is not None]
        if contender.trusted:
            extra["guards"] = "inputs"
        if contender.lowered:
            extra.update(compute_dtype=contender.compute_dtype, weight_quantization=contender.weight_quantization)
            if contender.tolerance is not None:
                extra["precision_tolerance"] = contender.tolerance
        sizes = "auto" if contender.auto_sizes else workload.capture_sizes
        config = GraphOptimizationConfig(graph_opt_level=contender.level, use_cudagraph=contender.device_graphs,
                                         cudagraph_capture_sizes=sizes, **extra)
        return workload.bind(lambda target: optimize(target, config, pad_values=workload.pad_values))
    if contender.kind == "openvino":
        return _openvino(workload, device)
    if contender.kind == "openvino-onnx":
        if device.startswith("cuda") or workload.onnx_unsupported:
            raise Unavailable("runs on the CPU here" if device.startswith("cuda")
                              else f"not exportable: {workload.onnx_unsupported}")
        try:
            import onnx  # noqa: F401
            import onnxscript  # noqa: F401
            import openvino  # noqa: F401
        except ImportError as error:
            raise Unavailable(f"{error.name} is not installed (pip install 'graphopt[bench]')") from None
        return workload.bind(OpenVinoOnnxStep)
    if device.startswith("cuda"):
        raise Unavailable("ONNX Runtime runs on the CPU here; left out with --device cuda")
    if workload.onnx_unsupported:
        raise Unavailable(f"not exportable: {workload.onnx_unsupported}")
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs it, and onnxscript)
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as error:
        raise Unavailable(f"{error.name} is not installed (pip install 'graphopt[bench]')") from None
    return workload.bind(OnnxStep)


def _torchao(contender: Contender, workload: Workload, device: str) -> Step:
    """torchao's weight-only `quantize_` on the model's copy, then `torch.compile`, for a
    workload that decodes (llm.py); left out with the reason where torchao does not import."""
    from . import llm

    if workload.first_token is None:
        raise Unavailable("run on the decoding workloads only")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return llm.torchao_step(workload, contender.weight_quantization, device, contender.model_torch_dtype)
    except ImportError as error:
        raise Unavailable(f"torchao does not import here ({first_line(error)[:120]}); pip install "
                          "'graphopt[bench]'") from None
    except Exception as error:  # noqa: BLE001 - a torchao that cannot quantize this model loses its row only
        raise Unavailable(f"torchao's quantize_ failed: {type(error).__name__}: {first_line(error)[:160]}") from None


def _llama_cpp(workload: Workload, device: str) -> Step:
    """llama.cpp on the GGUF file the workload's model was loaded from (llamacpp.py)."""
    from .llamacpp import BUILD, LlamaCppStep

    if workload.gguf is None or device.startswith("cuda"):
        raise Unavailable("runs on a workload loaded from a GGUF file, on the CPU")
    try:
        return LlamaCppStep(workload.gguf, torch.get_num_threads())
    except ImportError as error:
        raise Unavailable(f"llama-cpp-python does not import here ({first_line(error)[:80]}); {BUILD}") from None


def _openvino(workload: Workload, device: str) -> Step:
    """`torch.compile(backend="openvino")`: OpenVINO's own Dynamo backend, which runs
    the graph's supported partitions with OpenVINO's CPU plugin and the rest with torch."""
    if device.startswith("cuda"):
        raise Unavailable("OpenVINO's torch.compile backend runs on the CPU here; left out with --device cuda")
    try:
        with warnings.catch_warnings():  # it probes a deprecated Dynamo setting at import
            warnings.simplefilter("ignore", FutureWarning)
            import openvino.torch  # noqa: F401  (registers the backend name "openvino")
    except ImportError:
        raise Unavailable("openvino is not installed (pip install 'graphopt[bench]')") from None
    # The same threads as torch's contenders; OpenVINO would otherwise take every core.
    options = {"device": "CPU", "config": {"INFERENCE_NUM_THREADS": str(torch.get_num_threads())}}
    return workload.bind(lambda target: torch.compile(target, backend="openvino", options=options))


class OnnxStep:
    """The model exported with `torch.onnx.export` and run by an ONNX Runtime CPU
    session at ORT_ENABLE_ALL. One export per input shape, made at its first call
    (a warm-up), so every session sees static shapes, which ORT optimizes best."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.sessions: dict[tuple, Any] = {}
        self.models: dict[tuple, bytes] = {}  # the exported model per input shape

    def __call__(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        key = _key(args)
        if key not in self.sessions:
            self.sessions[key] = self._session(self._model(args))
        session = self.sessions[key]
        feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
        outputs = [torch.from_numpy(o) for o in session.run(None, feeds)]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def profiling(self, args: tuple[torch.Tensor, ...]) -> tuple[Callable[[Any], Any], dict]:
        """For --profile: a maker of this shape's session with given SessionOptions, and its feeds."""
        model = self._model(args)
        session = self._session(model)
        return (lambda options: self._session(model, options),
                {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})

    def _model(self, args: tuple[torch.Tensor, ...]) -> bytes:
        key = _key(args)
        if key not in self.models:
            with quiet_export():
                self.models[key] = torch.onnx.export(self.model, args, dynamo=True).model_proto.SerializeToString()
        return self.models[key]

    def _session(self, model: bytes, options: Any = None) -> Any:
        return onnxruntime_session(model, torch.get_num_threads(), options)  # torch's contenders' threads


class OpenVinoOnnxStep:
    """The model exported with `torch.onnx.export`, one export per input shape, and
    compiled by OpenVINO's CPU plugin in float32 on torch's thread count."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.runners: dict[tuple, Callable[[list], list]] = {}

    def __call__(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        key = _key(args)
        if key not in self.runners:
            with quiet_export():
                model = torch.onnx.export(self.model, args, dynamo=True).model_proto.SerializeToString()
            self.runners[key] = openvino_runner(model, torch.get_num_threads())
        outputs = self.runners[key]([a.numpy() for a in args])
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _key(args: tuple[torch.Tensor, ...]) -> tuple:
    return tuple((tuple(a.shape), a.dtype) for a in args)


def report_of(step: Step) -> Report:
    """A graphopt step's report (the step, or for a workload that wraps `forward`, its forward's)."""
    found: Callable | None = getattr(step, "report", None) or getattr(step.forward, "report", None)
    return found()


def graph_counts(step: Step, contender: Contender) -> tuple[int, int, int] | None:
    """(steps, steps replayed, padded rows) so far of a graphopt step with device graphs; None for others."""
    if contender.kind != "graphopt" or not contender.device_graphs:
        return None
    report = report_of(step)
    return report.steps, report.steps_replayed, report.padded_rows


def graph_figures(step: Step, contender: Contender, before: tuple[int, int, int] | None) -> GraphFigures | None:
    """What `step`'s device graphs did since `graph_counts` gave `before`, and hold now."""
    now = graph_counts(step, contender)
    if now is None or before is None:
        return None
    report = report_of(step)
    steps, replayed, padded = (a - b for a, b in zip(now, before))
    return GraphFigures(steps, replayed, padded, len(report.captures), report.capture_seconds, report.pool_bytes,
                        sorted({c.size for c in report.captures if c.size is not None}))


def describe(step: Step, contender: Contender) -> tuple[str, list[str]]:
    """What a graphopt step's report says about its device graphs: a short note (how
    many were captured and replayed, or that it fell back) and the fallbacks' reasons,
    which are long and go below the table."""
    if contender.kind != "graphopt":
        return "", []
    report = report_of(step)
    reasons = [reason for reason, kind in report.fallback_kinds.items() if kind in DEVICE_GRAPH_KINDS]
    if not contender.device_graphs:
        return (f"{len(report.graphs)} graph{'s' * (len(report.graphs) != 1)}" if report.graphs else ""), []
    if report.replays == 0:  # every call ran without a device graph
        return "fallback", reasons or ["no device graph was replayed"]
    note = f"{len(report.captures)} captures, {report.replays} replays"
    if report.recaptures:
        note += f", {report.recaptures} recaptures"
    return note + (", partly fell back" if reasons else ""), reasons
