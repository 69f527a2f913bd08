from importlib.metadata import entry_points

import pytest
import torch
import torch._dynamo

import graphopt
from graphopt.config import tolerance
from support import decode_inputs

ATOL, RTOL = tolerance(torch.float32)


def test_backend_is_registered_by_name():
    assert "graphopt" in torch._dynamo.list_backends()


def test_backend_entry_point_is_declared():
    (entry,) = [e for e in entry_points(group="torch_dynamo_backends") if e.name == "graphopt"]
    assert entry.value == "graphopt.backend:graphopt_backend"
    assert entry.load() is graphopt.graphopt_backend


@pytest.mark.parametrize("level", [0, 1])
def test_torch_compile_with_backend_name(decoder, level):
    compiled = torch.compile(decoder, backend="graphopt", options={"graph_opt_level": level, "use_cudagraph": False})
    with torch.inference_mode():
        for batch in (2, 4):
            inputs = decode_inputs(batch)
            expected = decoder(*inputs)
            decoder.reset_cache()
            torch.testing.assert_close(compiled(*inputs), expected, atol=ATOL, rtol=RTOL)
            decoder.reset_cache()


def test_backend_options_are_validated(decoder):
    compiled = torch.compile(decoder, backend="graphopt", options={"use_cuda_graph": False})
    with pytest.raises(Exception, match=r"use_cuda_graph.*did you mean 'use_cudagraph'"):
        with torch.inference_mode():
            compiled(*decode_inputs(2))


def test_frozen_inputs_are_handed_to_the_passes_only_when_parameters_are_frozen(decoder):
    frozen = graphopt.optimize(decoder, graphopt.GraphOptimizationConfig(use_cudagraph=False, freeze_parameters=True))
    live = graphopt.optimize(decoder, graphopt.GraphOptimizationConfig(use_cudagraph=False))
    with torch.inference_mode():
        frozen(*decode_inputs(3))
        live(*decode_inputs(3))
    handed = frozen.graphs()[0].meta["graphopt_frozen_inputs"]
    named = dict(decoder.named_parameters()) | dict(decoder.named_buffers())
    assert len(handed) == len(named)
    assert {id(t) for t in handed.values()} == {id(t) for t in named.values()}
    assert "graphopt_frozen_inputs" not in live.graphs()[0].meta
