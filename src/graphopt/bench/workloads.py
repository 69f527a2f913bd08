"""The workloads `graphopt bench` runs: each one a model built from a config with
random weights (nothing is downloaded) and the cases it is timed on.

A contender turns the workload's `target` (the model, or for `hf-llama` a copy's
`forward`) into a step; each case runs that step the way a user would and returns
what it computed, so every contender's output can be checked against eager's."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._compat.names import tree_map
from ..models import Decoder, DecoderConfig, ResNet, ResNetConfig

Step = Callable[..., Any]


@dataclass
class Case:
    """One timed unit of work: `call(step, inputs)` calls the step (once, or a whole
    stream or generate()) and returns its output. `items` is how many tokens, images
    or sequences one run produces, for throughput."""

    name: str
    inputs: Any
    call: Callable[[Step, Any], Any]
    items: int
    unit: str
    gemm_weights: list[torch.Tensor] = field(default_factory=list)  # set for a decode step: its GEMM floor
    gemm_batch: int = 0
    graph_table: bool = False  # a trace: graphopt's device graphs on it get a table of their own
    # Set for decoding: bytes of weights one run reads in a weight format ("float32", "int8", ...),
    # for each row's memory-bandwidth floor.
    weight_bytes: Callable[[str], int] | None = None
    # Set where a lowered row is judged otherwise than by `measure.lowered_error` on the whole
    # output: (output, eager's, bound) -> (within bound, max |diff|, relative error, token agreement).
    judge: Callable[[Any, Any, float], tuple[bool, float, float, float | None]] | None = None

    def runner(self, step: Step, dtype: torch.dtype | None = None) -> Callable[[], Any]:
        """One run of this case by `step`, on its own copy of the inputs: graphopt
        marks the batch dim of the tensors it is given as dynamic, and a plain
        torch.compile handed those same tensors would then compile again. `dtype`:
        floating-point inputs cast to it (for the model in float32)."""
        def own(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            return x.to(dtype) if dtype is not None and x.is_floating_point() else x.clone()

        inputs = tree_map(own, self.inputs)
        return lambda: self.call(step, inputs)


@dataclass
class Workload:
    """A model and its cases. `bind(wrap)` gives a contender's step: `wrap` applied
    to the model (the default) or, for a model whose `forward` users replace (the
    transformers idiom), to a fresh copy's `forward`."""

    name: str
    title: str
    model: nn.Module
    cases: list[Case]
    capture_sizes: list[int]
    pad_values: dict[str, int] = field(default_factory=dict)
    exact: bool = False                  # outputs are tokens: equal, not close
    onnx_unsupported: str | None = None  # why ONNX Runtime cannot run it, when it cannot
    wraps_forward: bool = False
    # How a contender's copy of the model is made, in the model's dtype (None) or another;
    # default: a deep copy (cast with .to(dtype)).
    make_copy: Callable[[nn.Module, torch.dtype | None], nn.Module] | None = None
    # Runs a step to its first token (start-up's time to the first token), where the cases decode.
    first_token: Callable[[Step], Any] | None = None
    contenders: tuple[str, ...] | None = None  # the contenders it runs unless --contenders names others
    gguf: Path | None = None  # the GGUF file the model was loaded from: llama.cpp reads it itself

    def in_float32(self) -> Step | None:
        """The model run eagerly in float32, when it runs in half precision: the truth
        that eager's and each contender's rounding are measured against."""
        if self.exact or not any(p.dtype in (torch.float16, torch.bfloat16) for p in self.model.parameters()):
            return None
        return copy.deepcopy(self.model).float()

    def bind(self, wrap: Callable[[Callable], Step], dtype: torch.dtype | None = None) -> Step:
        """A contender's step. Every contender gets its own copy of the model (same
        weights, own KV cache), so one contender's compiled graphs, guards and cache
        writes never meet another's; in `dtype` where given."""
        if self.make_copy is not None:
            model = self.make_copy(self.model, dtype)
        else:
            model = copy.deepcopy(self.model) if dtype is None else copy.deepcopy(self.model).to(dtype)
        if self.wraps_forward:
            model.forward = wrap(model.forward)
            return model
        return wrap(model)


@dataclass(frozen=True)
class Sizes:
    """How big a run is: `quick` (CI smoke), the CPU default, or `--device cuda`; in
    `precision` ("bfloat16", "float32"), or else the device's default."""

    quick: bool
    device: str
    precision: str | None = None

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def dtype(self) -> torch.dtype:
        if self.precision is not None:
            return getattr(torch, self.precision)
        return torch.bfloat16 if self.cuda else torch.float32

    def pick(self, quick: Any, cpu: Any, cuda: Any) -> Any:
        return quick if self.quick else cuda if self.cuda else cpu


def _call(step: Step, inputs: tuple) -> Any:
    return step(*inputs)


