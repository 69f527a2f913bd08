"""Every pass of levels 1 and 2 over a zoo of tiny Hugging Face transformers models.

Each model is built from a tiny random config (nothing is downloaded), optimized at
level 1 and level 2 (`use_cudagraph=False`), and called once: its output must equal
eager within `graphopt.config.tolerance`, and the report must hold no fallback, so a
pass the manager had to undo (an invalid graph) fails here. The zoo covers what the
fusions see in practice: RMSNorm with a weight and with Gemma's `1 + weight`, q/k
norms (Qwen3, Gemma3), sliding windows and logit soft-capping (Gemma2/3), fused
qkv and gate/up projections (Phi3), Conv1D layers (GPT-2), a mixture of experts,
an encoder, and vision models (ViT, ResNet).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from support import unexpected_fallbacks

import graphopt
from graphopt._compat import inductor
from graphopt.config import tolerance
from graphopt.passes import manager

transformers = pytest.importorskip("transformers")

VOCAB = 128
SEQ_LEN = 8
BATCH = 2
# One layer each, hidden size 32: every pass sees every kind of op, and level 2
# compiles in seconds.
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _decoder(model: type, config: type, **extra: Any) -> Callable[[], torch.nn.Module]:
    return lambda: model(config(**{**DECODER, **extra}))


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": _decoder(transformers.LlamaForCausalLM, transformers.LlamaConfig),
    "qwen2": _decoder(transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
    # head_dim != hidden_size / heads, on purpose.
    "qwen3": _decoder(transformers.Qwen3ForCausalLM, transformers.Qwen3Config, head_dim=16),
    "mistral": _decoder(transformers.MistralForCausalLM, transformers.MistralConfig),
    "gemma": _decoder(transformers.GemmaForCausalLM, transformers.GemmaConfig, head_dim=16),
    "gemma2": _decoder(transformers.Gemma2ForCausalLM, transformers.Gemma2Config, head_dim=16),
    "gemma3": _decoder(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig, head_dim=16),
    "phi3": _decoder(transformers.Phi3ForCausalLM, transformers.Phi3Config, pad_token_id=0),
    "qwen3_moe": _decoder(transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig, head_dim=16,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    # GPT-2's default bos/eos ids (50256) lie outside a 128-token vocabulary.
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_inner=64, n_positions=64,
        bos_token_id=0, eos_token_id=0)),
    "bert": lambda: transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64)),
    "vit": lambda: transformers.ViTModel(transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=64)),
    "resnet": lambda: transformers.ResNetModel(transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")),
}
VISION = ("vit", "resnet")
ENCODERS = ("bert",)
# Level 2 compiles each of these in 12-20 s on 2 cores; `-m slow` runs them. The
# default run keeps one of each kind: q/k norms, `1 + weight` norms, encoder, vision.
SLOW_AT_LEVEL_2 = {"llama", "qwen2", "mistral", "gemma2", "gemma3", "phi3", "qwen3_moe", "gpt2"}


CASES = [case for name in MODELS for case in (
    pytest.param(name, 1, id=f"{name}-L1"),
    pytest.param(name, 2, id=f"{name}-L2", marks=[pytest.mark.slow] if name in SLOW_AT_LEVEL_2 else []))]


def _inputs(name: str) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    if name in VISION:
        return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=generator)}
    kwargs: dict[str, Any] = {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=generator),
                              "attention_mask": torch.ones(BATCH, SEQ_LEN, dtype=torch.long)}
    if name not in ENCODERS:
        kwargs["use_cache"] = False  # no cache object in the output
    return kwargs


def _tensors(output: Any) -> dict[str, torch.Tensor]:
    return {key: value for key, value in output.items() if isinstance(value, torch.Tensor)}


def _check(name: str, level: int, kwargs: dict[str, Any]) -> None:
    """Optimize model `name` at `level`, call it with `kwargs`: eager's outputs, no fallback."""
    if level == 2 and not inductor.inductor_available():
        pytest.skip("graph_opt_level=2 needs a C++ compiler for Inductor on CPU")
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=False))
    with torch.inference_mode():
        expected, actual = _tensors(model(**kwargs)), _tensors(opt(**kwargs))

    report = opt.report()
    assert not unexpected_fallbacks(report), f"{name} L{level}: fallbacks {unexpected_fallbacks(report)}\n{report}"
    assert report.graphs, f"{name} L{level}: nothing was compiled"
    assert {record.name for record in report.passes} == set(manager.PIPELINES[level])
    assert expected and actual.keys() == expected.keys()
    for key, value in expected.items():
        atol, rtol = tolerance(value.dtype)
        torch.testing.assert_close(actual[key], value, atol=atol, rtol=rtol,
                                   msg=lambda m: f"{name} L{level} {key}: {m}")


@pytest.mark.parametrize("name, level", CASES)
def test_every_pass_keeps_the_model_exact(name: str, level: int) -> None:
    _check(name, level, _inputs(name))


def test_qwen3_level_2_with_a_constant_causal_mask() -> None:
    """Batch 1 (a static graph) without an attention mask: the causal mask is a
    constant, folded, and read by SDPA, which Inductor calls as a library kernel."""
    ids = torch.randint(0, VOCAB, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    _check("qwen3", 2, {"input_ids": ids, "use_cache": False})
