"""Greedy-token agreement: for a causal LM's graph under compute_dtype or
weight_quantization, the report gives how many greedy tokens of the lowered graph equal
full precision's on the compile's call, beside the error; it never decides a fallback."""

import re

import pytest
import torch
from support import decode_inputs, unexpected_fallbacks

import graphopt
from graphopt._compat import mkldnn
from graphopt.models import Decoder, DecoderConfig
from graphopt.passes import lowered_error, precision, quantize

aten = torch.ops.aten


@pytest.fixture
def decoder() -> Decoder:
    """One layer: its logits are a causal LM's all the same, and each layer adds its share to
    every compile."""
    torch.manual_seed(0)
    return Decoder(DecoderConfig.tiny(num_layers=1)).eval()


@pytest.fixture(autouse=True)
def native_bf16(monkeypatch):
    monkeypatch.setattr(mkldnn, "cpu_has_native_bf16", lambda: True)


def optimized(model, **config):
    config = {"graph_opt_level": 1, **config}
    return graphopt.optimize(model, graphopt.GraphOptimizationConfig(use_cudagraph=False, **config))


def greedy(logits):
    return logits.argmax(-1)


@pytest.mark.fresh_cache
def test_bfloat16_decode_step_agrees_on_every_greedy_token(decoder):
    opt = optimized(decoder, compute_dtype="bfloat16")
    with torch.inference_mode():
        out, expected = opt(*decode_inputs(4)), decoder(*decode_inputs(4))
    assert torch.equal(greedy(out), greedy(expected))
    error = opt.report().graphs[0].precision
    # A decode step: one token per sequence.
    assert (error["token_agreement"], error["tokens_compared"]) == (1.0, 4)
    assert "greedy tokens agree on 4 of 4 (100%) (kept)" in str(opt.report())
    assert opt.report().to_dict()["graphs"][0]["precision"]["token_agreement"] == 1.0


def test_a_prefill_compares_the_first_steps_of_each_sequence(decoder):
    prompt = torch.randint(0, decoder.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    positions, slots = torch.arange(12).expand(2, 12), torch.arange(2)
    opt = optimized(decoder.prefill, compute_dtype="bfloat16", token_agreement_steps=6)
    with torch.inference_mode():
        out, expected = opt(prompt, positions, slots), decoder.prefill(prompt, positions, slots)
    error = opt.report().graphs[0].precision
    # Measured on the compile's call, which this one is: its first 6 positions of both sequences.
    agreeing = int(torch.sum(greedy(out)[:, :6] == greedy(expected)[:, :6]))
    assert error["tokens_compared"] == 12 and error["token_agreement"] == agreeing / 12
    assert agreeing >= 10  # bfloat16 flips a near-tie now and then (one in 24 tokens here)


def test_a_coarse_quantization_disagrees_and_the_report_says_so(decoder, monkeypatch):
    # Weights in {-1, 0, 1} times a scale: far coarser than int8, so greedy tokens flip.
    monkeypatch.setattr(quantize, "_LEVELS", 1)
    opt = optimized(decoder, freeze_parameters=True, weight_quantization="int8", precision_tolerance=None)
    with torch.inference_mode():
        out, expected = opt(*decode_inputs(8)), decoder(*decode_inputs(8))
    error = opt.report().graphs[0].precision
    agreeing = int(torch.sum(greedy(out) == greedy(expected)))
    assert error["tokens_compared"] == 8 and error["token_agreement"] == agreeing / 8 < 1
    line = f"greedy tokens agree on {agreeing} of 8 ({100 * agreeing / 8:.3g}%) (kept)"
    assert line in str(opt.report())
    assert unexpected_fallbacks(opt.report()) == {}


def embedding_graph(vocab: int) -> torch.fx.GraphModule:
    """A graph that embeds token ids from a [vocab, 4] table, as a causal LM's does."""
    graph = torch.fx.Graph()
    table, ids = graph.placeholder("table"), graph.placeholder("ids")
    table.meta["val"] = torch.empty(vocab, 4)
    graph.output(graph.call_function(aten.embedding.default, (table, ids)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_the_agreement_counts_the_first_steps_only():
    gm = embedding_graph(vocab=10)
    logits = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(0))
    flipped = logits.clone()
    flipped[1, 2] = -flipped[1, 2]  # the last position of sequence 1 predicts another token
    assert lowered_error.token_agreement(gm, [logits], [flipped], steps=2) == (4, 4)
    assert lowered_error.token_agreement(gm, [logits], [flipped], steps=3) == (5, 6)
    # Results whose last dim is not the vocabulary (hidden states, a KV cache) are not logits.
    assert lowered_error.token_agreement(gm, [torch.randn(2, 4)], [torch.randn(2, 4)], steps=3) is None
    assert lowered_error.token_agreement(embedding_graph(vocab=11), [logits], [flipped], steps=3) is None


def test_a_flipped_token_within_tolerance_does_not_fall_back():
    gm = embedding_graph(vocab=3)
    gm.meta[precision.AGREEMENT_STEPS] = 8
    expected, actual = torch.tensor([[2.0, 1.99, 0.0]]), torch.tensor([[1.99, 2.0, 0.0]])
    error = lowered_error.measured_error(gm, [expected], [actual], tolerance=0.05)
    assert error["token_agreement"] == 0.0 and error["tokens_compared"] == 1
    assert error["relative_error"] == pytest.approx(0.005) and not error["fell_back"]


def test_a_graph_without_logits_reports_no_agreement():
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    error = lowered_error.measured_error(gm, [torch.ones(4, 8)], [torch.ones(4, 8)], 0.05)
    assert "token_agreement" not in error and "tokens_compared" not in error


@pytest.mark.parametrize("steps", [0, -1])
def test_the_steps_must_be_positive(steps):
    with pytest.raises(ValueError, match=re.escape(f"token_agreement_steps must be an int >= 1, got {steps}")):
        graphopt.GraphOptimizationConfig(graph_opt_level=1, token_agreement_steps=steps)
