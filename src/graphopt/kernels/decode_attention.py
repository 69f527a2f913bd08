"""Decode attention that reads a KV cache in place, only up to each sequence's length.

    decode_attention(query [b, h, t, d], key [n, kv_heads, s, d], value [n, kv_heads, s, d],
                     slots [b] | None, positions (broadcasts to [b, t]) | None, scale,
                     allowed (bool, broadcasts to [b, t, s]) | None = None) -> [b, h, t, d]

Query (i, j) attends, with `scale` and a max-subtracted softmax, over keys and values
0 .. positions[i, j] of cache row slots[i] (row i when `slots` is None), and of those
only the ones `allowed[i, j]` lets through: the reference decoder's slot cache read as
`k_cache.transpose(1, 2)` with its slots, transformers' `StaticCache` tensors as they
are, with the mask `generate()` passes in as `allowed`. Without positions every key
of the row is a candidate. A position past the cache attends over all of it, as the
mask `key position <= query position` does. A query left with no key (a negative
position, or a row `allowed` masks out entirely) averages every key of its row with
equal weights: what eager attention gives under a `finfo.min` mask, the one
transformers and the reference decoder build (under -inf eager gives NaN).
Query head `x` reads kv head `x // (h // kv_heads)` (GQA, as `repeat_kv`), never
repeated. `key` and `value` may have any strides. Lengths are read from `positions`
when the op runs, so one captured device graph serves every length.

The kernel is C++ on the CPU (`decode_attention.cpp`, built on first use for the
machine's vector ISA), Triton on CUDA (`decode_attention_triton.py`). Where neither
can run, `_reference` gathers whole cache rows for torch's SDPA under a mask.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from . import native

log = logging.getLogger("graphopt")

SOURCE = Path(__file__).with_suffix(".cpp")
SCHEMA = ("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? slots, Tensor? positions, float scale, "
          "Tensor? allowed=None) -> Tensor")
_LIB = torch.library.Library("graphopt", "FRAGMENT")
_LIB.define(SCHEMA)


def native_unavailable() -> str | None:
    """Why CPU calls run `_reference` (None: the C++ kernel is registered). Builds
    the kernel on the first call; a failure is logged once."""
    return native.cpu_kernel_unavailable("graphopt_decode_attention", SOURCE,
                                         "decode_attention runs torch's SDPA on the CPU")


def fake_result(query: torch.Tensor) -> torch.Tensor:
    """The op's result for this query: [b, h, t, d], contiguous."""
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.register_fake("graphopt::decode_attention", lib=_LIB)
def _fake(query, key, value, slots, positions, scale, allowed=None):
    return fake_result(query)


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: Optional[torch.Tensor],
               positions: Optional[torch.Tensor], scale: float,
               allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
    if slots is not None:
        key, value = key[slots], value[slots]
    b, t, s = query.shape[0], query.shape[2], key.shape[2]
    keep = torch.ones(b, t, s, dtype=torch.bool, device=query.device)
    if positions is not None:
        keep = keep & (torch.arange(s, device=query.device) <= positions.expand(b, t)[..., None])
    if allowed is not None:
        keep = keep & allowed
    # A query left with no key averages its whole row (what eager softmax gives under a
    # finfo.min mask, and what the kernels do); SDPA's CUDA kernels give zeros there
    # instead, so such a query attends to every key and its output is replaced below.
    none = ~keep.any(-1, keepdim=True)
    mask = torch.zeros(keep.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~(keep | none), torch.finfo(query.dtype).min)
    gqa = key.shape[1] != query.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None], scale=scale, enable_gqa=gqa)
    average = value.float().mean(2, keepdim=True).to(value.dtype)  # [b, kv, 1, d]
    if gqa:
        average = average.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    return torch.where(none[:, None], average, out).contiguous()


def _decode_attention(query, key, value, slots, positions, scale, allowed=None):
    # Reached on the CPU only while the C++ kernel is not registered: a graph loaded
    # from the compile cache runs this before anything built it.
    if query.device.type == "cpu" and native_unavailable() is None:
        return torch.ops.graphopt.decode_attention.default(query, key, value, slots, positions, scale, allowed)
    return _reference(query, key, value, slots, positions, scale, allowed)


_LIB.impl("decode_attention", _decode_attention, "CompositeExplicitAutograd")


@functools.cache
def triton_unavailable() -> str | None:
    """Why CUDA calls run `_reference` (None: the Triton kernel runs them)."""
    try:
        from . import decode_attention_triton  # noqa: F401
    except ImportError as error:
        log.warning("graphopt: decode_attention runs torch's SDPA on CUDA, Triton is unavailable: %s", error)
        return f"Triton is unavailable ({error})"
    return None


def _decode_attention_cuda(query, key, value, slots, positions, scale, allowed=None):
    if triton_unavailable() is not None:
        return _reference(query, key, value, slots, positions, scale, allowed)
    from .decode_attention_triton import decode_attention

    return decode_attention(query, key, value, slots, positions, scale, allowed)


_LIB.impl("decode_attention", _decode_attention_cuda, "CUDA")
