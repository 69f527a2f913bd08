"""decode_attention on CUDA as one Triton kernel (the op's contract is in
decode_attention.py).

    query [b, h, t, d], cache rows [n, kv_heads, s, d] -> out [b, h, t, d]

One program per (sequence i and query position j, query head x): it reads cache row
`slots[i]` of kv head `x // (h // kv_heads)` in place, block by block, only up to
`positions[i, j]` and only the keys `allowed[i, j]` lets through, with a softmax kept
online in float32 (running max, running sum). Where `_reference` gathers whole cache
rows and repeats kv heads before torch's SDPA, this reads each key once. A query
left with no key averages every key of its row, as the CPU kernel and eager's
`finfo.min` mask do. Triton is imported only when this module is: on a CUDA call.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_S = 64  # keys per step of a program's loop


@triton.jit
def _kernel(q_ptr, k_ptr, v_ptr, out_ptr, slots_ptr, positions_ptr, allowed_ptr,
            sq_b, sq_h, sq_t, sq_d, sk_n, sk_h, sk_s, sk_d, sv_n, sv_h, sv_s, sv_d,
            so_b, so_h, so_t, so_d, sp_b, sp_t, sa_b, sa_t, sa_s,
            t_len, d_len, scale, S_LEN: tl.constexpr,
            GROUP: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_POSITIONS: tl.constexpr,
            HAS_ALLOWED: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    bt = tl.program_id(0)
    head = tl.program_id(1)
    b = bt // t_len
    t = bt % t_len
    kv = head // GROUP
    if HAS_SLOTS:
        row = tl.load(slots_ptr + b).to(tl.int64)
    else:
        row = b.to(tl.int64)
    limit = S_LEN
    if HAS_POSITIONS:
        limit = tl.minimum(tl.load(positions_ptr + b * sp_b + t * sp_t).to(tl.int32) + 1, S_LEN)
    d = tl.arange(0, BLOCK_D)
    d_in = d < d_len
    q = tl.load(q_ptr + b * sq_b + head * sq_h + t * sq_t + d * sq_d, mask=d_in, other=0.0).to(tl.float32)
    k_row = k_ptr + row * sk_n + kv * sk_h
    v_row = v_ptr + row * sv_n + kv * sv_h
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    # Bounded by the cache length, a compile-time constant (one per model), and each
    # block past the limit skipped: Triton's interpreter, which the CPU tests use, runs
    # no loop bounded by a value it loads.
    for start in range(0, S_LEN, BLOCK):
        if start < limit:
            s = start + tl.arange(0, BLOCK)
            keep = s < limit
            if HAS_ALLOWED:
                keep = keep & (tl.load(allowed_ptr + b * sa_b + t * sa_t + s * sa_s, mask=keep, other=0) != 0)
            both = keep[:, None] & d_in[None, :]
            k = tl.load(k_row + s[:, None] * sk_s + d[None, :] * sk_d, mask=both, other=0.0).to(tl.float32)
            scores = tl.where(keep, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=0))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a block with no key yet
            weights = tl.exp(scores - shift)
            rescale = tl.exp(running_max - shift)
            v = tl.load(v_row + s[:, None] * sv_s + d[None, :] * sv_d, mask=both, other=0.0).to(tl.float32)
            acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
            running_sum = running_sum * rescale + tl.sum(weights, axis=0)
            running_max = new_max
    if running_sum == 0.0:  # no key: every key of the row, equal weights
        for start in range(0, S_LEN, BLOCK):
            s = start + tl.arange(0, BLOCK)
            both = (s < S_LEN)[:, None] & d_in[None, :]
            acc += tl.sum(tl.load(v_row + s[:, None] * sv_s + d[None, :] * sv_d, mask=both, other=0.0)
                          .to(tl.float32), axis=0)
        running_sum = tl.zeros((), tl.float32) + S_LEN
    out = acc / running_sum
    tl.store(out_ptr + b * so_b + head * so_h + t * so_t + d * so_d, out.to(out_ptr.dtype.element_ty), mask=d_in)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: Optional[torch.Tensor],
                     positions: Optional[torch.Tensor], scale: float,
                     allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
    b, h, t, d = query.shape
    _, kv, s, _ = key.shape
    if h % kv:
        raise ValueError(f"decode_attention: {h} query heads are not a multiple of {kv} kv heads")
    out = torch.empty((b, h, t, d), dtype=query.dtype, device=query.device)
    pos = positions.expand(b, t) if positions is not None else None
    # Booleans as bytes, same strides: a broadcast mask is read in place.
    allow = allowed.expand(b, t, s).view(torch.uint8) if allowed is not None else None
    placeholder = query  # for the pointers a constexpr flag leaves unread
    _kernel[(b * t, h)](
        query, key, value, out, slots if slots is not None else placeholder,
        pos if pos is not None else placeholder, allow if allow is not None else placeholder,
        *query.stride(), *key.stride(), *value.stride(), *out.stride(),
        *(pos.stride() if pos is not None else (0, 0)), *(allow.stride() if allow is not None else (0, 0, 0)),
        t, d, scale, S_LEN=s,
        GROUP=h // kv, HAS_SLOTS=slots is not None, HAS_POSITIONS=pos is not None,
        HAS_ALLOWED=allow is not None, BLOCK=BLOCK_S, BLOCK_D=triton.next_power_of_2(d))
    return out
