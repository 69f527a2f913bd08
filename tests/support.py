"""Helpers the tests share: decode-step inputs, the ATen graphs passes see, a module
whose forward branches on an attribute, a compile cache's entries."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.fx

from graphopt import FallbackKind, cache_trust
from graphopt._compat import aot_autograd
from graphopt.models import DecoderConfig


def cache_entries(cache_dir) -> list[Path]:
    """A compile cache's graph entries: its files but the signing key and the traced
    search patterns (patterns/)."""
    return sorted(p for p in Path(cache_dir).glob("??/*") if p.is_file() and p.name != cache_trust.KEY_FILE)


# The compile cache's own fallbacks (a trace it could not store for a later process):
# they never change what runs in this one.
CACHE_KINDS = (FallbackKind.CACHE_OFF, FallbackKind.CACHE_NOT_LOADED, FallbackKind.CACHE_NOT_STORED,
               FallbackKind.TRACE_NOT_STORED, FallbackKind.TRACE_NOT_USED)


def unexpected_fallbacks(report) -> dict[FallbackKind, int]:
    """A report's fallback counts by kind but the compile cache's own."""
    return {kind: n for kind, n in report.fallback_counts.items() if kind not in CACHE_KINDS}


def decode_inputs(batch: int, position: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's (input_ids, positions, slots) for `batch` sequences."""
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, DecoderConfig.tiny().vocab_size, (batch,), generator=generator)
    return ids, torch.full((batch,), position), torch.arange(batch)


class AtenGraph:
    """A functional ATen graph and how to call it with the traced function's own
    arguments (Dynamo orders graph inputs by first use, not by position)."""

    def __init__(self, gm: torch.fx.GraphModule, order: list[int]):
        self.gm, self.order = gm, order

    def __call__(self, *args):
        return self.gm(*[args[i] for i in self.order])


def aot_graph(fn, *args) -> AtenGraph:
    """The functional ATen graph graphopt's passes receive for `fn(*args)`, traced
    with static shapes."""
    graphs, orders = [], []
    traced_args = [a.clone() for a in args]

    def backend(gm, example_inputs):
        orders.append([next(i for i, a in enumerate(traced_args) if a is x) for x in example_inputs])
        return aot_autograd.aot_inference(gm, example_inputs, fw_compiler)

    def fw_compiler(gm, _inputs):
        graphs.append(gm)
        return aot_autograd.boxed(gm)

    torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)(*traced_args)
    assert len(graphs) == 1
    return AtenGraph(graphs[0], orders[0])


def targets(graph: AtenGraph | torch.fx.GraphModule) -> list:
    gm = graph.gm if isinstance(graph, AtenGraph) else graph
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def assert_close_tree(actual, expected, where: str) -> None:
    """Every tensor of an output (a tensor, a tuple or list, a dict or transformers'
    ModelOutput, nested) equal to eager's within the dtype's tolerance, keys and
    container types alike; anything else exactly equal."""
    from graphopt.config import tolerance

    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: got {type(actual).__name__}, not a tensor"
        atol, rtol = tolerance(expected.dtype)
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{where}: {m}")
    elif isinstance(expected, (tuple, list)):
        assert isinstance(actual, type(expected)) and len(actual) == len(expected), (
            f"{where}: got {type(actual).__name__} of {len(actual)}, eager gives "
            f"{type(expected).__name__} of {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close_tree(a, e, f"{where}[{i}]")
    elif isinstance(expected, dict):  # transformers' ModelOutput is an OrderedDict
        assert type(actual) is type(expected), (
            f"{where}: output is {type(actual).__qualname__}, eager gives {type(expected).__qualname__}")
        assert list(actual.keys()) == list(expected.keys()), f"{where}: output keys differ"
        for key in expected.keys():
            assert_close_tree(actual[key], expected[key], f"{where}.{key}")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def assert_gradients_match(step, model: torch.nn.Module, x: torch.Tensor) -> None:
    """The gradients of `step(x).square().sum()` on `model`'s parameters equal eager's."""
    model.zero_grad()
    step(x).square().sum().backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for got, expected in zip(ours, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, expected)


class Switch(torch.nn.Module):
    """A linear then `act`: a forward that branches on a module attribute, which only
    Dynamo's guard on that attribute sees change."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.act = "relu"

    def forward(self, x):
        y = self.lin(x)
        return torch.relu(y) if self.act == "relu" else torch.tanh(y)
