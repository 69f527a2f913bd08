"""Piecewise graphs: a Dynamo graph split at its splitting ops (as vLLM and
FastDeploy do), so the safe pieces can be captured and the rest run between replays.

    before:  x = a(x); i = nonzero(m); y = b(x, i)              one graph, not capturable
    after:   submod_0 = a | submod_1 = nonzero | submod_2 = b    0 and 2 captured, 1 runs eagerly

The splitting nodes come from `fake_run.py`. The backend compiles the pieces one by
one, on the fake values the graph has at their inputs (`pieces_on_fakes`; vLLM's
piecewise compile).
"""

from __future__ import annotations

import operator
from typing import Any, Iterator, Sequence

import torch.fx
from torch.fx.passes.split_module import split_module

from ..._compat import fake


def split(gm: torch.fx.GraphModule, nodes: dict[torch.fx.Node, str]) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    """`gm` as a graph of pieces (`submod_<i>` submodules, in the original order),
    each splitting node alone in its piece. Returns it and {piece name: reason} for
    the pieces that must not be captured."""
    piece, partition, unsafe = 0, {}, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node in nodes:
            piece += 1
            unsafe[f"submod_{piece}"] = nodes[node]
            partition[node] = piece
            piece += 1
        else:
            partition[node] = piece
    split_gm = split_module(gm, gm, lambda node: partition[node], keep_original_order=True)
    _tuple_outputs(split_gm)
    return split_gm, unsafe


def _tuple_outputs(split_gm: torch.fx.GraphModule) -> None:
    """Make every piece return a tuple (AOTAutograd compiles only those): a piece
    returning one value returns `(value,)`, and its caller takes item 0."""
    for call in list(split_gm.graph.nodes):
        if call.op != "call_module":
            continue
        piece = getattr(split_gm, call.target)
        output = piece.graph.output_node()
        if isinstance(output.args[0], (tuple, list)):
            continue
        output.args = ((output.args[0],),)
        piece.recompile()
        with split_gm.graph.inserting_after(call):
            item = split_gm.graph.call_function(operator.getitem, (call, 0))
        call.replace_all_uses_with(item, delete_user_cb=lambda user: user is not item)
    split_gm.recompile()


def pieces_on_fakes(split_gm: torch.fx.GraphModule,
                    example_inputs: Sequence[Any]) -> Iterator[tuple[str, torch.fx.GraphModule, list]]:
    """(name, piece, the fake values it gets) for each piece of `split_gm` in order, when
    the graph runs on the fakes of `example_inputs`. Every piece runs before the first is
    handed out (compiling one may change its graph), and they are handed out inside the
    graph's fake mode, where they ran."""
    calls = []

    class _Recorder(torch.fx.Interpreter):
        def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
            piece = self.fetch_attr(target)
            calls.append((target, piece, list(args)))
            return piece(*args, **kwargs)

    fake_mode, fakes = fake.backend_fakes(example_inputs)
    with fake.fake_tracing(fake_mode):
        _Recorder(split_gm).run(*fakes)
        yield from calls
