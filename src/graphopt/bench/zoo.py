"""The zoo: models users know, from timm and transformers, with random weights
(nothing is downloaded), each a workload of its own at batch 1 and 8.

`graphopt bench --workloads zoo` runs them all against eager, `torch.compile`'s
default and max-autotune modes, graphopt with no options and graphopt level 2;
`--models` picks some. After the tables, one summary table: a row per model and
batch, and what graphopt made of each model's graphs (its report's level and fused
ops per graph).

timm needs torchvision, and on the package index the torchvision built for a torch
is a CUDA build: beside a CPU torch its C++ ops do not load, and `import torchvision`
stops at registering a fake kernel for an op that was never defined. `import_timm`
defines those ops' schemas (no kernels: timm's classifiers call none of them) and
imports again; where that fails too, the timm models are left out with what to do.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from .workloads import WORKLOADS, Case, Sizes, Step, Workload

# What `--workloads zoo` runs when --contenders is not given.
CONTENDERS = ["eager", "compile", "compile-max", "default", "L1+graphs", "L2"]
TIMM_FIX = ("install the CPU torchvision that matches your torch from PyTorch's CPU index, e.g. "
            "pip install torchvision==<the release for your torch> --index-url https://download.pytorch.org/whl/cpu")
# The ops torchvision's _meta_registrations registers fake kernels for without first
# checking that its C++ library loaded (torchvision's csrc/ops/nms.cpp, quantized/qnms).
_TORCHVISION_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                        "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_torchvision_ops: list[Any] = []  # the Library that holds the schemas, kept alive


class ZooUnavailable(Exception):
    """A zoo model that cannot be built here; the message says what to install."""


def torchvision_importable() -> None:
    """Make `import torchvision` work where it is installed but its C++ ops do not
    load (the CUDA build of the package index under a CPU torch): transformers imports
    it too, and its models then fail to import ("Could not import module 'BertModel'")."""
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
        return
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _TORCHVISION_SCHEMAS:
        library.define(schema)
    _torchvision_ops.append(library)
    for name in [m for m in sys.modules if m.split(".")[0] in ("torchvision", "timm")]:
        del sys.modules[name]  # the half-imported modules of the failed import
    try:
        import torchvision  # noqa: F401,F811
    except RuntimeError as error:
        raise ZooUnavailable(f"import torchvision failed: {error}; {TIMM_FIX}") from None


def import_timm() -> ModuleType:
    """timm, also beside a torchvision whose C++ ops do not load (torchvision_importable);
    ZooUnavailable says what to install where it is missing."""
    torchvision_importable()
    try:
        import timm
        return timm
    except ImportError as error:
        raise ZooUnavailable(f"{error.name} is not installed (pip install 'graphopt[zoo]')") from None


# Model -> (timm name, image size). Image size: the model's own (its positional
# embeddings and windows are sized for it).
TIMM = {"mobilenetv3": ("mobilenetv3_large_100", 224), "efficientnet_b0": ("efficientnet_b0", 224),
        "resnet50": ("resnet50", 224), "convnext": ("convnext_atto", 224),
        "vit": ("vit_tiny_patch16_224", 224), "swin": ("swin_tiny_patch4_window7_224", 224)}
# --quick: small models at small images, seconds each.
TIMM_QUICK = {"mobilenetv3": ("mobilenetv3_small_050", 64), "efficientnet_b0": ("efficientnet_b0", 64),
              "resnet50": ("resnet18", 64), "convnext": ("convnext_atto", 64),
              "vit": ("vit_tiny_patch16_224", 224), "swin": ("swin_tiny_patch4_window7_224", 224)}


def _timm(model: str) -> Callable[[Sizes], Workload]:
    def build(sizes: Sizes) -> Workload:
        timm = import_timm()
        name, size = (TIMM_QUICK if sizes.quick else TIMM)[model]
        torch.manual_seed(0)
        net = timm.create_model(name, pretrained=False).eval().to(sizes.device, sizes.dtype)
        generator = torch.Generator().manual_seed(1)
        cases = [Case(f"batch {batch}", (torch.randn(batch, 3, size, size, generator=generator)
                                          .to(sizes.device, sizes.dtype),), _call, batch, "images")
                 for batch in sizes.pick((2,), (1, 8), (1, 8))]
        return Workload(f"zoo-{model}", f"timm {name} (random weights): {size}x{size} images, {sizes.dtype}",
                        net, cases, capture_sizes=[c.items for c in cases])
    return build


class HiddenStates(nn.Module):
    """A transformers model that returns its last hidden state, one tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


@dataclass(frozen=True)
class Transformer:
    """A transformers model class and its config at `hidden` width and `layers` layers."""

    model: str
    config: str
    keys: Callable[[int, int], dict[str, Any]]  # (hidden, layers) -> the config's own names for them


