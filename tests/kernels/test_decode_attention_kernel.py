"""graphopt::decode_attention against the attention it replaces, written out as the
reference decoder writes it (gather by slot, repeat_kv, finfo.min mask from the
positions, matmul, float32 softmax, matmul): the C++ CPU kernel and the torch
reference (SDPA, what CUDA runs), float32 and bfloat16, GQA and not, slot-indexed
and batch-indexed caches, lengths from 1 to past the cache, masks passed in as
`allowed` (transformers' generate() padding and causal mask)."""

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


def eager(q, keys, values, positions, scale, allowed=None):
    """The written-out attention over keys/values [b, kv_heads, s, d], masked to
    `key <= position` (with positions) and to `allowed` [b, t, s] (when given)."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
    if positions is not None:
        allowed_by_position = torch.arange(keys.shape[2]) <= positions.expand(q.shape[0], q.shape[2])[:, :, None]
        allowed = allowed_by_position if allowed is None else allowed & allowed_by_position
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_without_keys_averages_its_row_as_eager_does(implementation, dtype):
    """A negative position: every score is finfo.min in eager, a uniform average."""
    k_cache, v_cache = cache(dtype, 2), cache(dtype, 2, seed=2)
    q, positions = query(dtype), torch.tensor([[-1], [0], [-5], [3]])
    slots = torch.arange(B)
    expected = eager(q, k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2), positions, 0.25)
    check(implementation(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), slots, positions, 0.25), expected)
    check(expected[0, 0, 0], v_cache[0, :, 0].float().mean(0).to(dtype))  # query head 0 reads kv head 0


def padding_and_causal(positions, lengths, capacity=S):
    """generate()'s mask for a left-padded batch: key s is allowed where it is not
    padding (s >= pad of the row) and not after the query's position; [b, 1, s]."""
    keys = torch.arange(capacity)
    pads = torch.tensor(lengths)[:, None]
    return ((keys >= pads) & (keys <= torch.tensor(positions)[:, None]))[:, None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_positions", [False, True], ids=["mask-only", "mask-and-positions"])
def test_allowed_mask(implementation, dtype, with_positions):
    """A boolean mask passed in (transformers' generate() builds it outside the model):
    only the keys it allows are read, with or without positions beside it."""
    keys = cache(dtype, 2)[:B].transpose(1, 2).contiguous()
    values = cache(dtype, 2, seed=2)[:B].transpose(1, 2).contiguous()
    position = [9, 9, 9, 9]
    allowed = padding_and_causal(position, [0, 3, 9, 1])
    allowed[3, 0, 5] = False  # a hole in the middle
    positions = torch.tensor([[9]]) if with_positions else None
    q = query(dtype)
    expected = eager(q, keys, values, torch.tensor([[9]]), 0.3, allowed)
    check(implementation(q, keys, values, None, positions, 0.3, allowed), expected)


def test_allowed_mask_broadcast_and_strided(implementation):
    """A mask shared by the rows ([1, t, s]) and one read through strides (a view of
    generate()'s [b, 1, t, s] mask); slot-indexed keys."""
    k_cache, v_cache = cache(torch.float32, 2), cache(torch.float32, 2, seed=2)
    slots, q = torch.tensor([3, 0, 2, 1]), query(torch.float32)
    keys, values = k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2)
    shared = padding_and_causal([20], [2])
    check(implementation(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), slots, None, 0.25, shared),
          eager(q, keys, values, None, 0.25, shared.expand(B, 1, S)))
    every_other = padding_and_causal([8, 60, 24, 62], [0, 10, 2, 0], capacity=2 * S)[..., ::2]
    strided = every_other[:, None].expand(B, 3, 1, S).select(1, 0)  # a view of a [b, 3, t, s] mask
    assert not strided.is_contiguous()
    check(implementation(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), slots, None, 0.25, strided),
          eager(q, keys, values, None, 0.25, strided))


def test_a_row_the_mask_empties_averages_its_row_as_eager_does(implementation):
    keys = cache(torch.float32, 2)[:B].transpose(1, 2).contiguous()
    values = cache(torch.float32, 2, seed=2)[:B].transpose(1, 2).contiguous()
    allowed = torch.ones(B, 1, S, dtype=torch.bool)
    allowed[1] = False
    allowed[2, 0, 7:] = False  # position 6 leaves keys 0..6; the mask 0..6: not empty
    q = query(torch.float32)
    check(implementation(q, keys, values, None, torch.tensor([[6]]), 0.25, allowed),
          eager(q, keys, values, torch.tensor([[6]]), 0.25, allowed))


def test_a_mask_of_another_dtype_raises():
    keys = cache(torch.float32, 2)[:B].transpose(1, 2).contiguous()
    with pytest.raises(RuntimeError, match="allowed must be a bool tensor"):
        OP(query(torch.float32), keys, keys, None, None, 0.25, torch.ones(B, 1, S))


def test_a_slot_out_of_range_raises():
    k_cache = cache(torch.float32, 2).transpose(1, 2)
    with pytest.raises(RuntimeError, match="out of range"):
        OP(query(torch.float32), k_cache, k_cache, torch.tensor([0, 1, 2, SLOTS]), torch.zeros(B, 1, dtype=torch.long),
           0.25)


def test_schema_and_fake():
    k_cache = cache(torch.float32, 2).transpose(1, 2)
    args = (query(torch.float32), k_cache, k_cache, torch.arange(B), torch.full((B, 1), 5), 0.25)
    torch.library.opcheck(OP, args, test_utils=("test_schema", "test_faketensor"))
    masked = (*args[:4], None, 0.25, torch.rand(B, 1, S) > 0.3)
    torch.library.opcheck(OP, masked, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda(dtype):
    k_cache, v_cache = cache(dtype, 2).cuda(), cache(dtype, 2, seed=2).cuda()
    slots, positions = torch.tensor([3, 0, 2, SLOTS - 1]).cuda(), torch.tensor([[0], [13], [S - 1], [S + 40]]).cuda()
    q = query(dtype).cuda()
    expected = eager(q.cpu(), k_cache[slots].transpose(1, 2).cpu(), v_cache[slots].transpose(1, 2).cpu(),
                     positions.cpu(), D**-0.5)
    check(OP(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), slots, positions, D**-0.5).cpu(), expected)
    allowed = padding_and_causal([0, 13, S - 1, S - 1], [0, 2, 5, 0]).cuda()
    check(OP(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), slots, None, D**-0.5, allowed).cpu(),
          eager(q.cpu(), k_cache[slots].transpose(1, 2).cpu(), v_cache[slots].transpose(1, 2).cpu(), None,
                D**-0.5, allowed.cpu()))
