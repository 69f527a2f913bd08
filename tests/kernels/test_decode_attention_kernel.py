"""graphopt::decode_attention against the attention it replaces, written out as the
reference decoder writes it (gather by slot, repeat_kv, finfo.min mask from the
positions, matmul, float32 softmax, matmul): the C++ CPU kernel and the torch
reference (SDPA, what CUDA runs), float32 and bfloat16, GQA and not, slot-indexed
and batch-indexed caches, lengths from 1 to past the cache."""

import pytest
import torch
import torch.nn.functional as F

from graphopt.config import tolerance
from graphopt.kernels import decode_attention as kernel
from graphopt.models.decoder import repeat_kv

OP = torch.ops.graphopt.decode_attention.default
DTYPES = [torch.float32, torch.bfloat16]
B, H, S, D, SLOTS = 4, 8, 32, 16, 6  # SLOTS - 1 is the scratch slot padded rows point at


def cache(dtype, kv_heads, seed=0):
    """A slot cache [slots, s, kv_heads, d], as the reference decoder keeps it."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SLOTS, S, kv_heads, D, generator=gen).to(dtype)


def query(dtype, t=1, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, t, H, D, generator=gen).to(dtype).transpose(1, 2)  # as the projection gives it


def eager(q, keys, values, positions, scale):
    """The written-out attention over keys/values [b, kv_heads, s, d]."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
    allowed = torch.arange(keys.shape[2]) <= positions.expand(q.shape[0], q.shape[2])[:, :, None]
    mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)[:, None]
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale + mask
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)


@pytest.fixture(params=["native", "reference"])
def implementation(request):
    if request.param == "native":
        assert kernel.native_unavailable() is None, kernel.native_unavailable()
        return OP
    return kernel._reference


def check(actual, expected):
    atol, rtol = tolerance(expected.dtype)
    assert actual.dtype == expected.dtype and actual.is_contiguous()
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [2, H], ids=["gqa", "mha"])
def test_slot_cache(implementation, dtype, kv_heads):
    """Rows read in place through their slots: length 1, a middle length, the full
    cache, a length past it, and a padded row on the scratch slot."""
    k_cache, v_cache = cache(dtype, kv_heads), cache(dtype, kv_heads, seed=2)
    slots = torch.tensor([3, 0, 2, SLOTS - 1])
    positions = torch.tensor([[0], [13], [S - 1], [S + 40]])
    q = query(dtype)
    expected = eager(q, k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2), positions, D**-0.5)
    check(implementation(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), slots, positions, D**-0.5), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_indexed_cache_with_shared_positions(implementation, dtype):
    """transformers' StaticCache: [b, kv_heads, s, d] tensors, row i for sequence i,
    one cache_position for the whole batch, two query tokens."""
    keys = cache(dtype, 2)[:B].transpose(1, 2).contiguous()
    values = cache(dtype, 2, seed=2)[:B].transpose(1, 2).contiguous()
    q, positions = query(dtype, t=2), torch.tensor([[9, 10]])
    check(implementation(q, keys, values, None, positions, 0.3), eager(q, keys, values, positions, 0.3))


def test_other_dtypes_and_negative_slots():
    for dtype in (torch.float16, torch.float64):
        k_cache, v_cache = cache(dtype, 2), cache(dtype, 2, seed=2)
        slots, positions = torch.tensor([-1, 0, 1, -2]), torch.tensor([[4], [5], [6], [7]])
        q = query(dtype)
        expected = eager(q, k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2), positions, 0.25)
        check(OP(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), slots, positions, 0.25), expected)


def test_a_row_without_keys_gives_zeros(implementation):
    k_cache, v_cache = cache(torch.float32, 2), cache(torch.float32, 2, seed=2)
    out = implementation(query(torch.float32), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                         torch.arange(B), torch.tensor([[-1], [0], [-5], [3]]), 0.25)
    assert out[[0, 2]].eq(0).all() and out[[1, 3]].ne(0).any()


def test_a_slot_out_of_range_raises():
    k_cache = cache(torch.float32, 2).transpose(1, 2)
    with pytest.raises(RuntimeError, match="out of range"):
        OP(query(torch.float32), k_cache, k_cache, torch.tensor([0, 1, 2, SLOTS]), torch.zeros(B, 1, dtype=torch.long),
           0.25)


def test_schema_and_fake():
    k_cache = cache(torch.float32, 2).transpose(1, 2)
    args = (query(torch.float32), k_cache, k_cache, torch.arange(B), torch.full((B, 1), 5), 0.25)
    torch.library.opcheck(OP, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda(dtype):
    k_cache, v_cache = cache(dtype, 2).cuda(), cache(dtype, 2, seed=2).cuda()
    slots, positions = torch.tensor([3, 0, 2, SLOTS - 1]).cuda(), torch.tensor([[0], [13], [S - 1], [S + 40]]).cuda()
    q = query(dtype).cuda()
    expected = eager(q.cpu(), k_cache[slots].transpose(1, 2).cpu(), v_cache[slots].transpose(1, 2).cpu(),
                     positions.cpu(), D**-0.5)
    check(OP(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), slots, positions, D**-0.5).cpu(), expected)
