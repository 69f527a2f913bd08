"""graphopt::add_layer_norm and graphopt::skip_layer_norm against the add and
LayerNorm they replace: the C++ CPU kernel and the torch reference, row sizes that
fill the vector width and ones that leave a tail, with and without weight and bias,
inputs that are not contiguous, other dtypes, several threads, and bad shapes."""

import pytest
import torch
import torch.nn.functional as F

from graphopt.config import tolerance
from graphopt.kernels import layer_norm as kernel

OPS = torch.ops.graphopt


def eager(x, residual, weight, bias, eps):
    summed = x + residual
    return F.layer_norm(summed, (x.shape[-1],), weight, bias, eps), summed


@pytest.fixture(params=["native", "reference"])
def implementation(request):
    """(add_layer_norm, skip_layer_norm) as the dispatcher runs them on the CPU, or the reference."""
    if request.param == "native":
        assert kernel.native_unavailable() is None, kernel.native_unavailable()
        return OPS.add_layer_norm.default, OPS.skip_layer_norm.default
    return kernel._reference, lambda *args: kernel._reference(*args)[0]


def check(actual, expected):
    atol, rtol = tolerance(expected.dtype)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape and actual.is_contiguous()
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", [(2, 3, 8), (64, 256), (5, 100), (3, 7, 768), (1, 1), (0, 16)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("affine", ["weight_and_bias", "weight", "neither"])
def test_equals_add_then_layer_norm(implementation, shape, affine):
    add_layer_norm, skip_layer_norm = implementation
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(shape, generator=gen) * 3 + 1, torch.randn(shape, generator=gen)
    weight = torch.randn(shape[-1], generator=gen) if affine != "neither" else None
    bias = torch.randn(shape[-1], generator=gen) if affine == "weight_and_bias" else None
    normed, summed = eager(x, residual, weight, bias, 1e-5)
    got_normed, got_summed = add_layer_norm(x, residual, weight, bias, 1e-5)
    check(got_normed, normed)
    check(got_summed, summed)
    check(skip_layer_norm(x, residual, weight, bias, 1e-5), normed)


def test_inputs_that_are_not_contiguous(implementation):
    add_layer_norm, skip_layer_norm = implementation
    x, residual = torch.randn(48, 6).t(), torch.randn(6, 96)[:, ::2]
    weight, bias = torch.randn(96)[::2], torch.randn(48)
    normed, summed = eager(x, residual, weight, bias, 1e-12)
    got_normed, got_summed = add_layer_norm(x, residual, weight, bias, 1e-12)
    check(got_normed, normed)
    check(got_summed, summed)
    check(skip_layer_norm(x, residual, weight, bias, 1e-12), normed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes_run_torchs_ops(implementation, dtype):
    add_layer_norm, _ = implementation
    x, residual, weight = torch.randn(4, 40).to(dtype), torch.randn(4, 40).to(dtype), torch.randn(40).to(dtype)
    normed, summed = eager(x, residual, weight, None, 1e-5)
    got_normed, got_summed = add_layer_norm(x, residual, weight, None, 1e-5)
    check(got_normed, normed)
    check(got_summed, summed)


def test_rows_split_across_threads_give_the_same_values():
    assert kernel.native_unavailable() is None, kernel.native_unavailable()
    x, residual, weight, bias = torch.randn(512, 256), torch.randn(512, 256), torch.randn(256), torch.randn(256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = OPS.skip_layer_norm(x, residual, weight, bias, 1e-5)
        torch.set_num_threads(2)
        two = OPS.skip_layer_norm(x, residual, weight, bias, 1e-5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_x_and_residual_of_different_shapes_are_refused(implementation):
    add_layer_norm, _ = implementation
    with pytest.raises((RuntimeError, ValueError),
                       match=r"x and residual must have one shape, got \[2, 4\] and \[1, 4\]"):
        add_layer_norm(torch.randn(2, 4), torch.randn(1, 4), None, None, 1e-5)


def test_a_weight_of_another_size_is_refused():
    assert kernel.native_unavailable() is None, kernel.native_unavailable()
    with pytest.raises(RuntimeError, match="weight must be a vector of the normalised dim's size 4"):
        OPS.skip_layer_norm(torch.randn(2, 4), torch.randn(2, 4), torch.randn(5), None, 1e-5)


def test_fake_results_have_the_inputs_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 5, 8)
        normed, summed = OPS.add_layer_norm(x, torch.empty(3, 5, 8), torch.empty(8), torch.empty(8), 1e-5)
        skipped = OPS.skip_layer_norm(x, torch.empty(3, 5, 8), None, None, 1e-5)
    assert normed.shape == summed.shape == skipped.shape == (3, 5, 8)