def _decoder_keys(hidden: int, layers: int) -> dict[str, Any]:
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=hidden * 8 // 3, use_cache=False)


TRANSFORMERS = {
    "bert": Transformer("BertModel", "BertConfig", lambda h, n: dict(
        hidden_size=h, num_hidden_layers=n, num_attention_heads=8, intermediate_size=4 * h)),
    "distilbert": Transformer("DistilBertModel", "DistilBertConfig", lambda h, n: dict(
        dim=h, n_layers=n, n_heads=8, hidden_dim=4 * h)),
    "gpt2": Transformer("GPT2Model", "GPT2Config", lambda h, n: dict(
        n_embd=h, n_layer=n, n_head=8, use_cache=False)),
    "t5-encoder": Transformer("T5EncoderModel", "T5Config", lambda h, n: dict(
        d_model=h, d_kv=h // 8, d_ff=4 * h, num_layers=n, num_heads=8)),
    "llama": Transformer("LlamaModel", "LlamaConfig", _decoder_keys),
    "qwen2": Transformer("Qwen2Model", "Qwen2Config", _decoder_keys),
    "mixtral": Transformer("MixtralModel", "MixtralConfig", lambda h, n: dict(
        _decoder_keys(h, n), intermediate_size=h * 2, num_local_experts=8, num_experts_per_tok=2)),
}


def _transformer(model: str) -> Callable[[Sizes], Workload]:
    def build(sizes: Sizes) -> Workload:
        try:
            import transformers
        except ImportError:
            raise ZooUnavailable("transformers is not installed (pip install 'graphopt[zoo]')") from None
        spec = TRANSFORMERS[model]
        hidden, layers, seq, vocab = sizes.pick((64, 2, 16, 512), (256, 4, 128, 8192), (768, 12, 512, 32000))
        torch.manual_seed(0)
        config = getattr(transformers, spec.config)(vocab_size=vocab, **spec.keys(hidden, layers))
        net = HiddenStates(getattr(transformers, spec.model)(config)).eval().to(sizes.device, sizes.dtype)
        generator = torch.Generator().manual_seed(1)
        cases = []
        for batch in sizes.pick((2,), (1, 8), (1, 8)):
            ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(sizes.device)
            cases.append(Case(f"batch {batch}", (ids, torch.ones_like(ids)), _call, batch, "sequences"))
        title = (f"transformers {spec.model} (random weights): hidden {hidden}, {layers} layers, "
                 f"sequence {seq}, vocab {vocab}, {sizes.dtype}")
        return Workload(f"zoo-{model}", title, net, cases, capture_sizes=[c.items for c in cases])
    return build


def _call(step: Step, inputs: tuple) -> Any:
    return step(*inputs)


MODELS = [*TIMM, *TRANSFORMERS]
ZOO: dict[str, Callable[[Sizes], Workload]] = {
    **{f"zoo-{m}": _timm(m) for m in TIMM}, **{f"zoo-{m}": _transformer(m) for m in TRANSFORMERS}}


def factory(name: str) -> Callable[[Sizes], Workload]:
    """The builder of the workload `name`: one of WORKLOADS or of the zoo. Every
    workload's transformers models import torchvision where it is installed."""
    torchvision_importable()
    return WORKLOADS[name] if name in WORKLOADS else ZOO[name]


def expand(workloads: list[str], models: list[str] | None) -> list[str]:
    """`workloads` with "zoo" replaced by the zoo's workloads (those of `models`, when
    given); `models` without "zoo" among the workloads adds those models."""
    zoo = [f"zoo-{m}" for m in (models or MODELS)]
    if models and "zoo" not in workloads:
        workloads = [*workloads, "zoo"]
    found: list[str] = []
    for name in workloads:
        found.extend(zoo if name == "zoo" else [name])
    return list(dict.fromkeys(found))


def chosen(report: Any) -> str:
    """What graphopt made of a model, from its report: the level and, per graph, its
    fused ops ("no fusion" where none fired). With graph_opt_level="auto" a graph's
    records (one per level compiled) start at its choice's "graph" index; only the
    chosen level's are shown."""
    parts = []
    levels = {c["graph"]: c.get("level") for c in report.level_choices}
    for graph in report.graphs:
        first = max((index for index in levels if index <= graph.index), default=None)
        fused = ", ".join(f"{op} x{n}" for op, n in sorted(graph.fused_ops.items()) if n)
        if first is None:
            parts.append(f"g{graph.index}: {fused or 'no fusion'}")
        elif graph.level == levels[first]:
            parts.append(f"g{first} (level {graph.level} chosen): {fused or 'no fusion'}")
    level = "auto" if report.level == "auto" else f"L{report.level}"
    return f"{level}; " + ("; ".join(parts) if parts else "no graph compiled")