def _manual_seed(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def decoder(sizes: Sizes) -> Workload:
    """The reference decoder: a mixed stream of decode batch sizes (what a serving
    engine's scheduler produces), and the decode step alone at batch 1 and 16 (on
    CUDA: the 1.1B-parameter `billion()` config, batches 1, 8 and 32)."""
    generator = _manual_seed(0)
    config = sizes.pick(DecoderConfig.tiny(dtype=sizes.dtype), DecoderConfig.small(dtype=sizes.dtype),
                        DecoderConfig.billion(dtype=sizes.dtype))
    with torch.device(sizes.device):  # 1.1B parameters on a GPU: initialised there, in seconds
        model = Decoder(config).eval()
    segments, steps = sizes.pick((3, 2), (8, 4), (16, 8))
    largest = sizes.pick(16, 16, 32)
    batches = [int(b) for b in torch.randint(1, largest + 1, (segments,), generator=generator)]
    stream = [(torch.randint(0, config.vocab_size, (steps, b), generator=generator).to(sizes.device),
               torch.arange(b, device=sizes.device)) for b in batches]

    def run_stream(step: Step, stream: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        last = []
        for ids, slots in stream:
            for position, row in enumerate(ids[:-1]):
                step(row, torch.full_like(row, position), slots)
            # The segment's last logits, cloned: a device graph's next replay overwrites them.
            last.append(step(ids[-1], torch.full_like(ids[-1], len(ids) - 1), slots).clone())
        return last

    cases = [Case(f"stream of batches {','.join(map(str, batches))} x {steps} steps", stream, run_stream,
                  sum(batches) * steps, "tokens")]
    linears = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    for batch in sizes.pick((1, 16), (1, 16), (1, 8, 32)):
        inputs = (torch.randint(0, config.vocab_size, (batch,), generator=generator).to(sizes.device),
                  torch.full((batch,), 7, device=sizes.device), torch.arange(batch, device=sizes.device))
        cases.append(Case(f"decode step, batch {batch}", inputs, _call, batch, "tokens",
                          gemm_weights=linears, gemm_batch=batch))
    title = (f"reference decoder: hidden {config.hidden_size}, {config.num_layers} layers, "
             f"{config.num_heads}/{config.num_kv_heads} heads, vocab {config.vocab_size}, {config.dtype}")
    capture_sizes = sizes.pick([1, 2, 4, 8, 16], [1, 2, 4, 8, 16], [1, 2, 4, 8, 16, 24, 32])
    return Workload("decoder", title, model, cases, capture_sizes=capture_sizes,
                    pad_values={"slots": model.scratch_slot},
                    onnx_unsupported="its step writes the KV cache buffers in place, and an exported "
                                     "ONNX graph keeps no state between runs")


def hf_llama(sizes: Sizes) -> Workload:
    """transformers' generate() on a random-weight LlamaForCausalLM, greedy, with a
    static cache: `model.forward` replaced, as transformers documents."""
    import transformers

    _manual_seed(0)
    hidden, layers, vocab = sizes.pick((64, 2, 512), (256, 4, 2048), (1024, 8, 32000))
    prompt_len, new_tokens = sizes.pick((8, 4), (16, 32), (64, 128))
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=2 * hidden, max_position_embeddings=prompt_len + new_tokens,
        bos_token_id=0, eos_token_id=1, pad_token_id=1)
    model = transformers.LlamaForCausalLM(config).eval().to(sizes.device, sizes.dtype)
    generator = torch.Generator().manual_seed(1)

    def run(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        # min_new_tokens: random weights may predict eos; every call decodes the same count.
        # disable_compile: on CUDA generate() would otherwise compile forward itself, eager included.
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                              disable_compile=True)

    cases = []
    for batch in sizes.pick((2,), (1, 8), (1, 8)):
        ids = torch.randint(2, vocab, (batch, prompt_len), generator=generator).to(sizes.device)
        cases.append(Case(f"generate(), batch {batch}", ids, run, batch * new_tokens, "tokens"))
    title = (f"transformers generate(): random LlamaForCausalLM, hidden {hidden}, {layers} layers, "
             f"8/4 heads, vocab {vocab}, prompt {prompt_len}, {new_tokens} new tokens, greedy, static cache")
    return Workload("hf-llama", title, model, cases, capture_sizes=sorted({1, 2, 8}), exact=True,
                    wraps_forward=True,
                    onnx_unsupported="generate() is a Python loop over a StaticCache, not one graph")


def resnet(sizes: Sizes) -> Workload:
    """graphopt's small ResNet (convolutions, batch norm, residual adds)."""
    _manual_seed(0)
    config = sizes.pick(ResNetConfig.tiny(dtype=sizes.dtype), ResNetConfig.tiny(dtype=sizes.dtype),
                        ResNetConfig(image_size=224, in_channels=3, stem_channels=64,
                                     stage_channels=(64, 128, 256, 512), blocks_per_stage=2,
                                     num_classes=1000, dtype=sizes.dtype))
    model = ResNet(config).eval().to(sizes.device)
    generator = torch.Generator().manual_seed(1)
    cases = []
    for batch in sizes.pick((4,), (1, 8), (1, 32)):
        images = torch.randn(batch, config.in_channels, config.image_size, config.image_size,
                             generator=generator).to(sizes.device, config.dtype)
        cases.append(Case(f"batch {batch}", (images,), _call, batch, "images"))
    title = (f"ResNet: {config.image_size}x{config.image_size} images, channels {config.stage_channels}, "
             f"{config.blocks_per_stage} block(s) per stage, {config.dtype}")
    return Workload("resnet", title, model, cases, capture_sizes=[c.items for c in cases])


class BertEncoder(nn.Module):
    """A transformers BertModel that returns its last hidden state, one tensor, so
    every contender (ONNX Runtime too) gives an output of the same form."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        import transformers

        self.bert = transformers.BertModel(config, add_pooling_layer=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def bert(sizes: Sizes) -> Workload:
    """A small random-weight transformers BertModel encoder."""
    import transformers

    _manual_seed(0)
    hidden, layers, heads, seq = sizes.pick((64, 2, 4, 16), (128, 2, 4, 32), (768, 12, 12, 128))
    config = transformers.BertConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=4 * hidden,
                                     max_position_embeddings=max(seq, 64))
    model = BertEncoder(config).eval().to(sizes.device, sizes.dtype)
    generator = torch.Generator().manual_seed(1)
    cases = []
    for batch in sizes.pick((2,), (1, 8), (1, 32)):
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator).to(sizes.device)
        cases.append(Case(f"batch {batch}", (ids, torch.ones_like(ids)), _call, batch, "sequences"))
    title = f"BERT encoder: hidden {hidden}, {layers} layers, {heads} heads, sequence {seq}, {sizes.dtype}"
    return Workload("bert", title, model, cases, capture_sizes=[c.items for c in cases])


def resnet18(sizes: Sizes) -> Workload:
    """torchvision's ResNet-18 layout on 3x112x112 images (64x64 with --quick)."""
    from .vision import ResNet18

    _manual_seed(0)
    model = ResNet18().to(sizes.device, sizes.dtype)
    size = sizes.pick(64, 112, 224)
    generator = torch.Generator().manual_seed(1)

    def images(batch: int) -> torch.Tensor:
        return torch.randn(batch, 3, size, size, generator=generator).to(sizes.device, sizes.dtype)

    batches = sizes.pick((2,), (1, 8), (1, 32))
    cases = [Case(f"batch {batch}", (images(batch),), _call, batch, "images") for batch in batches]
    title = f"ResNet-18 (torchvision's layout): {size}x{size} images, {sizes.dtype}"
    return Workload("resnet18", title, model, cases, capture_sizes=[c.items for c in cases])


def bert_base(sizes: Sizes) -> Workload:
    """BERT-base's shape (hidden 768, 12 layers, 12 heads, 128 tokens) as a random
    transformers BertModel; the `bert` workload's small one with --quick."""
    if sizes.quick:
        workload = bert(sizes)
        workload.name = "bert-base"
        return workload
    import transformers

    _manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                                     num_attention_heads=12, intermediate_size=3072)
    model = BertEncoder(config).eval().to(sizes.device, sizes.dtype)
    generator = torch.Generator().manual_seed(1)
    cases = []
    for batch in (1, 8):
        ids = torch.randint(0, config.vocab_size, (batch, 128), generator=generator).to(sizes.device)
        cases.append(Case(f"batch {batch}", (ids, torch.ones_like(ids)), _call, batch, "sequences"))
    title = f"BERT-base encoder: hidden 768, 12 layers, 12 heads, sequence 128, {sizes.dtype}"
    return Workload("bert-base", title, model, cases, capture_sizes=[c.items for c in cases])


