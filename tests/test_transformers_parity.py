"""Parity of graphopt levels 0, 1 and 2 with eager on Hugging Face transformers models.

Every model is built from a tiny config with random weights (`torch.manual_seed`);
nothing is downloaded. Each optimized model is called the way users call the eager
one, with keyword arguments, for two batch sizes through the same `OptimizedModule`:
the batch dim is dynamic, so at levels 1 and 2 one graph must serve both sizes.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from support import assert_close_tree, unexpected_fallbacks

import graphopt
from graphopt._compat import inductor
from graphopt.config import tolerance

transformers = pytest.importorskip("transformers")

VOCAB = 128
SEQ_LEN = 8
BATCH_SIZES = (2, 3)
LEVELS = (0, 1, 2)


def _llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64))


def _gpt2() -> torch.nn.Module:
    # GPT-2's default bos/eos ids (50256) lie outside a 128-token vocabulary.
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=64,
        bos_token_id=0, eos_token_id=0))


def _qwen2() -> torch.nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64))


def _bert() -> torch.nn.Module:
    # add_pooling_layer=True (the default): the pooled output is compared too.
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64))


# name -> (builder, is_decoder, the output keys eager must produce)
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], bool, tuple[str, ...]]] = {
    "llama": (_llama, True, ("logits",)),
    "gpt2": (_gpt2, True, ("logits",)),
    "qwen2": (_qwen2, True, ("logits",)),
    "bert": (_bert, False, ("last_hidden_state", "pooler_output")),
}


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]().eval().to(torch.float32)


def _inputs(name: str, batch: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    kwargs: dict[str, Any] = {
        "input_ids": torch.randint(0, VOCAB, (batch, SEQ_LEN), generator=gen),
        "attention_mask": torch.ones(batch, SEQ_LEN, dtype=torch.long),
    }
    if MODELS[name][1]:
        kwargs["use_cache"] = False  # no cache object in the output
    return kwargs


def _optimize(model: torch.nn.Module, level: int) -> graphopt.OptimizedModule:
    # use_cudagraph=False: the device-graph runtime is not built yet.
    config = graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=False)
    return graphopt.optimize(model, config)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Dynamo's caches and recompile counters are per process: keep each test's own."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# Qwen2 is Llama's architecture with biased q/k/v projections: at level 2 (an Inductor
# compile of 12-30 s on 2 cores) `-m slow` runs it; level 1 checks it in the default run.
SLOW = {("qwen2", 2)}


@pytest.mark.parametrize("name, level", [
    pytest.param(name, level, id=f"{name}-L{level}", marks=[pytest.mark.slow] if (name, level) in SLOW else [])
    for name in MODELS for level in LEVELS])
def test_parity_with_eager(name: str, level: int) -> None:
    if level == 2 and not inductor.inductor_available():
        pytest.skip("graph_opt_level=2 needs a C++ compiler for Inductor on CPU")
    model = _build(name)
    opt = _optimize(model, level)

    for batch in BATCH_SIZES:
        kwargs = _inputs(name, batch, seed=batch)
        with torch.inference_mode():
            expected = model(**kwargs)
            actual = opt(**kwargs)
        assert tuple(expected.keys()) == MODELS[name][2], f"eager {name} gives keys {list(expected.keys())}"
        assert_close_tree(actual, expected, f"{name} L{level} batch={batch}")

    report = opt.report()
    assert not unexpected_fallbacks(report), f"unexpected fallbacks: {unexpected_fallbacks(report)}"
    if level == 0:
        assert opt.graphs() == []
        assert report.graphs == []
        return

    # One graph with a symbolic batch dim serves both sizes; more means a graph
    # break or a recompile.
    assert len(report.graphs) <= 2, f"{len(report.graphs)} graphs for 2 batch sizes:\n{report}"
    graphs = opt.graphs()
    assert graphs, f"no graph recorded:\n{report}"
    assert all(isinstance(gm, torch.fx.GraphModule) for gm in graphs)

    if level == 1:
        passes = report.to_dict()["passes"]
        assert passes, f"no pass recorded at level 1:\n{report}"
        for record in passes:
            assert {"name", "changed", "counts"} <= record.keys(), record
            assert isinstance(record["name"], str) and record["name"]
            assert isinstance(record["changed"], bool)
            assert isinstance(record["counts"], dict)
            assert all(isinstance(k, str) and isinstance(v, int) for k, v in record["counts"].items())
        assert any(record["changed"] for record in passes), (
            f"level 1 changed nothing in {name}'s graph:\n{report}")


def test_llama_left_padded_batch_level1() -> None:
    """A left-padded row (mask zeros at the start), with position ids from the mask as
    `generate()` builds them. Eager is finite at every position (padded queries attend
    to nothing, which transformers' SDPA mask handles), so all positions are compared."""
    model = _build("llama")
    opt = _optimize(model, 1)

    for batch in BATCH_SIZES:
        kwargs = _inputs("llama", batch, seed=10 + batch)
        mask = kwargs["attention_mask"]
        mask[0, :3] = 0  # row 0: 3 pad tokens on the left
        if batch > 2:
            mask[2, :1] = 0  # row 2: 1 pad token
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            expected = model(**kwargs)
            actual = opt(**kwargs)
        where = f"llama L1 left-padded batch={batch}"
        real = mask.bool()
        atol, rtol = tolerance(torch.float32)
        # The positions that matter first, so a failure says whether real tokens differ.
        torch.testing.assert_close(actual.logits[real], expected.logits[real], atol=atol, rtol=rtol,
                                   msg=lambda m: f"{where}, non-padded positions: {m}")
        assert torch.isfinite(expected.logits).all(), f"{where}: eager is not finite on padded positions"
        assert_close_tree(actual, expected, where)

    report = opt.report()
    assert len(report.graphs) <= 2, f"{len(report.graphs)} graphs for 2 batch sizes:\n{report}"
    assert opt.graphs()
