"""The tensor-parallel reference decoder on 2 CPU ranks (gloo): greedy tokens equal
the single-process Decoder's at every level, with and without host graphs, and
level 1 fuses each all-reduce into the add + RMSNorm after it.

One pair of ranks runs every variant (spawning and importing torch is most of a
test's time on a small machine); the tests below read its results."""

from __future__ import annotations

import time

import pytest
import torch
import torch._dynamo
from harness import run_ranks

import graphopt
from graphopt.models import Decoder, DecoderConfig, ParallelDecoder, generate

NEW_TOKENS = 6
CONFIG = DecoderConfig.tiny(num_layers=1)  # compile time dominates: one layer has every pattern
BATCHES = (3, 2)  # 3 is padded to capture size 4
VARIANTS = [(level, graphs) for level in (0, 1, 2) for graphs in (False, True)]


def _prompts(batch: int) -> torch.Tensor:
    return torch.randint(0, 512, (batch, 3), generator=torch.Generator().manual_seed(batch))


def generate_every_variant(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    full = Decoder(CONFIG).eval()
    expected = {b: generate(full, _prompts(b), NEW_TOKENS) for b in BATCHES}
    model = ParallelDecoder.from_decoder(full)
    found = {"eager": {b: generate(model, _prompts(b), NEW_TOKENS) for b in BATCHES}}
    for level, graphs in VARIANTS:
        torch._dynamo.reset()
        config = graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=graphs,
                                                  cudagraph_capture_sizes=[1, 2, 4])
        step = graphopt.optimize(model, config, pad_values={"slots": model.scratch_slot})
        start = time.perf_counter()
        try:  # a compile error is the same on every rank, before the step communicates
            found[(level, graphs)] = {b: generate(model, _prompts(b), NEW_TOKENS, step=step) for b in BATCHES}
        except Exception as error:  # noqa: BLE001 - recorded for the test to show
            found[(level, graphs)] = {"error": f"{type(error).__name__}: {error}"[:300]}
            continue
        if level or graphs:
            report = step.report()
            found[(level, graphs)].update(replays=report.replays, fallbacks=list(report.fallbacks),
                                          captures=sorted({c.size for c in report.captures}),
                                          fused=[dict(g.fused_ops) for g in report.graphs])
        print(f"rank {rank}: level {level}, graphs {graphs}: {time.perf_counter() - start:.1f} s", flush=True)
    return {"expected": expected, "found": found}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(generate_every_variant, timeout=300)


def _check_tokens(ranks: list[dict], variant: object) -> dict:
    for rank, result in enumerate(ranks):
        found = result["found"][variant]
        assert "error" not in found, (rank, found["error"])
        for batch in BATCHES:
            assert torch.equal(found[batch], result["expected"][batch]), (rank, variant, batch)
    return ranks[0]["found"][variant]


def test_eager_tensor_parallel_model_equals_the_single_process_model(ranks):
    _check_tokens(ranks, "eager")


@pytest.mark.parametrize("graphs", [False, True], ids=["no_graphs", "host_graphs"])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_greedy_tokens_equal_the_single_process_model(ranks, level, graphs):
    found = _check_tokens(ranks, (level, graphs))
    if graphs and level < 2:  # level 2 on the CPU runs Inductor's kernels without host graphs
        assert found["replays"] > 0 and not found["fallbacks"]  # replayed, never fell back
        assert found["captures"] == [2, 4]  # batch 3 padded to 4: rows proven independent (#25)


def test_level_1_fuses_every_all_reduce_before_a_norm(ranks):
    # Per layer: after attention and after the MLP; the embedding's all-reduce has no residual.
    for graphs in (False, True):
        fused = ranks[0]["found"][(1, graphs)]["fused"]
        assert [ops.get("all_reduce_add_rms_norm") for ops in fused] == [2 * CONFIG.num_layers]
