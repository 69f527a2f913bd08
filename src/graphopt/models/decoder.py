"""The reference model: a Llama-style decoder with a preallocated slot KV cache.

It is written with plain torch ops the way model code in the wild writes them
(transformers' Llama), so graphopt's passes meet the patterns they are built for:
RMSNorm in float32, rotate_half rotary embeddings, repeat_kv, matmul attention with
an additive mask, SwiGLU. It imports nothing from graphopt.

The KV cache is a pair of buffers per layer, ``[max_num_seqs + 1, max_seq_len,
num_kv_heads, head_dim]``, updated in place by each step: a compiler sees a mutated
input whose address must stay fixed, which is the case the runtime exists for. Row
``max_num_seqs`` is the scratch slot that padded rows write to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_seq_len: int
    max_num_seqs: int  # sequence slots in the KV cache, not counting the scratch slot
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_seq_len", "max_num_seqs", "rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"DecoderConfig.{name} must be positive, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"DecoderConfig.hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"DecoderConfig.num_heads ({self.num_heads}) must be divisible by "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.hidden_size // num_heads ({self.head_dim}) must be even: "
                             "rotary embeddings rotate pairs of channels")
        if not self.dtype.is_floating_point:
            raise ValueError(f"DecoderConfig.dtype must be a floating-point dtype, got {self.dtype}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def tiny(cls, **overrides) -> DecoderConfig:
        """About 0.1M parameters: fast enough for tests on a small CPU."""
        fields = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2,
                      num_heads=4, num_kv_heads=2, max_seq_len=128, max_num_seqs=16)
        return cls(**{**fields, **overrides})

    @classmethod
    def small(cls, **overrides) -> DecoderConfig:
        """About 3.4M parameters (29 linears, 13.6 MB in float32): the CPU benchmarks'
        decoder, big enough that its GEMMs, not Python, set the floor."""
        fields = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_layers=4,
                      num_heads=8, num_kv_heads=4, max_seq_len=128, max_num_seqs=16)
        return cls(**{**fields, **overrides})

    @classmethod
    def bench(cls, **overrides) -> DecoderConfig:
        """About 107M parameters (untied lm_head) for GPU benchmarks."""
        fields = dict(vocab_size=32000, hidden_size=768, intermediate_size=1408, num_layers=12,
                      num_heads=12, num_kv_heads=4, max_seq_len=1024, max_num_seqs=64)
        return cls(**{**fields, **overrides})

    @classmethod
    def billion(cls, **overrides) -> DecoderConfig:
        """About 1.1B parameters (TinyLlama's shape: 22 layers, hidden 2048, 32/4
        heads): the GPU benchmarks' decoder, 2.2 GB of weights in bfloat16."""
        fields = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22,
                      num_heads=32, num_kv_heads=4, max_seq_len=512, max_num_seqs=256)
        return cls(**{**fields, **overrides})


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        var = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(var + self.eps)
        return self.weight * x32.to(input_dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        dim = config.head_dim
        # Kept in float32 whatever config.dtype is: low-precision frequencies drift at long positions.
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)  # broadcast over heads
    sin = sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, kv_heads, s, d] -> [b, kv_heads * n_rep, s, d]"""
    b, kv_heads, s, d = hidden.shape
    if n_rep == 1:
        return hidden
    hidden = hidden[:, :, None, :, :].expand(b, kv_heads, n_rep, s, d)
    return hidden.reshape(b, kv_heads * n_rep, s, d)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.num_kv_groups = config.num_heads // config.num_kv_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        hidden, kv_dim, dtype = config.hidden_size, config.num_kv_heads * config.head_dim, config.dtype
        self.q_proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        cache_shape = (config.max_num_seqs + 1, config.max_seq_len, config.num_kv_heads, config.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)

    def forward(self, hidden, cos, sin, mask, positions, slots):
        b, t, _ = hidden.shape
        q = self.q_proj(hidden).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)

        # In place, never reassigned: the cache must stay one buffer at one address.
        self.k_cache[slots[:, None], positions] = k.transpose(1, 2)
        self.v_cache[slots[:, None], positions] = v.transpose(1, 2)
        # Attend over the slot's whole row; the mask hides positions not yet written.
        keys = repeat_kv(self.k_cache[slots].transpose(1, 2), self.num_kv_groups)
        values = repeat_kv(self.v_cache[slots].transpose(1, 2), self.num_kv_groups)

        scores = torch.matmul(q, keys.transpose(2, 3)) * self.scaling + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, values).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        hidden, inter, dtype = config.hidden_size, config.intermediate_size, config.dtype
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.mlp = MLP(config)

    def forward(self, hidden, cos, sin, mask, positions, slots):
        residual = hidden
        hidden = self.self_attn(self.input_layernorm(hidden), cos, sin, mask, positions, slots)
        hidden = residual + hidden
        residual = hidden
        hidden = self.mlp(self.post_attention_layernorm(hidden))
        return residual + hidden


class Decoder(nn.Module):
    """A Llama-style decoder whose ``forward`` is one decode step over a slot KV cache.

    ``forward(input_ids [b], positions [b], slots [b]) -> logits [b, vocab_size]``: token
    ``input_ids[i]`` sits at ``positions[i]`` of the sequence in cache row ``slots[i]``.
    Padded rows point at ``scratch_slot`` so they never touch a real sequence.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.scratch_slot = config.max_num_seqs
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=config.dtype)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        # Logits of unit scale keep the top two tokens of random weights apart, so greedy
        # tokens can be compared across optimisation levels without near-ties.
        nn.init.normal_(self.lm_head.weight, std=self.config.hidden_size**-0.5)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The decode step: one token per sequence."""
        return self.prefill(input_ids[:, None], positions[:, None], slots)[:, 0]

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``input_ids, positions [b, t]``, ``slots [b]`` -> logits ``[b, t, vocab_size]``.

        Writes all t positions into each slot's cache row and attends causally within it.
        """
        dtype = self.config.dtype
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, dtype)
        key_positions = torch.arange(self.config.max_seq_len, device=positions.device)
        allowed = key_positions <= positions[:, :, None]  # [b, t, max_seq_len]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]  # broadcast over heads
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, mask, positions, slots)
        return self.lm_head(self.norm(hidden))

    @torch.no_grad()
    def reset_cache(self, slots: torch.Tensor | None = None) -> None:
        """Zero the cache rows of ``slots`` (every row when None), in place."""
        for layer in self.layers:
            for cache in (layer.self_attn.k_cache, layer.self_attn.v_cache):
                if slots is None:
                    cache.zero_()
                else:
                    cache[slots] = 0
