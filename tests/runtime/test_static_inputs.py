"""StaticInputs and CapturedInputs on their own: user inputs copied and padded into
buffers allocated once at the largest capture size, everything else passed through;
a captured graph's inputs copied, rebound, or the reason it must be captured again."""

from __future__ import annotations

import torch

from graphopt.report import Report
from graphopt.runtime.analysis.signature import Signature
from graphopt.runtime.static_inputs import CapturedInputs, StaticInputs


def signature(kinds: list[str], batch_dims: list[int | None], pads=None, batch_symints=()) -> Signature:
    return Signature(kinds=kinds, batch_dims=batch_dims, pads=pads or [0] * len(kinds),
                     batch_symints=list(batch_symints), other_symints=[], out_dims=[0])


def test_a_batch_is_copied_into_its_buffer_and_padded_with_the_pad_value():
    inputs = StaticInputs(signature(["input"], [0], pads=[-1]), largest=8, clone_input=True)
    x = torch.arange(6.0).reshape(3, 2)
    (arg,) = inputs.fill([x], batch=3, size=4)
    assert arg.shape == (4, 2) and arg.data_ptr() != x.data_ptr()
    torch.testing.assert_close(arg[:3], x)
    torch.testing.assert_close(arg[3], torch.full((2,), -1.0))


def test_every_capture_size_reads_one_buffer_allocated_at_the_largest():
    inputs = StaticInputs(signature(["input"], [0]), largest=8, clone_input=True)
    small = inputs.fill([torch.ones(1, 2)], batch=1, size=2)[0]
    large = inputs.fill([torch.ones(7, 2)], batch=7, size=8)[0]
    assert small.data_ptr() == large.data_ptr() and len(inputs.buffers) == 1
    assert next(iter(inputs.buffers.values())).shape == (8, 2)


def test_a_batch_at_its_capture_size_has_no_padding_and_the_buffer_itself_is_not_copied():
    inputs = StaticInputs(signature(["input"], [0]), largest=4, clone_input=True)
    (arg,) = inputs.fill([torch.ones(4, 2)], batch=4, size=4)
    arg.fill_(3.0)  # passing the buffer back: nothing is copied over it
    (again,) = inputs.fill([arg], batch=4, size=4)
    assert again.data_ptr() == arg.data_ptr() and bool((again == 3.0).all())


def test_static_and_mutated_inputs_pass_through_and_the_batch_symint_becomes_the_size():
    inputs = StaticInputs(signature(["static", "mutated", "symint", "input"], [None, None, None, 0],
                                    batch_symints=[2]), largest=8, clone_input=True)
    weight, cache = torch.ones(2), torch.zeros(8, 2)
    args = inputs.fill([weight, cache, 3, torch.ones(3, 2)], batch=3, size=4)
    assert args[0] is weight and args[1] is cache and args[2] == 4 and args[3].shape == (4, 2)


def test_clone_input_decides_whether_an_input_without_a_batch_dim_is_copied():
    table = torch.randn(5, 3)
    copied = StaticInputs(signature(["input"], [None]), largest=8, clone_input=True).fill([table], None, None)[0]
    left = StaticInputs(signature(["input"], [None]), largest=8, clone_input=False).fill([table], None, None)[0]
    assert copied.data_ptr() != table.data_ptr() and torch.equal(copied, table)
    assert left is table


def test_a_broadcast_dim_keeps_stride_0():
    inputs = StaticInputs(signature(["input"], [0]), largest=8, clone_input=True)
    row = torch.arange(4.0)
    (arg,) = inputs.fill([row.expand(3, 4)], batch=3, size=4)
    assert arg.shape == (4, 4) and arg.stride(0) == 0
    torch.testing.assert_close(arg[0], row)


def test_a_batch_dim_that_is_not_outermost_gets_a_buffer_per_size_in_the_inputs_layout():
    inputs = StaticInputs(signature(["input"], [1]), largest=8, clone_input=True)
    x = torch.arange(6.0).reshape(2, 3)
    (arg,) = inputs.fill([x], batch=3, size=4)
    assert arg.shape == (2, 4) and arg.is_contiguous()
    torch.testing.assert_close(arg[:, :3], x)
    inputs.fill([torch.ones(2, 7)], batch=7, size=8)
    assert len(inputs.buffers) == 2


class Rebinding:
    """What CapturedInputs asks of a device graph: to rebind, or why it cannot."""

    def __init__(self, why: str | None = None):
        self.why, self.rebound = why, []

    def rebind(self, old: torch.Tensor, new: torch.Tensor) -> str | None:
        self.rebound.append((old, new))
        return self.why


def test_a_captured_graphs_input_at_a_new_address_is_copied_into_the_captured_one():
    x, cache = torch.zeros(4), torch.zeros(4)
    inputs = CapturedInputs((x, cache), static=[False, True], rebinds=True)
    assert inputs.args[0] is x and inputs.args[1] is not cache  # a private alias of the static one
    assert inputs.args[1].data_ptr() == cache.data_ptr()
    report, graph = Report(1), Rebinding()
    assert inputs.take((torch.arange(4.0), cache), graph, report) is None
    torch.testing.assert_close(x, torch.arange(4.0))
    assert graph.rebound == [] and report.rebinds == 0


def test_a_new_static_tensor_is_rebound_or_says_why_the_graph_is_captured_again():
    cache, weight = torch.zeros(4), torch.nn.Parameter(torch.ones(4), requires_grad=False)
    inputs = CapturedInputs((cache, weight), static=[True, True], rebinds=True)
    report, new_cache = Report(1), torch.ones(4)
    graph = Rebinding()
    assert inputs.take((new_cache, weight), graph, report) is None
    assert graph.rebound == [(inputs.args[0], new_cache)] and report.rebinds == 1
    assert cache.sum() == 0  # the caller's old tensor is never written
    refused = Rebinding("a CUDA graph reads and writes its inputs at the addresses it captured")
    assert inputs.take((torch.ones(4), weight), refused, report) == \
        "input 0 is a new tensor and a CUDA graph reads and writes its inputs at the addresses it captured"
    new_weight = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    assert inputs.take((inputs.args[0], new_weight), graph, report) == "input 1 is a new tensor and it is a parameter"
