"""CUDA graphs of the tensor-parallel decoder on 2 GPUs (NCCL). Written, not yet
run: no machine with 2 GPUs was available. Each test spawns its own ranks."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

import graphopt
from graphopt.models import Decoder, DecoderConfig, ParallelDecoder, generate
from graphopt.runtime import cuda_graph

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one NCCL rank each)")]


def _prompts(batch: int) -> torch.Tensor:
    return torch.randint(0, 512, (batch, 3), generator=torch.Generator().manual_seed(batch)).cuda()


def decode_with_cuda_graphs(rank: int, world: int, fail_capture_on: int | None) -> dict:
    torch.manual_seed(0)
    full = Decoder(DecoderConfig.tiny()).eval()
    model = ParallelDecoder.from_decoder(full).cuda()
    full = full.cuda()
    if rank == fail_capture_on:  # this rank's first CUDA graph capture fails
        real_end = cuda_graph.CudaGraph.capture_end

        def failing_end(self, outputs=None):
            cuda_graph.CudaGraph.capture_end = real_end
            real_end(self, outputs)
            raise RuntimeError("capture failed on purpose")

        cuda_graph.CudaGraph.capture_end = failing_end
    config = graphopt.GraphOptimizationConfig(graph_opt_level=1, cudagraph_capture_sizes=[1, 2, 4])
    step = graphopt.optimize(model, config, pad_values={"slots": model.scratch_slot})
    same = all(torch.equal(generate(model, _prompts(b), 6, step=step), generate(full, _prompts(b), 6))
               for b in (3, 2))
    report = step.report()
    return {"same": same, "replays": report.replays, "fallbacks": list(report.fallbacks),
            "kinds": sorted(kind.value for kind in report.fallback_counts)}


def test_greedy_tokens_with_cuda_graphs_equal_the_single_gpu_model():
    for result in run_ranks(decode_with_cuda_graphs, None, backend="nccl", timeout=300):
        assert result["same"] and result["replays"] > 0 and not result["fallbacks"], result


def test_a_cuda_graph_capture_failing_on_one_rank_makes_every_rank_fall_back():
    results = run_ranks(decode_with_cuda_graphs, 1, backend="nccl", timeout=300)
    assert all(result["same"] for result in results)
    assert results[0]["replays"] == results[1]["replays"]
    assert all(result["kinds"] == ["capture_refused"] for result in results), results
    assert any("on another rank" in reason for reason in results[0]["fallbacks"])
    assert any("capture failed on purpose" in reason for reason in results[1]["fallbacks"])
