"""The serving trace: a seeded stream of decode steps through the reference decoder
whose batch is the number of running sequences, as a server's scheduler hands them
out. `graphopt bench --workloads serving` replays it for every contender;
`benchmarks/serving_trace.py` adds `graph_memory_budget` variants.

The trace wanders over a handful of sizes that the default capture list pads and
jumps, rarely, to a burst of a few steps at 150..200: the traffic
`cudagraph_capture_sizes="auto"` is made for. Two sets of sizes, two workloads:

- `serving`: PADDED_SIZES, 9, 11, 13, 17, 20, 26, which the default list runs at 16,
  16, 16, 24, 24, 32 (3-7 padded rows a step: "a batch of 9 runs at 16");
- `serving-small`: SMALL_SIZES, 3, 5, 6, 11, 13, 20, run at 4, 8, 8, 16, 16, 24; half
  its steps are below 8 rows, where a CPU step costs the same at any batch, so padding
  them costs nothing there."""

from __future__ import annotations

import random
from typing import Any

import torch

from ..config import default_capture_sizes
from ..models import Decoder, DecoderConfig
from .workloads import Case, Sizes, Step, Workload

PADDED_SIZES = (9, 11, 13, 17, 20, 26)
SMALL_SIZES = (3, 5, 6, 11, 13, 20)
BURST_SIZES = (150, 200)
MAX_NUM_SEQS = 256    # graphopt's default: its default capture list goes up to it
POSITIONS = 16        # step i decodes position i % POSITIONS: the KV cache stays small
CHECK_EVERY = 50      # the logits kept for the check against eager: every 50th step, and each burst's first


def trace(steps: int, seed: int = 0, burst_every: int = 400, burst_length: int = 6,
          quiet: tuple[int, ...] = PADDED_SIZES) -> list[int]:
    """Batch sizes of `steps` decode steps: a random walk over the `quiet` sizes, and a
    burst of `burst_length` steps at a random size in BURST_SIZES about every `burst_every`."""
    rng = random.Random(seed)
    batches, here = [], 2
    while len(batches) < steps:
        if rng.random() < 1 / burst_every:
            batches += [rng.randint(*BURST_SIZES)] * burst_length
            continue
        if rng.random() < 0.1:
            here = min(max(here + rng.choice((-1, 1)), 0), len(quiet) - 1)
        batches.append(quiet[here])
    return batches[:steps]


def burst_starts(batches: list[int]) -> list[bool]:
    """Which steps begin a burst."""
    return [b >= BURST_SIZES[0] and (i == 0 or batches[i - 1] != b) for i, b in enumerate(batches)]


def checked(batches: list[int]) -> list[bool]:
    """Which steps' logits a replay keeps: every CHECK_EVERY-th, and the first of each
    burst (the sizes a graph is least likely to have been captured for)."""
    return [i % CHECK_EVERY == 0 or start for i, start in enumerate(burst_starts(batches))]


def replay(step: Step, steps: list[tuple[Any, ...]]) -> list[torch.Tensor]:
    """Decode every step of the trace; the logits of the checked steps, cloned (a device
    graph's next replay overwrites its outputs)."""
    kept = []
    for ids, positions, slots, check in steps:
        if check:
            kept.append(step(ids, positions, slots).clone())
        else:
            step(ids, positions, slots)
    return kept


def serving(sizes: Sizes, name: str = "serving", quiet: tuple[int, ...] = PADDED_SIZES) -> Workload:
    """The reference decoder (tiny with --quick, small on CPU, bench on CUDA) with
    MAX_NUM_SEQS cache slots, over one trace that wanders over `quiet`; graphopt's
    default capture list."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    keys = dict(max_num_seqs=MAX_NUM_SEQS, max_seq_len=POSITIONS, dtype=sizes.dtype)
    config = sizes.pick(DecoderConfig.tiny(**keys), DecoderConfig.small(**keys), DecoderConfig.bench(**keys))
    model = Decoder(config).eval().to(sizes.device)
    length, burst_every = sizes.pick((400, 100), (3000, 400), (4000, 400))
    batches = trace(length, burst_every=burst_every, quiet=quiet)
    ids = torch.randint(0, config.vocab_size, (length, max(batches)), generator=generator)
    steps = [(ids[i, :b].to(sizes.device), torch.full((b,), i % POSITIONS, device=sizes.device),
              torch.arange(b, device=sizes.device), check)
             for i, (b, check) in enumerate(zip(batches, checked(batches)))]
    bursts = sum(burst_starts(batches))
    case = Case(f"trace of {length} steps, batches {min(batches)}..{max(batches)}", steps, replay,
                sum(batches), "tokens", graph_table=True)
    title = (f"serving trace: {length} decode steps at {', '.join(map(str, quiet))} sequences, "
             f"{bursts} bursts at {BURST_SIZES[0]}..{BURST_SIZES[1]}; reference decoder: hidden "
             f"{config.hidden_size}, {config.num_layers} layers, vocab {config.vocab_size}, {config.dtype}")
    return Workload(name, title, model, [case], capture_sizes=default_capture_sizes(MAX_NUM_SEQS),
                    pad_values={"slots": model.scratch_slot},
                    onnx_unsupported="its step writes the KV cache buffers in place, and an exported "
                                     "ONNX graph keeps no state between runs")
