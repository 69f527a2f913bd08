"""A decode step's GEMMs on a GPU: cuBLAS against a weight-streaming Triton kernel,
at the 1.1B decoder's linear shapes and a few rows (the batch), as bandwidth.

The kernel (below) is the one a GEMV-shaped decode GEMM would get: one program owns
BLOCK_N output columns for every row, streams its [BLOCK_N, k] slab of the weight
once, BLOCK_K at a time along k (contiguous: coalesced loads), and multiplies it
with all rows of x, padded to 16 for `tl.dot`, accumulating in float32; small
BLOCK_N gives every SM a slab, and no split along k means no second kernel.
Measured on an H200 (docs/benchmarks.md, "On a GPU"), it is level with cuBLAS
inside a CUDA graph (0.91-1.23x), so graphopt keeps cuBLAS: a decode GEMM of a few
MB is bound by its launch and ramp (5-6 us), not by bandwidth, and what pays is
fewer, larger GEMMs (horizontal fusion).

Each case is timed as a step meets it: one CUDA graph calls the GEMM on enough
copies of the weight to overflow the L2 cache, so every call streams its weight
from HBM, and the replay's time is split over the calls. Prints, per shape and
row count: cuBLAS's time and GB/s, the best Triton configuration's, and the ratio
(`--json` keeps every configuration's time).

    python benchmarks/cuda_skinny_mm.py                      # rows 1, 2, 4, 8, 16
    python benchmarks/cuda_skinny_mm.py --rows 1,8 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import torch
import triton
import triton.language as tl

# (name, n, k) of DecoderConfig.billion()'s linears: weight [n, k]; fused ones as
# horizontal fusion makes them.
SHAPES = [("q/o", 2048, 2048), ("k/v", 256, 2048), ("qkv", 2560, 2048), ("gate/up", 5632, 2048),
          ("gate_up", 11264, 2048), ("down", 2048, 5632), ("lm_head", 32000, 2048)]
CONFIGS = [(bn, bk, warps, stages) for bn, bk, (warps, stages)
           in itertools.product((16, 32, 64), (128, 256, 512), ((4, 3), (4, 5), (8, 4)))]
ROWS = 16  # the rows a program multiplies at once (tl.dot's smallest)


@triton.jit
def _kernel(x_ptr, w_ptr, out_ptr, m_len, n_len, sx_m, sx_k, sw_n, sw_k, so_m, so_n, K_LEN: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    m_in = m < m_len
    n_in = n < n_len
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(0, K_LEN, BLOCK_K):
        kk = start + k
        k_in = kk < K_LEN
        x = tl.load(x_ptr + m[:, None] * sx_m + kk[None, :] * sx_k, mask=m_in[:, None] & k_in[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None] * sw_n + kk[None, :] * sw_k, mask=n_in[:, None] & k_in[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(out_ptr + m[:, None] * so_m + n[None, :] * so_n, acc.to(out_ptr.dtype.element_ty),
             mask=m_in[:, None] & n_in[None, :])


def skinny_mm(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, num_warps: int = 4,
              num_stages: int = 4) -> torch.Tensor:
    """x @ weight.T with one (BLOCK_N, BLOCK_K, warps, stages) configuration."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, m, n, *x.stride(), *weight.stride(), *out.stride(), K_LEN=k,
        BLOCK_M=max(ROWS, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages)
    return out


def streamed_us(fn, x: torch.Tensor, weights: list[torch.Tensor], replays: int = 5) -> float:
    """Microseconds a call of fn(x, w), each w read from HBM (not from L2)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for w in weights:
            fn(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(weights))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_skinny_mm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    results = []
    for (name, n, k), m in itertools.product(SHAPES, [int(r) for r in args.rows.split(",")]):
        nbytes = n * k * 2
        copies = max(2, math.ceil(3 * l2 / nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        expected = x.float() @ weights[0].float().t()
        cublas = streamed_us(lambda a, w: torch.mm(a, w.t()), x, weights)
        timed = {}
        for config in CONFIGS:
            try:
                got = skinny_mm(x, weights[0], *config).float()
            except Exception:  # noqa: BLE001 - a configuration this GPU cannot run (shared memory)
                timed[config] = float("nan")
                continue
            if not torch.allclose(got, expected, atol=0.05 * expected.abs().max().item(), rtol=0):
                timed[config] = float("nan")
                continue
            timed[config] = streamed_us(lambda a, w: skinny_mm(a, w, *config), x, weights)
        best = min((c for c in timed if timed[c] == timed[c]), key=timed.get)
        row = {"shape": name, "n": n, "k": k, "rows": m, "cublas_us": round(cublas, 2),
               "cublas_gbs": round(nbytes / cublas / 1e3), "triton_us": round(timed[best], 2),
               "triton_gbs": round(nbytes / timed[best] / 1e3), "best": best,
               "speedup": round(cublas / timed[best], 2),
               "configs": {str(c): round(t, 2) for c, t in timed.items()}}
        results.append(row)
        print(f"{name:8} n={n:5} k={k:5} rows={m:2}: cuBLAS {cublas:7.2f} us ({row['cublas_gbs']:4} GB/s)  "
              f"triton {timed[best]:7.2f} us ({row['triton_gbs']:4} GB/s) {best}  x{row['speedup']}", flush=True)
        del weights
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results},
                      out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
