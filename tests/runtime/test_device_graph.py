"""DeviceGraph: the reference's dynamic-graph example, on each backend."""

import pytest
import torch

import graphopt

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
def test_reference_example_output_follows_the_input(device):
    x = torch.zeros(4, 3, device=device)
    graph = graphopt.DeviceGraph(device)
    graph.capture_begin()
    y = x + 10
    graph.capture_end()
    graph.replay()
    torch.testing.assert_close(y, torch.full((4, 3), 10.0, device=device))
    x.copy_(torch.arange(12.0, device=device).view(4, 3))
    graph.replay()
    torch.testing.assert_close(y, torch.arange(12.0, device=device).view(4, 3) + 10)
    graph.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_graphs_in_one_pool(device):
    pool = graphopt.graph_pool_handle(device)
    x = torch.randn(16, 16, device=device)
    graphs, outputs = [], []
    for rows in (16, 8):
        graph = graphopt.DeviceGraph(device, pool=pool)
        graph.capture_begin()
        outputs.append(torch.relu(x[:rows] @ x[:rows].t()) + 1)
        graph.capture_end([outputs[-1]])
        graphs.append(graph)
    x.copy_(torch.randn(16, 16, device=device))
    graphs[1].replay()
    torch.testing.assert_close(outputs[1], torch.relu(x[:8] @ x[:8].t()) + 1)


def test_place_defaults_to_the_cpu_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the default place is the GPU")
    assert graphopt.DeviceGraph().device == torch.device("cpu")


def test_bad_mode_and_place():
    with pytest.raises(ValueError, match=r"mode must be one of \('global', 'thread_local', 'relaxed'\), got 'strict'"):
        graphopt.DeviceGraph("cpu", mode="strict")
    with pytest.raises(ValueError, match="device graphs run on CUDA or the CPU, not meta"):
        graphopt.DeviceGraph("meta")