def serving(sizes: Sizes) -> Workload:
    """A serving trace of a few thousand decode steps at sizes the default capture list
    pads by several rows (serving.py)."""
    from .serving import serving as trace_workload

    return trace_workload(sizes)


def decoder_1b(sizes: Sizes) -> Workload:
    """The ~1B decoder's greedy decoding at batch 1 and 8 (llm.py)."""
    from .llm import decoder_1b as billion

    return billion(sizes)


def serving_small(sizes: Sizes) -> Workload:
    """The same at smaller sizes, half of them below 8 rows (serving.py)."""
    from .serving import SMALL_SIZES
    from .serving import serving as trace_workload

    return trace_workload(sizes, "serving-small", SMALL_SIZES)


def gemma3_270m(sizes: Sizes) -> Workload:
    """Gemma-3 270M, a real checkpoint, through generate() (checkpoints.py)."""
    from .checkpoints import gemma3_270m as gemma

    return gemma(sizes)


def minilm(sizes: Sizes) -> Workload:
    """all-MiniLM-L6-v2, a real checkpoint, as sentence embeddings (checkpoints.py)."""
    from .checkpoints import minilm as encoder

    return encoder(sizes)


WORKLOADS: dict[str, Callable[[Sizes], Workload]] = {
    "decoder": decoder, "hf-llama": hf_llama, "resnet": resnet, "bert": bert,
    "resnet18": resnet18, "bert-base": bert_base, "serving": serving, "serving-small": serving_small,
    "decoder-1b": decoder_1b, "gemma3-270m": gemma3_270m, "minilm": minilm}
# Run only when named or with `graphopt bench --large`: minutes each at one thread.
LARGE = ("resnet18", "bert-base", "serving", "serving-small", "decoder-1b", "gemma3-270m", "minilm")
