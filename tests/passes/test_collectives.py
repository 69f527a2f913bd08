"""Passes leave collectives alone: never removed, merged, folded, moved past one
another, or written into in place while their memory may be in flight. The
graphs are built by hand (nothing runs them, so no process group is needed)."""

from __future__ import annotations

import torch
import torch.fx

from graphopt.passes.base import is_collective
from graphopt.passes.cleanup import cse, dce
from graphopt.passes.constant_fold import fold_constants
from graphopt.passes.fusion import fusion_passes
from graphopt.passes.fusion.collective import fuse_all_reduce_norms
from graphopt.passes.memory_plan import liveness
from graphopt.passes.reinplace import reinplace_intermediates

aten, c10d, ops = torch.ops.aten, torch.ops._c10d_functional, torch.ops.graphopt
GROUP = "0"


class Builder:
    """An ATen FX graph with fake-free meta values: each node's `val` is an empty tensor."""

    def __init__(self) -> None:
        self.root = torch.nn.Module()
        self.graph = torch.fx.Graph()

    def input(self, name: str, shape=(4, 8)) -> torch.fx.Node:
        node = self.graph.placeholder(name)
        node.meta["val"] = torch.empty(shape)
        return node

    def constant(self, name: str, value: torch.Tensor) -> torch.fx.Node:
        self.root.register_buffer(name, value)
        node = self.graph.get_attr(name)
        node.meta["val"] = value
        return node

    def op(self, target, *args, val=None) -> torch.fx.Node:
        node = self.graph.call_function(target, args)
        node.meta["val"] = torch.empty(4, 8) if val is None else val
        return node

    def all_reduce(self, x: torch.fx.Node) -> torch.fx.Node:
        return self.op(c10d.wait_tensor.default, self.op(c10d.all_reduce.default, x, "sum", GROUP))

    def build(self, *outputs: torch.fx.Node) -> torch.fx.GraphModule:
        self.graph.output(tuple(outputs))
        return torch.fx.GraphModule(self.root, self.graph)


def targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def collectives(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if is_collective(n)]


def test_is_collective_names_communication_and_waits_only():
    b = Builder()
    x = b.input("x")
    reduced = b.all_reduce(x)
    fused = b.op(ops.all_reduce_add_rms_norm.default, x, x, None, 1e-6, "none", GROUP)
    add = b.op(aten.add.Tensor, reduced, x)
    b.build(add, fused)
    kinds = [(n.target, is_collective(n)) for n in b.graph.nodes if n.op == "call_function"]
    assert kinds == [(c10d.all_reduce.default, True), (c10d.wait_tensor.default, True),
                     (ops.all_reduce_add_rms_norm.default, True), (aten.add.Tensor, False)]


def test_dce_keeps_a_collective_nobody_reads():
    # Every rank must issue it: the others wait for this one.
    b = Builder()
    x = b.input("x")
    b.all_reduce(x)
    gm = b.build(x)
    assert not dce(gm).changed
    assert targets(gm) == [c10d.all_reduce.default, c10d.wait_tensor.default]


def test_cse_never_merges_two_identical_all_reduces():
    b = Builder()
    x = b.input("x")
    first, second = b.all_reduce(x), b.all_reduce(x)
    gm = b.build(b.op(aten.add.Tensor, first, second))
    cse(gm)
    assert targets(gm).count(c10d.all_reduce.default) == 2
    assert targets(gm).count(c10d.wait_tensor.default) == 2


def test_fold_constants_never_evaluates_a_collective_of_a_constant():
    b = Builder()
    x = b.input("x")
    ones = b.constant("ones", torch.ones(4, 8))
    reduced = b.all_reduce(b.op(aten.mul.Tensor, ones, 2.0))
    gm = b.build(b.op(aten.add.Tensor, reduced, x))
    fold_constants(gm)
    assert collectives(gm) == [c10d.all_reduce.default, c10d.wait_tensor.default]


def test_reinplace_never_writes_into_an_all_reduce_result():
    b = Builder()
    x, residual = b.input("x"), b.input("residual")
    reduced = b.all_reduce(b.op(aten.mul.Tensor, x, 2.0))
    gm = b.build(b.op(aten.add.Tensor, reduced, residual))
    assert not reinplace_intermediates(gm).changed
    assert aten.add.Tensor in targets(gm)


