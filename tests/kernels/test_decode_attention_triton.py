"""The Triton decode_attention (what CUDA runs) against the torch reference, on every
path of its contract: GQA and not, slot-indexed and batch-indexed caches, strided
caches, lengths from none to past the cache, broadcast masks, a query left with no
key, float32 and bfloat16. Without a GPU it runs in Triton's interpreter on the CPU
(where triton is installed); on CUDA it runs compiled, also inside a CUDA graph."""

import os
import subprocess
import sys

import pytest
import torch

from graphopt.config import tolerance
from graphopt.kernels import decode_attention as kernel

B, H, S, D, SLOTS = 3, 4, 70, 16, 5  # S past one block of keys (64)


def cases(dtype, device):
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(device)  # noqa: E731
    q = rand(B, 2, H, D).transpose(1, 2)  # [b, h, t=2, d], as a projection gives it
    slot_cache = rand(SLOTS, S, 2, D).transpose(1, 2)  # [slots, kv=2, s, d], strided
    full_cache = rand(B, H, S, D)
    slots = torch.tensor([3, 0, 4], device=device)
    positions = torch.tensor([[0, 1], [40, 69], [-1, 300]], device=device)  # none, past a block, past the cache
    allowed = torch.rand(B, 1, S, generator=gen).to(device) > 0.4
    allowed[1] = False  # every key of row 1 masked: it averages its row
    yield "gqa slots positions", (q, slot_cache, slot_cache.flip(0), slots, positions, D ** -0.5, None)
    yield "mha rows no positions", (q, full_cache, full_cache * 2, None, None, 0.3, None)
    yield "one position for all", (q, full_cache, full_cache, None, torch.tensor(33, device=device), 0.3, None)
    yield "mask and positions", (q, slot_cache, slot_cache, slots, positions, D ** -0.5, allowed)
    yield "mask alone", (q, full_cache, full_cache, None, None, D ** -0.5, allowed.expand(B, 2, S))


def compare_every_case(device: str, dtypes=(torch.float32, torch.bfloat16)) -> None:
    from graphopt.kernels.decode_attention_triton import decode_attention

    for dtype in dtypes:
        atol, rtol = tolerance(dtype)
        for name, args in cases(dtype, device):
            out = decode_attention(*args)
            assert out.dtype == dtype and out.shape == args[0].shape and out.is_contiguous(), name
            torch.testing.assert_close(out, kernel._reference(*args), atol=atol, rtol=rtol,
                                       msg=lambda m: f"{dtype} {name}: {m}")


def test_interpreted_kernel_matches_the_reference():
    """In a fresh process: Triton takes its interpreter only if TRITON_INTERPRET is
    set before it is imported."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    code = "import test_decode_attention_triton as t; t.compare_every_case('cpu')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_op_runs_the_kernel_on_cuda_and_inside_a_cuda_graph(dtype):
    atol, rtol = tolerance(dtype)
    compare_every_case("cuda", [dtype])
    for name, args in cases(dtype, "cuda"):
        expected = kernel._reference(*args)
        torch.testing.assert_close(torch.ops.graphopt.decode_attention(*args), expected, atol=atol, rtol=rtol,
                                   msg=lambda m: f"{name}: {m}")
    assert kernel.triton_unavailable() is None
    q, cache_, _, slots, positions, scale, _ = next(cases(dtype, "cuda"))[1]
    graph = torch.cuda.CUDAGraph()
    torch.ops.graphopt.decode_attention(q, cache_, cache_, slots, positions, scale)  # compiles outside the capture
    with torch.cuda.graph(graph):
        out = torch.ops.graphopt.decode_attention(q, cache_, cache_, slots, positions, scale)
    positions.fill_(20)  # lengths are read when the graph replays
    graph.replay()
    torch.testing.assert_close(out, kernel._reference(q, cache_, cache_, slots, positions, scale), atol=atol, rtol=rtol)
