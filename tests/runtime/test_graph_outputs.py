"""GraphOutputs: the blocks CUDA graphs of one pool copy their outputs into, shared
by every capture size (exercised here on CPU tensors, outside any capture)."""

import pytest
import torch

from graphopt.runtime.graph_outputs import GraphOutputs, layouts


def test_every_size_writes_the_same_block_and_keeps_its_strides():
    store = GraphOutputs()
    handed = {}
    for size in (8, 4, 1):  # capture_all's order: the largest first
        logits = torch.randn(16, size).t()  # a transposed output keeps its strides
        wanted = layouts((logits,), ())
        store.reserve(wanted, torch.device("cpu"))
        (out,) = store.copy_out((logits,), wanted)
        assert torch.equal(out, logits) and out.stride() == logits.stride()
        assert out.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()
        handed[size] = out
    assert len({t.untyped_storage().data_ptr() for t in handed.values()}) == 1
    assert store.blocks[0].numel() == 8 * 16 * 4  # the largest size's bytes, once


def test_a_larger_output_gets_a_new_block_and_the_old_one_stays_with_its_graph():
    store = GraphOutputs()
    small = torch.ones(2, 3)
    store.reserve(layouts([small], ()), torch.device("cpu"))
    (kept,) = store.copy_out([small], layouts([small], ()))
    large = torch.full((5, 3), 2.0)
    store.reserve(layouts([large], ()), torch.device("cpu"))
    (grown,) = store.copy_out([large], layouts([large], ()))
    assert kept.untyped_storage().data_ptr() != grown.untyped_storage().data_ptr()
    assert torch.equal(kept, small) and torch.equal(grown, large)


@pytest.mark.parametrize("case", ["an argument", "an expanded view", "a number"])
def test_outputs_it_cannot_or_must_not_copy_are_handed_out_as_they_are(case):
    cache = torch.zeros(4, 3)
    value = {"an argument": cache[1:], "an expanded view": torch.ones(1, 3).expand(4, 3), "a number": 7}[case]
    wanted = layouts((value,), (cache,))
    assert wanted == [None]
    store = GraphOutputs()
    store.reserve(wanted, torch.device("cpu"))
    assert store.copy_out((value,), wanted)[0] is value and not store.blocks
