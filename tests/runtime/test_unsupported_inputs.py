"""Inputs a device graph cannot take make the runner fall back (with the reason in
the report) instead of failing inside the static buffers: a DTensor of torch's
tensor-parallel API, or the DeviceMesh Dynamo passes with it."""

from __future__ import annotations

import torch
from torch.testing._internal.two_tensor import TwoTensor

from graphopt.runtime.runner import _unsupported_input


class DeviceMesh:  # stands for torch's: an object that is neither a tensor nor a number
    pass


def test_plain_tensors_parameters_and_numbers_are_supported():
    assert _unsupported_input((torch.ones(2), torch.nn.Parameter(torch.ones(2)), 3, 0.5, True, None)) is None


def test_a_tensor_subclass_or_another_object_is_named():
    assert _unsupported_input((torch.ones(2), TwoTensor(torch.ones(2), torch.ones(2)))) == \
        "input 1 is a TwoTensor, a tensor subclass"
    assert _unsupported_input((torch.ones(2), 4, DeviceMesh())) == \
        "input 2 is a DeviceMesh, not a tensor or a number"
