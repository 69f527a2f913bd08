"""`fuse_decode_attention` on and off: the reference decoder's decode step at
`DecoderConfig.small()`, and its attention alone.

The step, at levels 1 (with host graphs) and 2, `freeze_parameters=True`, with the
fusion and without it (`disabled_passes`, so `fuse_attention` makes the attention
SDPA at level 1 and leaves it to Inductor at level 2), beside `torch.compile` and the
GEMM floor (the step's linears alone, `graphopt bench`'s). Interleaved rounds: in each,
every variant takes its turn; the table shows the median µs per step and the
without/with ratio (> 1: the fusion pays). Every output is checked against eager's.

The attention alone, one layer's, for batch 1 and 16 at a short and a long position:
the decoder's code as eager runs it (gather by slot, repeat_kv, mask, matmul, softmax,
matmul), SDPA over the gathered rows (what level 1 ran before), and the op.

    python benchmarks/decode_attention.py --threads 1
    python benchmarks/decode_attention.py --threads 1 --position 100 --rounds 20
"""

from __future__ import annotations

import argparse
import copy
import statistics
from typing import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import graphopt
from graphopt.bench.measure import compare, gemm_floor, interleaved_rounds, seconds_per_call
from graphopt.bench.workloads import Case
from graphopt.kernels.decode_attention import native_unavailable
from graphopt.models import Decoder, DecoderConfig
from graphopt.models.decoder import repeat_kv

FUSION = "fuse_decode_attention"


def _variants(model: Decoder) -> dict[str, Callable]:
    def optimized(level: int, fused: bool) -> Callable:
        config = graphopt.GraphOptimizationConfig(
            graph_opt_level=level, use_cudagraph=level == 1, cudagraph_capture_sizes=[1, 2, 4, 8, 16],
            freeze_parameters=True, disabled_passes=[] if fused else [FUSION], cache_dir=None)
        return graphopt.optimize(copy.deepcopy(model), config, pad_values={"slots": model.scratch_slot})

    return {"torch.compile": torch.compile(copy.deepcopy(model)),
            "L1 without": optimized(1, False), "L1 with": optimized(1, True),
            "L2 without": optimized(2, False), "L2 with": optimized(2, True)}


def _step_rows(model: Decoder, batch: int, position: int, rounds: int) -> tuple[list[list[str]], bool]:
    generator = torch.Generator().manual_seed(batch)
    inputs = (torch.randint(0, model.config.vocab_size, (batch,), generator=generator),
              torch.full((batch,), position), torch.arange(batch))
    steps = _variants(model)
    with torch.inference_mode():
        expected = copy.deepcopy(model)(*inputs)
        outputs = {name: [step(*[x.clone() for x in inputs]) for _ in range(3)][-1].clone()
                   for name, step in steps.items()}
    fused = {name: steps[name].report().passes for name in steps if name.endswith("with")}
    fired = all(any(p.name == FUSION and p.counts.get("decode_attention") for p in passes)
                for passes in fused.values())
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    floor, _, _ = gemm_floor(Case("", inputs, None, batch, "", gemm_weights=linears, gemm_batch=batch), "cpu")
    # Each its own copy of the inputs: graphopt marks their batch dim dynamic, which would
    # make torch.compile, handed the same tensors, compile again.
    runs = {"GEMM floor": floor, **{name: (lambda s=step, own=[x.clone() for x in inputs]: s(*own))
                                    for name, step in steps.items()}}
    times = {name: statistics.median(t) for name, t in
             interleaved_rounds(runs, rounds, "cpu", 0.05, lambda _: None).items()}
    equal = all(compare(out, expected)[0] for out in outputs.values())
    rows = []
    for level in (1, 2):
        without, with_ = times[f"L{level} without"], times[f"L{level} with"]
        rows.append([str(batch), str(level), f"{without:.0f}", f"{with_:.0f}", f"{without / with_:.2f}",
                     f"{times['torch.compile'] / with_:.2f}", f"{with_ / times['GEMM floor']:.2f}"])
    return rows, equal and fired


def _attention_rows(config: DecoderConfig, batch: int, position: int) -> list[str]:
    """One layer's attention: µs of the decoder's code, of SDPA on gathered rows, of the op."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    cache = [torch.randn(config.max_num_seqs + 1, config.max_seq_len, kv_heads, dim, generator=generator)
             for _ in range(2)]
    q = torch.randn(batch, heads, 1, dim, generator=generator)
    slots, positions = torch.arange(batch), torch.full((batch, 1), position)
    allowed = torch.arange(config.max_seq_len) <= positions[:, :, None]
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
    scale = dim**-0.5

    def written_out() -> torch.Tensor:
        keys, values = (repeat_kv(c[slots].transpose(1, 2), heads // kv_heads) for c in cache)
        scores = torch.matmul(q, keys.transpose(2, 3)) * scale + mask
        return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32), values)

    def sdpa() -> torch.Tensor:
        keys, values = (c[slots].transpose(1, 2) for c in cache)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)

    def fused() -> torch.Tensor:
        keys, values = (c.transpose(1, 2) for c in cache)
        return torch.ops.graphopt.decode_attention.default(q, keys, values, slots, positions, scale)

    with torch.inference_mode():
        assert all(compare(f(), written_out())[0] for f in (sdpa, fused))
        times = [statistics.median(seconds_per_call(f, runs=200) * 1e6 for _ in range(7))
                 for f in (written_out, sdpa, fused)]
    return [str(batch), str(position), *(f"{t:.1f}" for t in times), f"{times[1] / times[2]:.1f}x"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--position", type=int, default=7, help="every sequence's position in the step "
                        "(`graphopt bench`'s decode step: 7)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert native_unavailable() is None, native_unavailable()
    console = Console() if Console().is_terminal else Console(width=160)
    torch.manual_seed(0)
    config = DecoderConfig.small()
    model = Decoder(config).eval()

    step = Table(title=f"decode step, DecoderConfig.small(), position {args.position}: µs, median of "
                       f"{args.rounds} interleaved rounds")
    for column in ("batch", "level", "without", "with", "without / with", "with: x torch.compile",
                   "with: x GEMM floor"):
        step.add_column(column, justify="right")
    checked = True
    for batch in (1, 16):
        rows, ok = _step_rows(model, batch, args.position, args.rounds)
        checked &= ok
        for row in rows:
            step.add_row(*row)
    step.caption = (f"torch {torch.__version__} · cpu · {args.threads} thread(s) · freeze_parameters=True · "
                    f"level 1 with host graphs · outputs = eager and the fusion fired: {'✓' if checked else '✗'}")
    console.print(step)

    alone = Table(title="one layer's attention alone: µs per call, median of 7 x 200 calls")
    for column in ("batch", "position", "decoder's code", "SDPA on gathered rows", "decode_attention",
                   "SDPA / op"):
        alone.add_column(column, justify="right")
    for batch in (1, 16):
        for position in (args.position, config.max_seq_len - 1):
            alone.add_row(*_attention_rows(config, batch, position))
    console.print(alone)


if __name__ == "__main__":
    main()
