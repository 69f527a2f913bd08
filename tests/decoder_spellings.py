"""One Llama-style decoder written four ways, for the canonicalization tests and
benchmarks/spellings.py: the same math (RMSNorm, rotary embeddings, GQA
attention over a KV cache, SwiGLU) in the spellings model code in the wild uses.

| spelling | GQA | attention | mask | cache | RMSNorm | SwiGLU | rotary |
| --- | --- | --- | --- | --- | --- | --- | --- |
| `Interleaved` | `repeat_interleave` | `softmax(q @ kᵀ · s)` | `masked_fill(-inf)` | by slot `[slots, len, kv, d]` | `rsqrt(mean(x²) + eps)` | `silu(g) * u` | `x * cos + rotate_half(x) * sin` (slices), x `[b, h, t, d]` strided |
| `Sdpa` | SDPA `enable_gqa` | SDPA | boolean | by batch `[b, kv, len, d]` | `rsqrt(mean(x²) + eps)` | `u * silu(g)` | `sin * cat(-x2, x1) + cos * x`, halves by `chunk`, x `[b, t, h, d]` |
| `Baddbmm` | `repeat` | `baddbmm`, 3-D | additive `finfo.min` | by batch `[b, len, kv, d]` | `x / sqrt(mean(x²) + eps)` | `silu(g) * u` | GPT-J's interleaved pairs, `stack(-x[..., 1::2], x[..., ::2]).flatten(-2)` |
| `Grouped` | `[b, kv, group, t, d]` broadcast | `matmul`, 5-D | `where(allowed, s, -inf)` | by slot `[slots, kv, len, d]` | `rsqrt(‖x‖² / n + eps)` | `silu(g) * u` | Meta's complex product, `view_as_complex(x) * freqs_cis[positions]` |

`Baddbmm`'s `repeat` tiles the kv heads: query head h reads kv head h % kv_heads,
where the others read h // group. It is the same model with its query heads in
another order, and a canonicalization must keep that mapping. Likewise GPT-J's and
Meta's rotary pair neighbouring channels where the others pair the halves: the same
weights give other logits, each spelling's own eager's.

Each `forward(input_ids [b, t], positions [b, t], slots [b])` writes the t tokens
into the cache and returns logits [b, t, vocab]; t == 1 is a decode step. The
batch-cache spellings read rows `[:b]` of a cache made for `max_batch` sequences
(`slots` unused), the slot spellings rows `slots`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, MAX_LEN = 256, 64, 160, 4, 2, 2, 64
HEAD_DIM, GROUP, EPS = HIDDEN // HEADS, HEADS // KV_HEADS, 1e-6


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Spelling(nn.Module):
    """Weights and the decoder's skeleton; subclasses spell the norm, the attention
    and the gate."""

    def __init__(self, max_batch: int = 16, seed: int = 0, hidden: int = HIDDEN, layers: int = LAYERS):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.hidden, self.head_dim = hidden, hidden // HEADS
        self.inter = INTER * hidden // HIDDEN

        def weight(*shape, std=0.05):
            return nn.Parameter(torch.randn(*shape, generator=generator) * std)

        self.embed = weight(VOCAB, hidden, std=1.0)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            kv = KV_HEADS * self.head_dim
            layer.wq, layer.wk, layer.wv, layer.wo = weight(hidden, hidden), weight(kv, hidden), \
                weight(kv, hidden), weight(hidden, hidden)
            layer.gate, layer.up, layer.down = weight(self.inter, hidden), weight(self.inter, hidden), \
                weight(hidden, self.inter)
            layer.norm1, layer.norm2 = weight(hidden, std=0.1), weight(hidden, std=0.1)
            with torch.no_grad():
                layer.norm1.add_(1.0)
                layer.norm2.add_(1.0)
            layer.register_buffer("k_cache", torch.zeros(self.cache_shape(max_batch)), persistent=False)
            layer.register_buffer("v_cache", torch.zeros(self.cache_shape(max_batch)), persistent=False)
            self.layers.append(layer)
        self.final_norm = weight(hidden, std=0.0)
        with torch.no_grad():
            self.final_norm.add_(1.0)
        self.lm_head = weight(VOCAB, hidden, std=hidden**-0.5)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cache_shape(self, max_batch: int) -> tuple:
        raise NotImplementedError

    def forward(self, input_ids, positions, slots):
        b, t = input_ids.shape
        hidden = F.embedding(input_ids, self.embed)
        angles = self.angles(positions)
        allowed = torch.arange(MAX_LEN, device=positions.device) <= positions[:, :, None]  # [b, t, len]
        for layer in self.layers:
            x = self.norm(hidden, layer.norm1)
            q = F.linear(x, layer.wq).view(b, t, HEADS, self.head_dim)
            k = F.linear(x, layer.wk).view(b, t, KV_HEADS, self.head_dim)
            v = F.linear(x, layer.wv).view(b, t, KV_HEADS, self.head_dim).transpose(1, 2)
            q, k = self.rotary(q, k, angles)
            out = self.attend(layer, q, k, v, allowed, positions, slots)  # [b, t, hidden]
            hidden = hidden + F.linear(out, layer.wo)
            x = self.norm(hidden, layer.norm2)
            hidden = hidden + F.linear(self.swiglu(F.linear(x, layer.gate), F.linear(x, layer.up)), layer.down)
        return F.linear(self.norm(hidden, self.final_norm), self.lm_head)

    def angles(self, positions):
        """[b, t, d / 2]: each position's angle for each pair of channels."""
        return positions[..., None].float() * self.inv_freq

    def rotary(self, q, k, angles):
        """q, k [b, t, heads, d] -> rotated, [b, heads, t, d]: transformers' rotate_half
        on the transposed (strided) values, cos/sin [b, 1, t, d]."""
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def norm(self, x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))

    def swiglu(self, gate, up):
        return F.silu(gate) * up

    def attend(self, layer, q, k, v, allowed, positions, slots):
        raise NotImplementedError


