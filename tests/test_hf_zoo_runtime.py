"""Device graphs over a zoo of tiny Hugging Face transformers models, at level 1.

Each model (random weights from a tiny config; nothing is downloaded) goes through
`graphopt.optimize(model, cfg)` with capture sizes 1, 2, 4 and one warm-up, and is
called at batch sizes 1, 2, 3 and 4, three times each: batches 1, 2 and 4 run at
their own capture size, batch 3 is padded up to 4. Every call must give eager's
output within `graphopt.config.tolerance`, and the report must show each capture
size captured once and each call after its capture replayed.

The passes themselves, without device graphs, are tested by test_hf_zoo_passes.py.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from support import assert_close_tree, unexpected_fallbacks

import graphopt

transformers = pytest.importorskip("transformers")

VOCAB = 128
SEQ_LEN = 8
IMAGE = 32
CONFIG = graphopt.GraphOptimizationConfig(graph_opt_level=1, cudagraph_capture_sizes=[1, 2, 4],
                                          cudagraph_num_of_warmups=1)

# What each call of a batch does, in order, with one warm-up: the first call at a
# new capture size warms up, the second captures (its own run is its result), the
# third replays. Batch 3 runs at size 4 (padded), so batch 4 finds size 4 captured.
# Batch 1 and batch 2 run different Dynamo graphs (Dynamo specialises size 1), and
# the first call of a new graph is a warm-up like any other.
CALLS: list[tuple[int, list[str]]] = [
    (1, ["warm-up", "capture", "replay"]),
    (2, ["warm-up", "capture", "replay"]),
    (3, ["warm-up", "capture", "replay"]),
    (4, ["replay", "replay", "replay"]),
]
CAPTURE_SIZE = {1: 1, 2: 2, 3: 4, 4: 4}


def _decoder(model: str, config: str, **extra: Any) -> Callable[[], torch.nn.Module]:
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    return lambda: getattr(transformers, model)(getattr(transformers, config)(**{**base, **extra}))


def _encoder(model: str, config: str) -> Callable[[], torch.nn.Module]:
    return lambda: getattr(transformers, model)(getattr(transformers, config)(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64))


# name -> (builder, kind): kind says which inputs it takes.
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], str]] = {
    "llama": (_decoder("LlamaForCausalLM", "LlamaConfig"), "decoder"),
    "qwen2": (_decoder("Qwen2ForCausalLM", "Qwen2Config"), "decoder"),
    "qwen3": (_decoder("Qwen3ForCausalLM", "Qwen3Config", head_dim=16), "decoder"),
    "mistral": (_decoder("MistralForCausalLM", "MistralConfig"), "decoder"),
    # Phi-3's default pad id (32000) lies outside a 128-token vocabulary.
    "phi3": (_decoder("Phi3ForCausalLM", "Phi3Config", pad_token_id=0), "decoder"),
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4, n_inner=128, n_positions=64,
        bos_token_id=0, eos_token_id=0)), "decoder"),
    "opt": (lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, ffn_dim=128,
        max_position_embeddings=64, word_embed_proj_dim=64, pad_token_id=1, bos_token_id=2,
        eos_token_id=2)), "decoder"),
    # A mixture of experts: 4 experts, 2 per token, transformers' default `grouped_mm`
    # experts (tokens sorted by expert, multiplied in groups, put back: row-wise, so it
    # pads); the `batched_mm` experts are tested below.
    "mixtral": (_decoder("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
                "decoder"),
    "bert": (_encoder("BertModel", "BertConfig"), "encoder"),
    "roberta": (_encoder("RobertaModel", "RobertaConfig"), "encoder"),
    "vit": (lambda: transformers.ViTModel(transformers.ViTConfig(
        image_size=IMAGE, patch_size=8, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=128)), "vision"),
    # Depth multiplier 0.35: MobileNetV2's 17 blocks, with few channels each.
    "mobilenet_v2": (lambda: transformers.MobileNetV2Model(transformers.MobileNetV2Config(
        image_size=IMAGE, depth_multiplier=0.35)), "vision"),
    "swin": (lambda: transformers.SwinModel(transformers.SwinConfig(
        image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4)),
        "vision"),
}


def _inputs(kind: str, batch: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(batch)
    if kind == "vision":
        return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=generator)}
    inputs: dict[str, Any] = {"input_ids": torch.randint(0, VOCAB, (batch, SEQ_LEN), generator=generator),
                              "attention_mask": torch.ones(batch, SEQ_LEN, dtype=torch.long)}
    if kind == "decoder":
        inputs["use_cache"] = False  # no cache object in the output
    return inputs


# MobileNetV2 takes 35-80 s on 2 cores (17 blocks, compiled and captured per size); `-m slow`
# runs it. The default run keeps the other vision models: ViT, and Swin's convs and windows.
SLOW = {"mobilenet_v2"}


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [])
                                  for name in MODELS])
def test_every_capture_size_captures_and_replays_with_eager_outputs(name: str) -> None:
    build, kind = MODELS[name]
    torch.manual_seed(0)
    model = build().eval()
    opt = graphopt.optimize(model, CONFIG.replace(cache_dir=graphopt.config.default_cache_dir()))
    report = opt.report()

    with torch.inference_mode():
        for batch, expected_calls in CALLS:
            inputs = _inputs(kind, batch)
            expected = model(**inputs)
            for call, what in enumerate(expected_calls):
                replays, captures = report.replays, len(report.captures)
                where = f"{name} batch {batch} call {call} ({what})"
                # Compared before the next call: a replay overwrites the previous outputs.
                assert_close_tree(opt(**inputs), expected, where)
                new_captures = [c.size for c in report.captures[captures:]]
                assert new_captures == ([CAPTURE_SIZE[batch]] if what == "capture" else []), (
                    f"{where}: captured sizes {new_captures}\n{report}")
                assert report.replays - replays == (what == "replay"), f"{where}: replays went " \
                                                                       f"{replays} -> {report.replays}\n{report}"

    assert sorted(c.size for c in report.captures) == [1, 2, 4]
    assert report.recaptures == 0, report
    assert not unexpected_fallbacks(report), f"unexpected fallbacks: {unexpected_fallbacks(report)}"


def test_a_moe_with_batched_experts_pads_too() -> None:
    """transformers' `batched_mm` experts gather each token's experts' weights per
    token: row-wise as well, so batch 3 is padded to 4."""
    torch.manual_seed(0)
    model = _decoder("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2)().eval()
    model.set_experts_implementation("batched_mm")
    opt = graphopt.optimize(model, CONFIG)
    with torch.inference_mode():
        for batch in (2, 3, 3, 3, 4):
            inputs = _inputs("decoder", batch)
            assert_close_tree(opt(**inputs), model(**inputs), f"batch {batch}")
    report = opt.report()
    assert [c.size for c in report.captures] == [4], report
    assert not unexpected_fallbacks(report), report
