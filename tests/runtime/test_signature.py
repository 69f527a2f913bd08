"""The signature read from small Dynamo graphs of plain functions: which inputs are
static, which dims are the batch, and whether padding a batch is legal."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from graphopt._compat import dynamo
from graphopt.runtime.analysis.signature import BatchMismatch, Signature, batch_candidates, signature_of

LINEAR = torch.nn.Linear(4, 4)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


def read(fn, *args, written=None, dynamic_dims=None, mixing=None, pad_values=None) -> Signature:
    """The signature of the one graph Dynamo traces of `fn(*args)`, dim 0 of each
    tensor with more than one row dynamic."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() and arg.shape[0] > 1:
            dynamo.mark_dynamic(arg, 0)
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    ((gm, inputs),) = graphs
    candidates = batch_candidates(gm, dynamic_dims, inputs)
    mixing = {symbols: mixing for symbols in candidates}
    written = written or (lambda kinds: [False] * len(kinds))
    kinds = [kind for kind, _, _ in dynamo.graph_inputs(gm, inputs)]
    return signature_of(gm, dynamic_dims, pad_values or {}, written(kinds), inputs, mixing)


def scaled_linear(x, y):
    return LINEAR(x) * y[:, None]


def test_parameters_are_static_and_user_inputs_carry_the_batch():
    signature = read(scaled_linear, torch.randn(3, 4), torch.randn(3))
    assert signature.kinds.count("static") == 2  # the weight and the bias
    assert [d for d, kind in zip(signature.batch_dims, signature.kinds) if kind == "input"] == [0, 0]
    assert signature.out_dims == [0] and signature.exact_reason is None and signature.has_batch
    assert signature.batch_names == "dim 0 of 'x', dim 0 of 'y'"


def test_the_batch_of_a_call_comes_from_its_batch_sized_inputs():
    signature = read(scaled_linear, torch.randn(3, 4), torch.randn(3))
    args = [torch.randn(5, 4) if kind == "input" else torch.zeros(1) for kind in signature.kinds]
    args = [5 if kind == "symint" else a for a, kind in zip(args, signature.kinds)]
    assert signature.batch_of(args) == 5


def test_inputs_that_disagree_on_the_batch_raise():
    signature = Signature(kinds=["input", "input"], batch_dims=[0, 0], pads=[0, 0], batch_symints=[],
                          other_symints=[], out_dims=[0])
    with pytest.raises(BatchMismatch, match=r"\[2, 3\]"):
        signature.batch_of([torch.zeros(2), torch.zeros(3)])


def test_an_input_the_graph_writes_is_mutated_and_sized_by_the_batch_it_forbids_padding():
    def accumulate(x, total):
        total.add_(x)
        return total * 2

    signature = read(accumulate, torch.randn(3), torch.zeros(3),
                     written=lambda kinds: [kind == "input" and i == len(kinds) - 1 for i, kind in enumerate(kinds)])
    assert signature.kinds[-1] == "mutated" and signature.static[-1]
    assert "written in place" in signature.exact_reason


def test_an_output_twice_the_batch_forbids_padding():
    signature = read(lambda x: torch.cat([x, x]), torch.randn(3, 2))
    assert signature.out_dims == [None] and "output 0" in signature.exact_reason


def test_rows_that_mix_forbid_padding_with_the_ops_reason_first():
    signature = read(lambda x: x - x.mean(0), torch.randn(3, 2), mixing="aten.mean at line 1 mixes rows")
    assert signature.exact_reason == "aten.mean at line 1 mixes rows"


def test_a_batch_dynamo_specialised_to_one_row_is_the_static_batch():
    signature = read(lambda x: x * 2, torch.randn(1, 4))
    assert not signature.has_batch and signature.static_batch == 1


def test_pad_values_and_declared_dims_follow_the_argument_names():
    def gather(ids, table):
        return table[ids]

    signature = read(gather, torch.tensor([0, 2, 1]), torch.randn(5, 3), dynamic_dims={"ids": 0},
                     pad_values={"ids": 4})
    ids = signature.batch_dims.index(0)
    assert signature.pads[ids] == 4 and signature.batch_names == "dim 0 of 'ids'"
    assert [d for d in signature.batch_dims if d is not None] == [0]  # the table's rows are not the batch
