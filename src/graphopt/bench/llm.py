"""The ~1B decoder (`decoder-1b`, run when named or with --large): greedy decoding of
a 1.1B-parameter Llama-style model with random weights (TinyLlama's shape,
`DecoderConfig.billion`) at batch 1 and 8, by contenders that read its weights in
float32, bfloat16, int8 and int4.

Decoding one token reads every weight once, so besides its speed each row gets the
memory-bandwidth floor of its weight format (bytes its linears read per step / the
measured bandwidth of a large copy) and, for the lowered formats, how many greedy
tokens agree with float32's.

    decode(step, prompt): reset the cache rows, then N times: token = step(token, position, slots).argmax(-1)

That is `models.generate` with a one-token prompt whose prefill is run by the step too
(a one-token prefill is a decode step), so every weight a run reads is read in the
contender's format and a run is N decode steps, which the floor counts."""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..models import Decoder, DecoderConfig
from .startup import WEIGHTS_FILE
from .workloads import Case, Sizes, Step, Workload, _manual_seed

# Each weight format's bytes per linear weight, and per output channel (int8's scale) or per
# group of 32 input channels (int4's scale and zero, both bfloat16), as graphopt and torchao store them.
FORMAT_BYTES = {"float32": (4.0, 0, 0), "bfloat16": (2.0, 0, 0), "int8": (1.0, 2, 0), "int4": (0.5, 0, 4)}
INT4_GROUP = 32

# The contenders this workload runs unless --contenders names others: one per weight format
# and compiler, since each holds its own copy of 1.1B weights in some format.
CONTENDERS = ("eager", "compile", "compile-bf16", "torchao-int8", "torchao-int4", "L2+frozen", "L2+bf16",
              "L2+int8", "L2+int4")


def decoder_1b(sizes: Sizes) -> Workload:
    """The workload: `DecoderConfig.billion` with the cache cut to what the cases use (the
    tiny config with --quick), a case per batch of N greedy tokens."""
    generator = _manual_seed(0)
    batches = sizes.pick((1, 2), (1, 8), (1, 8))
    new_tokens = sizes.pick(4, 32, 32)
    fields = dict(max_num_seqs=max(batches), max_seq_len=new_tokens, dtype=sizes.dtype)
    config = DecoderConfig.tiny(**fields) if sizes.quick else DecoderConfig.billion(**fields)
    model = _decoder(config, sizes.device)
    linears = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    cases = []
    for batch in batches:
        prompt = torch.randint(0, config.vocab_size, (batch,), generator=generator).to(sizes.device)
        cases.append(Case(f"generate {new_tokens} tokens, batch {batch}", (prompt, new_tokens), decode,
                          batch * new_tokens, "tokens", judge=judge,
                          weight_bytes=functools.partial(weight_bytes, linears, steps=new_tokens)))
    parameters = sum(p.numel() for p in model.parameters())
    title = (f"~1B decoder: {parameters / 1e9:.2f}B parameters, hidden {config.hidden_size}, "
             f"{config.num_layers} layers, {config.num_heads}/{config.num_kv_heads} heads, vocab "
             f"{config.vocab_size}, {config.dtype}, greedy, random weights")
    return Workload("decoder-1b", title, model, cases, capture_sizes=list(batches),
                    pad_values={"slots": model.scratch_slot}, wraps_forward=True, make_copy=shared_copy,
                    first_token=lambda step: decode(step, (cases[0].inputs[0], 1)),
                    contenders=CONTENDERS,
                    onnx_unsupported="its step writes the KV cache buffers in place, and an exported "
                                     "ONNX graph keeps no state between runs")


def _decoder(config: DecoderConfig, device: str) -> Decoder:
    """The model with random weights or, where WEIGHTS_FILE names a file, with the weights
    in it (memory-mapped, as a server loads its checkpoint; start-up measurements do, not
    to time drawing 1.1B random numbers, twice each: 6 s); a named file not there yet is
    written with the random ones."""
    path = os.environ.get(WEIGHTS_FILE)
    if not path or not os.path.exists(path):
        with torch.device(device):
            model = Decoder(config).eval()
        if path:
            torch.save(dict(itertools.chain(model.named_parameters(), model.named_buffers())), path)
        return model
    with torch.device("meta"):
        model = Decoder(config).eval()
    saved = torch.load(path, map_location=device, mmap=True, weights_only=True)
    model.load_state_dict({name: saved.pop(name) for name in model.state_dict()}, assign=True)
    for name, value in saved.items():  # the buffers a state dict leaves out: the KV cache, the frequencies
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner).register_buffer(leaf, value, persistent=False)
    return model