def test_reinplace_never_writes_into_what_a_collective_still_sends():
    # all_gather reads `h` until its wait: relu_ into h would change what the other ranks get.
    b = Builder()
    x = b.input("x")
    h = b.op(aten.mul.Tensor, x, 2.0)
    gather = b.op(c10d.all_gather_into_tensor.default, h, 2, GROUP, val=torch.empty(8, 8))
    relu = b.op(aten.relu.default, h)
    waited = b.op(c10d.wait_tensor.default, gather, val=torch.empty(8, 8))
    gm = b.build(relu, waited)
    assert not reinplace_intermediates(gm).changed
    assert aten.relu.default in targets(gm)


def test_reinplace_still_rewrites_ops_beside_collectives():
    b = Builder()
    x = b.input("x")
    h = b.op(aten.mul.Tensor, x, 2.0)
    relu = b.op(aten.relu.default, h)
    gm = b.build(b.all_reduce(relu))
    assert reinplace_intermediates(gm).counts == {"inplace": 1}
    assert aten.relu_.default in targets(gm)


def test_what_a_collective_reads_lives_until_its_wait():
    b = Builder()
    x = b.input("x")
    h = b.op(aten.mul.Tensor, x, 2.0)
    gather = b.op(c10d.all_gather_into_tensor.default, h, 2, GROUP, val=torch.empty(8, 8))
    other = b.op(aten.mul.Tensor, x, 3.0)
    waited = b.op(c10d.wait_tensor.default, gather, val=torch.empty(8, 8))
    gm = b.build(waited, other)
    spans = {buffer.storage[0]: (buffer.first, buffer.last) for buffer in liveness(gm.graph)}
    order = list(gm.graph.nodes)
    # h is sent until wait_tensor: it must not share memory with `other`, made meanwhile.
    assert spans[h] == (order.index(h), order.index(waited))
    # wait_tensor returns the gathered buffer itself, which lives to the output.
    assert waited not in spans and spans[gather][1] == order.index(gm.graph.output_node())


def test_all_reduce_then_add_rms_norm_becomes_one_op():
    b = Builder()
    x, residual, weight = b.input("x"), b.input("residual"), b.input("weight", (8,))
    reduced = b.all_reduce(x)
    norm = b.op(ops.add_rms_norm.default, residual, reduced, weight, 1e-6, "before_scale", val=None)
    gm = b.build(b.op(_getitem, norm, 0), b.op(_getitem, norm, 1))
    before = len(gm.graph.nodes)

    result = fuse_all_reduce_norms(gm)

    assert result.counts == {"all_reduce_add_rms_norm": 1}
    assert len(gm.graph.nodes) == before - 2
    fused = [n for n in gm.graph.nodes if n.target is ops.all_reduce_add_rms_norm.default]
    assert [a.name if isinstance(a, torch.fx.Node) else a for a in fused[0].args] == \
        ["x", "residual", "weight", 1e-6, "before_scale", GROUP]
    gm.graph.lint()


def test_no_fusion_across_another_collective_or_when_the_sum_is_read_elsewhere():
    b = Builder()
    x, y, residual = b.input("x"), b.input("y"), b.input("residual")
    first = b.all_reduce(x)
    second = b.all_reduce(y)  # issued between: fusing would move the first after it
    norm = b.op(ops.add_rms_norm.default, first, residual, None, 1e-6, "none")
    b.graph.output((b.op(_getitem, norm, 0), second))
    gm = torch.fx.GraphModule(b.root, b.graph)
    assert not fuse_all_reduce_norms(gm).changed

    b = Builder()
    x, residual = b.input("x"), b.input("residual")
    reduced = b.all_reduce(x)
    norm = b.op(ops.add_rms_norm.default, reduced, residual, None, 1e-6, "none")
    gm = b.build(b.op(_getitem, norm, 0), reduced)  # the reduced value is returned too
    assert not fuse_all_reduce_norms(gm).changed


def test_fusion_runs_after_fuse_norms():
    names = list(fusion_passes())
    assert names.index("fuse_all_reduce_norms") == names.index("fuse_norms") + 1


def _getitem(value, index):
    return value[index]
