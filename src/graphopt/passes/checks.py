"""What a pass is held to: the graph run on real inputs before and after it
(`GraphRun`: its outputs and the final state of each input it writes), compared at
each dtype's tolerance (`check_same`); and the copy of a graph that undoes a pass
(`Snapshot`)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from .._compat import fake
from .._compat.names import tensor_leaves
from ..config import tolerance
from .base import written_roots


class PassVerificationError(RuntimeError):
    """A pass left an invalid graph or changed what the graph computes (raised with
    `verify=True`)."""


def written_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """The positions of the placeholders some node of `gm` writes (a KV cache's copy_)."""
    roots = written_roots(gm.graph)
    return [i for i, node in enumerate(gm.graph.find_nodes(op="placeholder")) if node in roots]


class GraphRun:
    """Runs of one graph, as passes rewrite it, on `inputs`. Only the inputs the graph
    writes are copied per run (so the caller's buffers are untouched) and compared:
    the others are read in place. With frozen weights among the inputs, a copy per run
    was a copy of every weight, and the error of lower precision was measured on each."""

    def __init__(self, gm: torch.fx.GraphModule, inputs: Sequence[Any]):
        self.gm, self.inputs, self.written = gm, inputs, written_inputs(gm)

    def __call__(self, name: str | None = None) -> list[torch.Tensor]:
        """The outputs, then the final state of each input the graph wrote before the
        first pass; random ops reseeded. A pass (`name`) that makes the graph write an
        input it did not write before is an error: that would write a weight."""
        now = written_inputs(self.gm)
        added = sorted(set(now) - set(self.written))
        if added:
            names = [self.gm.graph.find_nodes(op="placeholder")[i].name for i in added]
            raise PassVerificationError(
                f"pass {name!r} made the graph write its inputs {names}, which it did not write before; "
                f"disable it with disabled_passes=[{name!r}] and report the graph (debug_dump_dir)")
        with fake.outside_fake_mode(), torch.random.fork_rng(devices=[]), torch.no_grad():
            args = [x.clone() if i in self.written and isinstance(x, torch.Tensor) else x
                    for i, x in enumerate(self.inputs)]
            torch.manual_seed(0)
            out = self.gm(*args)
        return tensor_leaves(out) + [args[i] for i in self.written if isinstance(args[i], torch.Tensor)]


def check_same(name: str, expected: list[torch.Tensor], actual: list[torch.Tensor]) -> None:
    """Raise PassVerificationError unless pass `name` left every result as it was."""
    if len(expected) != len(actual):
        raise PassVerificationError(
            f"pass {name!r} changed the number of graph outputs ({len(expected)} -> {len(actual)}); "
            f"disable it with disabled_passes=[{name!r}]")
    for i, (e, a) in enumerate(zip(expected, actual)):
        atol, rtol = tolerance(e.dtype)
        if e.shape != a.shape or e.dtype != a.dtype:
            problem = f"{tuple(e.shape)}/{e.dtype} became {tuple(a.shape)}/{a.dtype}"
        elif torch.allclose(e, a, atol=atol, rtol=rtol, equal_nan=True):
            continue
        else:
            diff = (e.double() - a.double()).abs().nan_to_num(float("inf")).max().item()
            problem = f"max abs difference {diff:.3g} (atol={atol}, rtol={rtol})"
        raise PassVerificationError(
            f"pass {name!r} changed the graph's results: value {i} differs, {problem}. "
            f"Disable it with disabled_passes=[{name!r}] and report the graph (debug_dump_dir).")


def graph_state(gm: torch.fx.GraphModule) -> tuple:
    """What a graph module's code and a Snapshot's copy are made of: its Graph, and each
    node with its name, op, target, arguments and meta entries (the values by identity).
    A pass that leaves the state as it was (most steps of a pipeline) needs no copy,
    lint or recompile after it."""
    return gm.graph, tuple((n, n.name, n.op, n.target, n.args, n.kwargs, tuple(n.meta), tuple(map(id, n.meta.values())))
                           for n in gm.graph.nodes)


def same_state(a: tuple | None, b: tuple) -> bool:
    """Whether two graph_state()s are equal; unsure (a tensor argument compared by value) is no."""
    try:
        return a == b
    except (RuntimeError, TypeError, ValueError):
        return False


class Snapshot:
    """A graph module as it was before a pass: a copy of its nodes (their names and
    meta), its tensors and submodules (the objects, not copies), and its meta, so that
    a pass that broke the graph can be undone. The objects are kept because a pass may
    free a folded value and store another under its name (quantizing a concatenated
    weight): undone, the graph must read the value it read before. The nodes are kept
    as their graph_state (name, op, target, arguments) and a copy of each one's meta
    and type, not as a copy of the Graph: that took 0.3 s a pass on the ~1B decoder's
    28,000 nodes. The copies are `earlier`'s where the graph has not changed since it
    was taken (they are only read, and hold the meta values the state names)."""

    def __init__(self, gm: torch.fx.GraphModule, earlier: Snapshot | None = None):
        self.state = graph_state(gm)
        unchanged = earlier is not None and same_state(earlier.state, self.state)
        self.metas = earlier.metas if unchanged else [(dict(n.meta), n.type) for n in gm.graph.nodes]
        self.attributes = _attributes(gm)
        self.meta = _meta_copy(gm.meta)

    def restore(self, gm: torch.fx.GraphModule) -> None:
        """Put the saved nodes back into gm's own Graph object (Inductor holds on to it
        at level 2), and remove the attributes the pass added."""
        graph = gm.graph
        nodes = list(graph.nodes)
        for node in nodes:  # unlinked first: a broken graph may read a node before it is defined
            node.args, node.kwargs = (), {}
        for node in reversed(nodes):
            graph.erase_node(node)
        copies: dict[torch.fx.Node, torch.fx.Node] = {}
        for (node, name, op, target, args, kwargs, *_), (meta, type_) in zip(self.state[1], self.metas):
            copied = graph.create_node(op, target, torch.fx.map_arg(args, copies.__getitem__),
                                     torch.fx.map_arg(kwargs, copies.__getitem__), name, type_)
            # The graph never frees a name, so the copy was given a new one; frozen
            # parameters are found by their placeholder's name.
            copied.name, copied.meta = name, dict(meta)
            copies[node] = copied
        for name in set(_attributes(gm)) - set(self.attributes):
            delattr(gm, name)
        for name, (kind, value) in self.attributes.items():
            if _attributes(gm).get(name, (None, None))[1] is value:
                continue
            if hasattr(gm, name):
                delattr(gm, name)
            if kind in ("buffer", "non-persistent buffer"):
                gm.register_buffer(name, value, persistent=kind == "buffer")
            elif kind == "parameter":
                gm.register_parameter(name, value)
            else:
                setattr(gm, name, value)
        gm.meta.clear()
        # A copy again: a pass run after the restore adds to it, and the snapshot may be
        # restored once more (the logits' finer formats, manager.py).
        gm.meta.update(_meta_copy(self.meta))


def _meta_copy(meta: dict) -> dict:
    """`meta` with each dict in it copied: a pass may add to a dict of gm.meta in place
    (fold_constants' refresh recipes)."""
    return {key: dict(value) if isinstance(value, dict) else value for key, value in meta.items()}


def _attributes(gm: torch.fx.GraphModule) -> dict[str, tuple[str, Any]]:
    """What a get_attr node can read, by name: gm's own tensors and submodules, each as
    (how it is registered, the object)."""
    persistent = gm.state_dict(keep_vars=True)
    return {**{k: ("attribute", v) for k, v in vars(gm).items() if isinstance(v, torch.Tensor)},
            **{k: ("module", v) for k, v in gm.named_children()},
            **{k: ("buffer" if k in persistent else "non-persistent buffer", v)
               for k, v in gm.named_buffers(recurse=False)},
            **{k: ("parameter", v) for k, v in gm.named_parameters(recurse=False)}}