class Interleaved(Spelling):
    """repeat_interleave GQA, explicit softmax under masked_fill(-inf), slot cache [slots, len, kv, d]."""

    def cache_shape(self, max_batch):
        return (max_batch + 1, MAX_LEN, KV_HEADS, self.head_dim)

    def attend(self, layer, q, k, v, allowed, positions, slots):
        b, _, t, _ = q.shape
        layer.k_cache[slots[:, None], positions] = k.transpose(1, 2)
        layer.v_cache[slots[:, None], positions] = v.transpose(1, 2)
        keys = layer.k_cache[slots].transpose(1, 2).repeat_interleave(GROUP, dim=1)
        values = layer.v_cache[slots].transpose(1, 2).repeat_interleave(GROUP, dim=1)
        scores = q @ keys.transpose(-2, -1) / self.head_dim**0.5
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ values
        return out.transpose(1, 2).reshape(b, t, -1)


class Sdpa(Spelling):
    """SDPA with enable_gqa and a boolean mask, batch cache [b, kv, len, d]."""

    def cache_shape(self, max_batch):
        return (max_batch, KV_HEADS, MAX_LEN, self.head_dim)

    def swiglu(self, gate, up):
        return up * F.silu(gate)

    def rotary(self, q, k, angles):
        """rotate_half by `chunk`, every operand order flipped, before the heads move:
        cos/sin [b, t, 1, d]."""
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().unsqueeze(2), emb.sin().unsqueeze(2)

        def turn(x):
            x1, x2 = x.chunk(2, dim=-1)
            return sin * torch.cat((-x2, x1), dim=-1) + cos * x

        return turn(q).transpose(1, 2), turn(k).transpose(1, 2)

    def attend(self, layer, q, k, v, allowed, positions, slots):
        b, _, t, _ = q.shape
        rows = torch.arange(b, device=q.device)[:, None]
        layer.k_cache[rows, :, positions] = k.transpose(1, 2)
        layer.v_cache[rows, :, positions] = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, layer.k_cache[:b], layer.v_cache[:b], attn_mask=allowed[:, None],
                                             enable_gqa=True)
        return out.transpose(1, 2).reshape(b, t, -1)


