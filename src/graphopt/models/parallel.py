"""The reference decoder, tensor-parallel over the ranks of a process group.

Each rank holds a shard of every weight, Megatron-style (the layout vLLM, SGLang
and FastDeploy serve with):

- `embed_tokens` is vocab-parallel: a rank holds a contiguous block of rows,
  looks up the ids that fall in it (zeros for the others) and the ranks sum;
- q/k/v and gate/up projections are column-parallel: a rank computes its heads
  (its KV heads, into its own shard of the KV cache) and its slice of the MLP;
- o_proj and down_proj are row-parallel: a rank multiplies its slice of the
  features, and an all-reduce sums the partial results;
- `lm_head` is column-parallel over the vocabulary, gathered at the end, so every
  rank returns the full logits.

The communication is torch's: `torch.distributed._functional_collectives`, which
Dynamo traces into the graph (`_c10d_functional.all_reduce` + `wait_tensor`), so
one graph holds the whole step, collectives included. The process group is the
caller's (gloo on the CPU, NCCL on CUDA). `ParallelDecoder.from_decoder` shards a
single-device `Decoder`, so the two compute the same function; the modules differ from the single-device ones only in
how they are built and in the three parallel layers below, so `forward` is the same code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._compat.names import functional_collectives
from .decoder import MLP, Attention, Decoder, DecoderConfig, DecoderLayer, RMSNorm, RotaryEmbedding

funcol = functional_collectives()


class RowParallelLinear(nn.Linear):
    """A linear over this rank's slice of the input features; the ranks' partial
    results are summed by an all-reduce (o_proj, down_proj)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, group: dist.ProcessGroup):
        super().__init__(in_features, out_features, bias=False, dtype=dtype)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(F.linear(x, self.weight), "sum", self.group)


class GatheredLinear(nn.Linear):
    """A linear computing this rank's block of the output features, gathered from
    every rank along the last dim (lm_head: every rank gets the full logits)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, group: dist.ProcessGroup):
        super().__init__(in_features, out_features, bias=False, dtype=dtype)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_gather_single(F.linear(x, self.weight), gather_dim=x.dim() - 1, group=self.group)


class VocabParallelEmbedding(nn.Module):
    """This rank's block of the vocabulary: its rows for the ids in the block,
    zeros for the others; an all-reduce sums the ranks' lookups."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, rank: int, world: int,
                 group: dist.ProcessGroup):
        super().__init__()
        self.first, self.rows, self.group = rank * (vocab_size // world), vocab_size // world, group
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        mine = (local >= 0) & (local < self.rows)
        found = F.embedding(torch.where(mine, local, 0), self.weight) * mine[..., None].to(self.weight.dtype)
        return funcol.all_reduce(found, "sum", self.group)


class ParallelAttention(Attention):
    """`Attention` over this rank's heads and KV heads (its own shard of the KV
    cache), with a row-parallel o_proj. `forward` is Attention's: it reads the
    number of heads from the projections' sizes."""

    def __init__(self, config: DecoderConfig, world: int, group: dist.ProcessGroup) -> None:
        nn.Module.__init__(self)  # not Attention.__init__: that would build full-size weights
        heads, kv_heads, dtype = config.num_heads // world, config.num_kv_heads // world, config.dtype
        self.num_kv_groups = heads // kv_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        hidden, q_dim, kv_dim = config.hidden_size, heads * config.head_dim, kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_dim, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=False, dtype=dtype)
        self.o_proj = RowParallelLinear(q_dim, hidden, dtype, group)
        cache_shape = (config.max_num_seqs + 1, config.max_seq_len, kv_heads, config.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)


class ParallelMLP(MLP):
    """`MLP` over this rank's slice of the intermediate features."""

    def __init__(self, config: DecoderConfig, world: int, group: dist.ProcessGroup) -> None:
        nn.Module.__init__(self)
        hidden, inter, dtype = config.hidden_size, config.intermediate_size // world, config.dtype
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, hidden, dtype, group)


class ParallelDecoderLayer(DecoderLayer):
    def __init__(self, config: DecoderConfig, world: int, group: dist.ProcessGroup) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.self_attn = ParallelAttention(config, world, group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.mlp = ParallelMLP(config, world, group)


class ParallelDecoder(Decoder):
    """`Decoder` sharded over `group` (default: the world): the same `forward`,
    `prefill` and KV-cache interface, the same results to float rounding. Every rank
    runs every step, with the same inputs."""

    def __init__(self, config: DecoderConfig, group: dist.ProcessGroup | None = None) -> None:
        nn.Module.__init__(self)  # not Decoder.__init__: that would build full-size weights
        group = group if group is not None else dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            if getattr(config, name) % world:
                raise ValueError(f"ParallelDecoder: DecoderConfig.{name} ({getattr(config, name)}) must be "
                                 f"divisible by the {world} ranks of the process group")
        self.config, self.rank, self.world = config, rank, world
        self.scratch_slot = config.max_num_seqs
        dtype = config.dtype
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, rank, world, group)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(ParallelDecoderLayer(config, world, group) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = GatheredLinear(config.hidden_size, config.vocab_size // world, dtype, group)

    @classmethod
    @torch.no_grad()
    def from_decoder(cls, decoder: Decoder, group: dist.ProcessGroup | None = None) -> ParallelDecoder:
        """This rank's shard of `decoder` (every rank passes the same weights)."""
        model = cls(decoder.config, group)
        shards = {}
        for name, weight in decoder.state_dict().items():
            if name.endswith(_COLUMN_PARALLEL):  # output features (rows of the weight) split
                shards[name] = weight.chunk(model.world, dim=0)[model.rank].clone()
            elif name.endswith(_ROW_PARALLEL):  # input features (columns) split
                shards[name] = weight.chunk(model.world, dim=1)[model.rank].contiguous()
            else:
                shards[name] = weight.clone()
        model.load_state_dict(shards)
        return model.eval()


_COLUMN_PARALLEL = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
                    "lm_head.weight", "embed_tokens.weight")
_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
