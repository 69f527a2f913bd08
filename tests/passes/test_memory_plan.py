"""Memory planning: the arena planner, liveness of ATen graphs (checked against a real
run), and the report's memory section."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import aot_graph, decode_inputs

import graphopt
from graphopt._compat import aot_autograd, fake
from graphopt.arena import ALIGN, aligned, live_bytes, plan_offsets
from graphopt.config import GraphOptimizationConfig
from graphopt.passes.manager import PassManager
from graphopt.passes.memory_plan import GraphPlan, plan_graph
from graphopt.passes.reinplace import reinplace_intermediates
from graphopt.report import Report
from graphopt.runtime.host_graph import HostGraph

aten = torch.ops.aten


def assert_disjoint(spans: list[tuple[int, int, int]], offsets, nbytes: int) -> None:
    """Every two buffers alive at once occupy different bytes, all inside the arena."""
    for (first, last, size), offset in zip(spans, offsets):
        assert offset % ALIGN == 0 and offset + aligned(size) <= nbytes
    for i, (fa, la, sa) in enumerate(spans):
        for j in range(i):
            fb, lb, sb = spans[j]
            if sa and sb and fa <= lb and fb <= la:
                oa, ob = offsets[i], offsets[j]
                assert oa + aligned(sa) <= ob or ob + aligned(sb) <= oa, (spans[i], spans[j])


# -- the planner on abstract (first, last, size) buffers --------------------------------------

def test_buffers_that_never_meet_share_memory():
    plan = plan_offsets([(0, 1, 1000), (2, 3, 1000), (4, 5, 1000)])
    assert plan.offsets == (0, 0, 0) and plan.nbytes == aligned(1000)


def test_buffers_alive_together_are_stacked_and_aligned():
    spans = [(0, 5, 100), (1, 5, 10), (2, 5, 64), (3, 3, 0)]
    plan = plan_offsets(spans)
    assert plan.nbytes == aligned(100) + aligned(10) + aligned(64) == 256
    assert_disjoint(spans, plan.offsets, plan.nbytes)
    assert plan_offsets([]).nbytes == 0


def test_a_freed_gap_is_reused():
    # a big buffer dies, two smaller ones alive later fit where it was
    spans = [(0, 1, 4096), (0, 9, 1024), (2, 9, 2048), (3, 9, 2048)]
    plan = plan_offsets(spans)
    assert plan.nbytes == 1024 + 4096 == live_bytes(spans)
    assert_disjoint(spans, plan.offsets, plan.nbytes)


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 10), st.integers(0, 5000)), max_size=60))
@settings(deadline=None, derandomize=True, max_examples=200)
def test_random_buffers_never_overlap(raw):
    spans = [(first, first + length, size) for first, length, size in raw]
    plan = plan_offsets(spans)
    assert_disjoint(spans, plan.offsets, plan.nbytes)
    assert live_bytes(spans) <= plan.nbytes <= sum(aligned(size) for _, _, size in spans)


# -- liveness of ATen graphs -------------------------------------------------------------------

def chain(x):
    return (((x * 2).relu() + 1).sin() - 3).exp()


def test_chain_needs_two_buffers_then_one_after_reinplacing():
    x = torch.randn(16, 64)
    graph = aot_graph(chain, x)
    size = aligned(x.nbytes)
    planned = plan_graph(graph.gm.graph)
    assert len(planned.buffers) == 6
    assert planned.naive_bytes == 6 * size
    assert planned.plan.nbytes == planned.live_bytes == 2 * size   # an op's input and output
    assert planned.sizes == {}

    assert reinplace_intermediates(graph.gm).counts == {"inplace": 5}
    planned = plan_graph(graph.gm.graph)
    assert len(planned.buffers) == 1 and planned.plan.nbytes == size
    (buffer,) = planned.buffers
    assert buffer.last == len(graph.gm.graph.nodes) - 1          # an output: live to the end


def views_extend_life(x):
    t = x * 2
    flat = t.view(-1)           # read after two other ops: t lives until then
    u = (x + 1).relu()
    return u.sum() + flat.sum()


def test_views_extend_their_base_and_inputs_are_not_planned():
    x = torch.randn(8, 8)
    graph = aot_graph(views_extend_life, x)
    nodes = list(graph.gm.graph.nodes)
    planned = plan_graph(graph.gm.graph)
    by_creator = {b.storage[0]: b for b in planned.buffers}
    t = next(n for n in nodes if n.target is aten.mul.Tensor)
    flat_reader = next(n for n in nodes if n.target is aten.sum.default and n.args[0].target is aten.view.default)
    assert by_creator[t].last == nodes.index(flat_reader)
    assert all(b.storage[0].op == "call_function" for b in planned.buffers)
    assert not any(n.target is aten.view.default for n in by_creator)   # a view is not a buffer


def real_lifetimes(gm: torch.fx.GraphModule, inputs: list) -> dict[torch.fx.Node, tuple[int, int]]:
    """Run the graph, keeping every value alive (no address is reused), and return for
    each node that made new memory: (its index, the index of the last node reading
    that memory through any tensor)."""
    made: dict[int, tuple[torch.fx.Node, int]] = {}
    last: dict[int, int] = {}
    seen: set[int] = set()
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def ptrs(value) -> list[int]:
        return [t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(value)
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0]

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            args = [self.env[a] for a in node.all_input_nodes]
            for p in ptrs(args):
                last[p] = index[node]
            result = super().run_node(node)
            for p in ptrs(result):
                if p not in seen:
                    seen.add(p)
                    if node.op == "call_function":
                        made[p] = (node, index[node])
                        last[p] = index[node]
            return result

    with fake.outside_fake_mode(), torch.no_grad():
        Recorder(gm, garbage_collect_values=False).run(*[x.clone() for x in inputs])
    return {node: (first, last[p]) for p, (node, first) in made.items()}


def check_plan(gm: torch.fx.GraphModule, planned: GraphPlan, inputs: list | None = None) -> None:
    spans = [(b.first, b.last, b.nbytes) for b in planned.buffers]
    assert_disjoint(spans, planned.plan.offsets, planned.plan.nbytes)
    assert planned.live_bytes <= planned.plan.nbytes <= planned.naive_bytes
    if inputs is not None:  # each buffer is new memory, and lives at least as long as it is read
        real = real_lifetimes(gm, inputs)
        planned_by_creator = {b.storage[0]: b for b in planned.buffers if b.nbytes}
        for node, (first, last) in real.items():
            buffer = planned_by_creator.get(node)
            assert buffer is not None, f"{node.format_node()} made memory the plan does not know"
            assert buffer.first == first and buffer.last >= last, node.format_node()


def fuzz_programs():
    # Imported when drawn: test_fuzz imports this module's check_plan.
    from test_fuzz import programs

    return programs(min_ops=8, max_ops=20)


@settings(deadline=None, database=None, derandomize=True, max_examples=20,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.deferred(fuzz_programs))
def test_plans_of_random_programs_are_sound(program):
    """Programs from the differential fuzzer through the level-1 pipeline, verified
    pass by pass (reinplace_intermediates included); then the final graph's plan
    against a real run of it."""
    from test_fuzz import ProgramModule

    torch._dynamo.reset()
    model = ProgramModule(program).eval()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, program.widths[0], generator=generator)
    y = torch.randn(3, program.widths[1], generator=generator)
    report = Report(1)
    config = GraphOptimizationConfig(graph_opt_level=1, verify=True, freeze_parameters=program.freeze)
    graphs = []

    def backend(gm, example_inputs):
        def compile_fw(aot_gm, _):
            PassManager(config, report).run(aot_gm, 0, verify_inputs=list(example_inputs))
            graphs.append((aot_gm, list(example_inputs)))
            return aot_autograd.boxed(aot_gm)
        return aot_autograd.aot_inference(gm, example_inputs, compile_fw)

    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=False)(x, y)
    assert graphs
    for gm, inputs in graphs:
        check_plan(gm, gm.meta["graphopt_memory"], inputs)


# -- the host graph plans its arena with the same planner ---------------------------------------

def test_host_graph_arena_is_the_planned_arena():
    x = torch.randn(32, 32)
    graph = HostGraph()
    graph.capture_begin()
    out = ((x * 2) + 1) * 3     # three ops: [0, 1], [1, 2], [2, end]
    graph.capture_end([out])
    size = x.nbytes
    assert graph.nbytes == plan_offsets([(0, 1, size), (1, 2, size), (2, 3, size)]).nbytes == 2 * aligned(size)
    x.copy_(torch.randn(32, 32))
    graph.replay()
    torch.testing.assert_close(out, ((x * 2) + 1) * 3)


# -- the report -------------------------------------------------------------------------------------

@pytest.mark.fresh_cache
def test_report_memory_section_for_the_reference_decoder(decoder):
    opt = graphopt.optimize(decoder, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False))
    batch = 3
    with torch.inference_mode():
        for b in (batch, 5):
            torch.testing.assert_close(opt(*decode_inputs(b)), decoder(*decode_inputs(b)))
    report = opt.report()
    assert len(report.memory) == len(report.graphs) == 1
    (memory,) = report.to_dict()["memory"]
    # planned at the batch the dynamic graph was traced with: the first call's
    assert list(memory["sizes"].values()) == [batch]
    logits = batch * decoder.config.vocab_size * 4   # an output, so a buffer of its own
    assert logits <= memory["largest_buffer_bytes"] <= memory["live_bytes"]
    assert memory["live_bytes"] <= memory["planned_bytes"] < memory["naive_bytes"]
    assert memory["planned_bytes"] < memory["naive_bytes"] / 2
    assert memory["buffers"] > 20
    assert "memory at " in str(report)
    record = next(p for p in report.passes if p.name == "reinplace_intermediates")
    assert record.counts["inplace"] > 0
    assert opt.graphs()[0].meta["graphopt_memory"].plan.nbytes == memory["planned_bytes"]