class Baddbmm(Spelling):
    """3-D baddbmm attention over `repeat`-tiled kv heads with an additive finfo.min
    mask, batch cache [b, len, kv, d], RMSNorm as x / sqrt(mean(x²) + eps)."""

    def cache_shape(self, max_batch):
        return (max_batch, MAX_LEN, KV_HEADS, self.head_dim)

    def norm(self, x, weight):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight

    def rotary(self, q, k, angles):
        """GPT-J's `rotate_every_two`: neighbouring channels paired, each angle repeated
        over its pair."""
        emb = angles.repeat_interleave(2, dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]

        def turn(x):
            return x * cos + torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2) * sin

        return turn(q.transpose(1, 2)), turn(k.transpose(1, 2))

    def attend(self, layer, q, k, v, allowed, positions, slots):
        b, _, t, d = q.shape
        rows = torch.arange(b, device=q.device)[:, None]
        layer.k_cache[rows, positions] = k.transpose(1, 2)
        layer.v_cache[rows, positions] = v.transpose(1, 2)
        keys = layer.k_cache[:b].transpose(1, 2).repeat(1, GROUP, 1, 1).reshape(b * HEADS, MAX_LEN, d)
        values = layer.v_cache[:b].transpose(1, 2).repeat(1, GROUP, 1, 1).reshape(b * HEADS, MAX_LEN, d)
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~allowed, torch.finfo(q.dtype).min)[:, None].expand(b, HEADS, t, MAX_LEN)
        scores = torch.baddbmm(bias.reshape(b * HEADS, t, MAX_LEN), q.reshape(b * HEADS, t, d),
                               keys.transpose(1, 2), alpha=d**-0.5)
        out = torch.bmm(torch.softmax(scores, dim=-1), values).view(b, HEADS, t, d)
        return out.transpose(1, 2).reshape(b, t, -1)


class Grouped(Spelling):
    """GQA by broadcasting: queries as [b, kv, group, t, d] against [b, kv, 1, len, d]
    in a 5-D matmul, `where(allowed, scores, -inf)`, slot cache [slots, kv, len, d],
    RMSNorm from `torch.linalg.vector_norm`."""

    def cache_shape(self, max_batch):
        return (max_batch + 1, KV_HEADS, MAX_LEN, self.head_dim)

    def norm(self, x, weight):
        squares = torch.linalg.vector_norm(x, dim=-1, keepdim=True).pow(2) / x.shape[-1]
        return weight * (x * torch.rsqrt(squares + EPS))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # e^(i·angle) per position and pair, made once, as Meta's Llama precomputes `freqs_cis`.
        table = torch.arange(MAX_LEN, dtype=torch.float32)[:, None] * self.inv_freq
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(table), table), persistent=False)

    def angles(self, positions):
        """[b, t, 1, d / 2]: the rows of the complex table."""
        return self.freqs_cis[positions][:, :, None]

    def rotary(self, q, k, angles):
        """Meta's Llama: pairs of channels as complex numbers, turned by a complex product."""
        def turn(x):
            paired = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(paired * angles).flatten(3).type_as(x).transpose(1, 2)

        return turn(q), turn(k)

    def attend(self, layer, q, k, v, allowed, positions, slots):
        b, _, t, d = q.shape
        layer.k_cache[slots[:, None], :, positions] = k.transpose(1, 2)
        layer.v_cache[slots[:, None], :, positions] = v.transpose(1, 2)
        keys, values = layer.k_cache[slots][:, :, None], layer.v_cache[slots][:, :, None]  # [b, kv, 1, len, d]
        grouped = q.reshape(b, KV_HEADS, GROUP, t, d)
        scores = torch.matmul(grouped, keys.transpose(-2, -1)) * d**-0.5
        scores = torch.where(allowed[:, None, None], scores, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), values).reshape(b, HEADS, t, d)
        return out.transpose(1, 2).reshape(b, t, -1)


SPELLINGS = {"interleaved": Interleaved, "sdpa": Sdpa, "baddbmm": Baddbmm, "grouped": Grouped}


def decode_inputs(batch: int, position: int, seed: int = 0):
    """A decode step's (input_ids [b, 1], positions [b, 1], slots [b]): positions
    differ per row, around `position`."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, 1), generator=generator)
    positions = (position + torch.arange(batch) % 3).clamp(max=MAX_LEN - 1)[:, None]
    return ids, positions, torch.arange(batch)


def prefill_inputs(batch: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=generator)
    return ids, torch.arange(length).expand(batch, length).contiguous(), torch.arange(batch)
