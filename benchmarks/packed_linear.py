"""Packed GEMMs on the CPU: does packing a weight for oneDNN or MKL beat ATen's linear?

Per linear shape of `DecoderConfig.small()`'s decode step (q, k/v, o, gate/up,
down, lm_head, and the horizontally fused q/k/v and gate/up of freeze_parameters),
at batch 1 and 16, one thread: ATen's `linear` (an mm on the transposed weight),
oneDNN's packed linear (`mkldnn._reorder_linear_weight` once, then
`mkldnn._linear_pointwise`) and MKL's (`mkl._mkl_reorder_linear_weight`, then
`mkl._mkl_linear`), called through the dispatcher as a host graph's tape calls
them. Then the whole eager decode step with every linear through each. Each
figure is the median over interleaved rounds of µs per call.

    OMP_NUM_THREADS=1 python benchmarks/packed_linear.py
"""

from __future__ import annotations

from typing import Callable

import torch
from rich.console import Console
from rich.table import Table
from timing import median_us

from graphopt.models import Decoder, DecoderConfig

ROUNDS, CALLS = 15, 200
BATCHES = (1, 16)
aten = torch.ops.aten


def shapes(config: DecoderConfig) -> dict[str, tuple[int, int]]:
    """name -> (in features, out features) of each distinct linear of one decode step."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    i = config.intermediate_size
    return {"q / o": (h, h), "k / v": (h, kv), "qkv (fused)": (h, h + 2 * kv), "gate / up": (h, i),
            "gate_up (fused)": (h, 2 * i), "down": (i, h), "lm_head": (h, config.vocab_size)}


def linears(weight: torch.Tensor, batch: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The three ways to compute x @ weight.t(), each with its weight packed once."""
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, batch)
    mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, batch)
    return {"aten": lambda x: aten.linear.default(x, weight),
            "onednn": lambda x: torch.ops.mkldnn._linear_pointwise.default(x, onednn, None, "none", [], ""),
            "mkl": lambda x: torch.ops.mkl._mkl_linear.default(x, mkl, weight, None, batch)}


def per_shape(config: DecoderConfig) -> Table:
    table = Table(title="one linear, µs per call (ratio: aten / packed, > 1 is faster than aten)")
    for column in ("shape (in -> out)", "batch", "aten", "onednn", "mkl", "aten/onednn", "aten/mkl"):
        table.add_column(column, justify="right")
    for name, (k, n) in shapes(config).items():
        weight = torch.randn(n, k)
        for batch in BATCHES:
            x = torch.randn(batch, k)
            ways = linears(weight, batch)
            for way in ways.values():
                torch.testing.assert_close(way(x), ways["aten"](x), atol=1e-4, rtol=1e-4)
            us = median_us({way: (lambda f=f: f(x)) for way, f in ways.items()}, ROUNDS, CALLS)
            table.add_row(f"{name} ({k} -> {n})", str(batch), *(f"{us[w]:.1f}" for w in ways),
                          f"{us['aten'] / us['onednn']:.2f}", f"{us['aten'] / us['mkl']:.2f}")
    return table


def decode_inputs(config: DecoderConfig, batch: int) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(0, config.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
    return ids, torch.full((batch,), 7), torch.arange(batch)


class PackedLinear(torch.nn.Module):
    """`linear` through one of `linears`' ways, its weight packed for `batch` rows."""

    def __init__(self, linear: torch.nn.Linear, way: str, batch: int):
        super().__init__()
        self.forward = linears(linear.weight.detach(), batch)[way]


def whole_step(config: DecoderConfig) -> Table:
    table = Table(title="eager decode step, every linear one way, µs per step")
    for column in ("batch", "aten", "onednn", "mkl", "aten/onednn", "aten/mkl"):
        table.add_column(column, justify="right")
    torch.manual_seed(0)
    base = Decoder(config).eval()
    for batch in BATCHES:
        steps = {}
        for way in ("aten", "onednn", "mkl"):
            model = Decoder(config).eval()
            model.load_state_dict(base.state_dict())
            for parent in list(model.modules()):
                for child_name, child in list(parent.named_children()):
                    if isinstance(child, torch.nn.Linear) and child.bias is None:
                        setattr(parent, child_name, PackedLinear(child, way, batch))
            steps[way] = model
        inputs = decode_inputs(config, batch)
        with torch.inference_mode():
            reference = steps["aten"](*inputs)
            for model in steps.values():
                torch.testing.assert_close(model(*inputs), reference, atol=1e-3, rtol=1e-3)
            us = median_us({way: (lambda m=m: m(*inputs)) for way, m in steps.items()}, ROUNDS, CALLS)
        table.add_row(str(batch), *(f"{us[w]:.0f}" for w in steps),
                      f"{us['aten'] / us['onednn']:.2f}", f"{us['aten'] / us['mkl']:.2f}")
    return table


def main() -> None:
    torch.set_num_threads(1)
    config = DecoderConfig.small()
    console = Console()
    console.print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, "
                  f"oneDNN {torch.backends.mkldnn.is_available()}, MKL {torch.backends.mkl.is_available()}")
    console.print(per_shape(config))
    console.print(whole_step(config))


if __name__ == "__main__":
    main()
