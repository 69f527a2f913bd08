"""A model sharded with torch's own tensor-parallel API (`parallelize_module`,
ColwiseParallel / RowwiseParallel, DTensor on a gloo CPU device mesh) through
graphopt on 2 ranks: equal to the unsharded model wherever it runs, never silently
wrong, at every level. Device graphs fall back, with the reason in the report: the
graph's inputs include the DeviceMesh (and level 2 on the CPU has no host graphs)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import graphopt

VARIANTS = [(level, graphs) for level in (0, 1, 2) for graphs in (False, True)]


class Block(torch.nn.Module):
    """Pre-norm residual MLP: the shape of a decoder layer's second half."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(32, eps=1e-6)
        self.up = torch.nn.Linear(32, 64, bias=False)
        self.down = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block()).eval()


def every_variant(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    reference = _model()
    model = parallelize_module(_model(), mesh, {f"{i}.{name}": style for i in range(2)
                                                for name, style in (("up", ColwiseParallel()),
                                                                    ("down", RowwiseParallel()))})
    xs = [torch.randn(b, 32, generator=torch.Generator().manual_seed(b)) for b in (3, 2, 3, 3, 2, 3)]
    found = {}
    with torch.inference_mode():
        expected = [reference(x) for x in xs]
        for level, graphs in VARIANTS:
            torch._dynamo.reset()
            config = graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=graphs,
                                                      cudagraph_capture_sizes=[2, 4])
            opt = graphopt.optimize(model, config)
            try:
                outs = [opt(x) for x in xs]
            except Exception as error:  # noqa: BLE001 - recorded for the test to show
                found[(level, graphs)] = {"error": f"{type(error).__name__}: {error}"[:300]}
                continue
            report = opt.report() if level or graphs else None
            found[(level, graphs)] = {
                "difference": max((o - e).abs().max().item() for o, e in zip(outs, expected)),
                "replays": report.replays if report else 0,
                "kinds": sorted(kind.value for kind in report.fallback_counts) if report else []}
    return found


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(every_variant, timeout=240)


@pytest.mark.parametrize("graphs", [False, True], ids=["no_graphs", "host_graphs"])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_torch_tp_api_model_equals_the_unsharded_model(ranks, level, graphs):
    for found in (result[(level, graphs)] for result in ranks):
        assert "error" not in found, found["error"]
        assert found["difference"] < 1e-5
        if graphs:
            assert found["replays"] == 0
            # Level 0 and 1: a DeviceMesh argument; level 2: Inductor's kernels on CPU.
            assert found["kinds"] == ["no_device_graph"]
