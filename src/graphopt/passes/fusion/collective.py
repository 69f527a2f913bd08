"""All-reduce + residual add + RMSNorm as one op: the end of every tensor-parallel
attention and MLP block (row-parallel projection, sum over ranks, residual, norm).

Runs after `fuse_norms`, whose `graphopt.add_rms_norm` it extends by the all-reduce
that feeds it. Level 1 only, like the norm ops: at level 2 Inductor schedules the
collective itself.
"""

from __future__ import annotations

import torch
import torch.fx

from ...kernels import collective as _kernels  # noqa: F401 - defines graphopt::all_reduce_add_rms_norm
from ..base import PassResult, is_collective

functional = torch.ops._c10d_functional
ops = torch.ops.graphopt


def fuse_all_reduce_norms(gm: torch.fx.GraphModule) -> PassResult:
    """Fold a sum all-reduce into the add + RMSNorm that reads it.

        before:  all_reduce = _c10d_functional.all_reduce(o_proj, 'sum', '0')
                 wait_tensor = _c10d_functional.wait_tensor(all_reduce)
                 add_rms_norm = graphopt.add_rms_norm(residual, wait_tensor, w, 1e-06, 'before_scale')
        after:   add_rms_norm = graphopt.all_reduce_add_rms_norm(o_proj, residual, w, 1e-06, 'before_scale', '0')

    Either operand of the add may be the reduced one (a float add commutes exactly).
    Only when the all-reduce and its wait are read by nothing else, and no other
    collective lies between the all-reduce and the norm: the fused op issues the
    all-reduce where the norm was, and moving it past another collective would
    change the order in which the ranks communicate.
    """
    fused = 0
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if node.op != "call_function" or node.target is not ops.add_rms_norm.default or node.kwargs:
            continue
        x, residual, *rest = node.args
        for reduced, other in ((x, residual), (residual, x)):
            all_reduce = _waited_sum(reduced)
            if all_reduce is None or _collective_between(nodes, all_reduce, reduced, node):
                continue
            source, _, group = all_reduce.args
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(ops.all_reduce_add_rms_norm.default, (source, other, *rest, group))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            gm.graph.erase_node(reduced)
            gm.graph.erase_node(all_reduce)
            fused += 1
            break
    return PassResult(changed=fused > 0, counts={"all_reduce_add_rms_norm": fused} if fused else {})


def _waited_sum(node: object) -> torch.fx.Node | None:
    """The all-reduce `node` waits for, when it is a sum read only through `node`."""
    if not isinstance(node, torch.fx.Node) or node.target is not functional.wait_tensor.default \
            or len(node.users) != 1:
        return None
    source = node.args[0]
    if not isinstance(source, torch.fx.Node) or source.target is not functional.all_reduce.default \
            or len(source.users) != 1 or source.args[1] != "sum":
        return None
    return source


def _collective_between(nodes: list[torch.fx.Node], first: torch.fx.Node, wait: torch.fx.Node,
                        last: torch.fx.Node) -> bool:
    """Whether a collective other than `first`'s own wait lies between `first` and `last`."""
    return any(is_collective(n) and n is not wait for n in nodes[nodes.index(first) + 1:nodes.index(last)])
