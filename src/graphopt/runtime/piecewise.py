"""Piecewise graphs: a Dynamo graph split at its splitting ops (as vLLM and
FastDeploy do), so the safe pieces can be captured and the rest run between replays.

    before:  x = a(x); i = nonzero(m); y = b(x, i)              one graph, not capturable
    after:   submod_0 = a | submod_1 = nonzero | submod_2 = b    0 and 2 captured, 1 runs eagerly

The splitting nodes come from `fake_run.py`. Pieces are compiled one by one, on
the fake values the graph has at their inputs (vLLM's piecewise compile).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from .. import _compat


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
    return split_gm, unsafe