def decode(model: Decoder, inputs: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [b, n], the first step's logits [b, vocab]) of greedy decoding after the
    one-token prompts `inputs[0]`, every step by `model` (whose forward a contender replaced)."""
    prompt, new_tokens = inputs
    batch = prompt.shape[0]
    slots = torch.arange(batch, device=prompt.device)
    model.reset_cache(slots)
    # A copy made here, as every later token is: the prompt was made outside inference mode,
    # and a tensor made outside it is another input to Dynamo (a second graph per batch,
    # each with its own copy of the folded and packed weights).
    token, tokens, first = prompt.clone(), [], None
    for position in range(new_tokens):
        logits = model(token, torch.full((batch,), position, device=prompt.device), slots)
        # Cloned: a device graph's next replay overwrites its outputs.
        first = logits.clone() if first is None else first
        token = logits.argmax(-1)
        tokens.append(token)
    return torch.stack(tokens, dim=1), first


def weight_bytes(weights: list[torch.Tensor], fmt: str, steps: int = 1) -> int:
    """Bytes `steps` decode steps read of `weights` (the linears') stored in weight format `fmt`."""
    per_weight, per_channel, per_group = FORMAT_BYTES[fmt]
    return steps * int(sum(w.numel() * per_weight + w.shape[0] * per_channel + w.numel() // INT4_GROUP * per_group
                   for w in weights))


def judge(output: Any, reference: Any, bound: float) -> tuple[bool, float, float, float]:
    """A lowered row's (within `bound`, largest |difference| of the first step's logits,
    that as a share of their largest magnitude, greedy tokens agreeing with the reference's).
    Tokens are free-running: after one differs, the next ones come from another context."""
    from .measure import lowered_error

    within, largest, relative = lowered_error(output[1], reference[1], bound)
    tokens, theirs = output[0].to(reference[0].device), reference[0]
    agreement = (tokens == theirs).float().mean().item() if tokens.shape == theirs.shape else 0.0
    return within, largest, relative, agreement


def shared_copy(model: Decoder, dtype: torch.dtype | None = None) -> Decoder:
    """A contender's copy: its own KV cache, the model's parameters shared (1.1B weights
    in memory once), or in `dtype` (a copy of them, the cache and the config in it too;
    the rotary frequencies stay float32 as the model keeps them)."""
    def own(p: nn.Parameter) -> nn.Parameter:
        return p if dtype is None else nn.Parameter(p.detach().to(dtype), requires_grad=False)

    copied = copy.deepcopy(model, {id(p): own(p) for p in model.parameters()})
    if dtype is not None:
        copied.config = dataclasses.replace(copied.config, dtype=dtype)
        for layer in copied.layers:
            attention = layer.self_attn
            attention.k_cache, attention.v_cache = attention.k_cache.to(dtype), attention.v_cache.to(dtype)
    return copied


def copy_bandwidth(device: str, quick: bool) -> tuple[float, str]:
    """(bytes per second, how) of a large copy on `device`, each byte read and written once:
    the memory traffic a step's weight reads can reach (past the last-level cache; small
    in a quick run)."""
    from .measure import hbm_bandwidth

    nbytes = (16 << 20) if quick else (1 << 30) if device.startswith("cuda") else (512 << 20)
    bandwidth = hbm_bandwidth(device, nbytes)
    return bandwidth, (f"the row's weight format: bytes its linears read per run / {bandwidth / 1e9:.1f} GB/s, "
                       f"a {nbytes / 2**20:.0f} MiB copy (read and write) at {torch.get_num_threads()} thread(s)")


def torchao_config(fmt: str, device: str) -> Any:
    """torchao's weight-only config for `fmt`: int8 per output channel; int4 in groups of 32
    (graphopt's), on the CPU packed for torch's CPU int4 kernel (torchao's prototype config)."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    if fmt == "int8":
        return Int8WeightOnlyConfig()
    if device.startswith("cuda"):
        return Int4WeightOnlyConfig(group_size=INT4_GROUP)
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

    return PrototypeInt4WeightOnlyConfig(group_size=INT4_GROUP)


def torchao_step(workload: Workload, fmt: str, device: str, dtype: torch.dtype | None = None) -> Step:
    """torchao's `quantize_` on a copy of the model (cast to `dtype` where given), then
    `torch.compile` of its forward. Raises ImportError when torchao (or its config for
    `fmt`) does not import."""
    config = torchao_config(fmt, device)
    from torchao.quantization import quantize_

    def wrap(forward: Callable) -> Step:
        quantize_(forward.__self__, config)
        return torch.compile(forward)

    return workload.bind(wrap, dtype)
