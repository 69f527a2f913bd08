"""The CUDA path end to end, on a GPU only (issue 31): CUDA graphs at every level,
at each capture size and at padded sizes; piecewise graphs; a refused capture that
names the op and the user's line and leaves the device usable; transformers'
generate(); the fused ops' CUDA branches against their references."""

from __future__ import annotations

import pytest
import torch
from support import decode_inputs

import graphopt
from graphopt import FallbackKind
from graphopt.config import tolerance
from graphopt.models import Decoder, DecoderConfig, generate

ops = torch.ops.graphopt

pytestmark = pytest.mark.cuda

SIZES = [1, 2, 4, 8]


def twins(dtype=torch.float32):
    torch.manual_seed(0)
    eager = Decoder(DecoderConfig.tiny(dtype=dtype)).eval().cuda()
    model = Decoder(DecoderConfig.tiny(dtype=dtype)).eval().cuda()
    model.load_state_dict(eager.state_dict())
    return eager, model


def step_inputs(batch):
    return tuple(x.cuda() for x in decode_inputs(batch))


def device_graphs(model, level, **kw):
    config = graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=True,
                                              cudagraph_capture_sizes=SIZES, **kw)
    return graphopt.optimize(model, config, pad_values={"slots": model.scratch_slot})


@pytest.mark.parametrize("level", [0, 1, 2])
def test_every_capture_size_and_every_padded_size_replays_eager_logits(level):
    eager, model = twins()
    opt = device_graphs(model, level)
    atol, rtol = tolerance(torch.float32)
    for batch in range(1, 9):  # 3, 5, 6 and 7 pad up to the next capture size
        inputs = step_inputs(batch)
        with torch.no_grad():  # a step that records autograd is not captured
            expected = eager(*inputs)
            for call in range(4):  # two warm-ups, the capture, a replay
                torch.testing.assert_close(opt(*inputs), expected, atol=atol, rtol=rtol,
                                           msg=lambda m: f"batch {batch}, call {call}: {m}")
    report = opt.report()
    assert {c.size for c in report.captures} == set(SIZES)
    assert report.replays >= 8
    refused = (FallbackKind.NO_DEVICE_GRAPH, FallbackKind.CAPTURE_REFUSED, FallbackKind.EXACT_SIZE)
    assert not [kind for kind in report.fallback_counts if kind in refused], report.fallbacks
    torch.cuda.synchronize()


def test_every_capture_size_hands_out_its_logits_in_one_block():
    """Graphs of one pool copy their outputs into one block per output (graph_outputs.py),
    so the pool holds no size's logits between replays. Batch 1 is a graph of its own
    (Dynamo specialises a size of 1), with its own block, captured into the same pool."""
    eager, model = twins()
    opt = device_graphs(model, 1)
    atol, rtol = tolerance(torch.float32)
    blocks = {}
    with torch.no_grad():
        opt.capture_all(*step_inputs(8))
        for batch in SIZES:
            inputs = step_inputs(batch)
            got = opt(*inputs)
            torch.testing.assert_close(got, eager(*inputs), atol=atol, rtol=rtol)
            blocks[batch] = got.untyped_storage().data_ptr()
    assert blocks[2] == blocks[4] == blocks[8] != blocks[1]
    report = opt.report()
    assert report.replays == len(SIZES)
    assert len(report.graphs) == 2 and len(report.pools) == 1, report.pools
    assert report.pool_bytes >= max(c.nbytes for c in report.captures) > 0  # batch 1's capture last, and small


@pytest.mark.parametrize("level", [1, 2])
def test_generate_with_cuda_graphs_gives_eager_tokens(level):
    eager, model = twins()
    opt = device_graphs(model, level)
    for batch in (1, 3, 8):
        prompt = torch.randint(0, 512, (batch, 5), generator=torch.Generator().manual_seed(batch)).cuda()
        assert torch.equal(generate(model, prompt, 8, step=opt), generate(eager, prompt, 8)), f"batch {batch}"
    assert opt.report().replays > 0


def test_bfloat16_decoder_replays_within_bfloat16_tolerance():
    eager, model = twins(torch.bfloat16)
    opt = device_graphs(model, 2)
    atol, rtol = tolerance(torch.bfloat16)
    for batch in (1, 5, 8):
        inputs = step_inputs(batch)
        with torch.no_grad():
            expected = eager(*inputs)
            for _ in range(4):
                got = opt(*inputs)
        torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)
    report = opt.report()
    assert report.replays > 0
    # Level 2 on CUDA: each layer's attention reads the cache in place (issue 48).
    assert [g.fused_ops.get("decode_attention") for g in report.graphs] == [2] * len(report.graphs)


def masked_step(x, w):
    h = torch.relu(x @ w)
    h[(h > 1.0).any(dim=1)] = w[0]  # a data-dependent count: refused by a capture
    return torch.tanh(h @ w) + 1


@pytest.mark.parametrize("level", [0, 1, 2])
def test_piecewise_graphs_replay_around_an_op_a_capture_refuses(level):
    w = torch.randn(8, 8, device="cuda")
    config = graphopt.GraphOptimizationConfig(graph_opt_level=level, cudagraph_capture_sizes=[2, 4],
                                              cudagraph_num_of_warmups=1)
    opt = graphopt.optimize(masked_step, config, dynamic_dims={"x": 0})
    for batch in (3, 3, 3, 4, 4, 4):
        x = torch.randn(batch, 8, device="cuda")
        torch.testing.assert_close(opt(x, w), masked_step(x.clone(), w))
    (pieces,) = opt.report().pieces
    if torch.__version__ < "2.15":  # later torch turns the masked write into masked_fill_, which replays
        assert [p.split_reason is None for p in pieces] == [True, False, True]
        assert "test_cuda_path.py" in pieces[1].split_reason
    assert any(p.replays > 0 for p in pieces if p.split_reason is None)


def host_copy_step(x):
    scale = (x * 2).sum().cpu()  # a device-to-host copy: a capture cannot replay it
    return x * scale.to(x.device)


@pytest.mark.parametrize("level", [1, 2])
def test_a_refused_capture_names_op_and_line_and_leaves_the_device_usable(level):
    config = graphopt.GraphOptimizationConfig(graph_opt_level=level, cudagraph_mode="full",
                                              cudagraph_capture_sizes=[4], cudagraph_num_of_warmups=1)
    opt = graphopt.optimize(host_copy_step, config, dynamic_dims={"x": 0})
    x = torch.randn(4, 8, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(opt(x), host_copy_step(x))
    report = opt.report()
    assert report.captures == []
    assert set(report.fallback_counts) <= {FallbackKind.NO_DEVICE_GRAPH, FallbackKind.CAPTURE_REFUSED}
    reason = " ".join(report.fallbacks)
    assert "host" in reason and "test_cuda_path.py" in reason, report.fallbacks
    assert not torch.cuda.is_current_stream_capturing()
    # The process goes on: a plain kernel, and a new capture of another graph.
    static = torch.ones(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = static * 3
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full((4,), 3.0, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_and_rotary_cuda_branches_match_their_references(dtype):
    atol, rtol = tolerance(dtype)
    x, residual = (torch.randn(6, 64, device="cuda", dtype=dtype) for _ in range(2))
    weight = torch.randn(64, device="cuda", dtype=dtype)
    for cast in ("before_scale", "after_scale", "none"):
        got = ops.rms_norm(x, weight, 1e-6, cast)
        want = ops.rms_norm(x.cpu().double(), weight.cpu().double(), 1e-6, cast)
        torch.testing.assert_close(got.cpu().double(), want, atol=atol, rtol=rtol)
    normed, added = ops.add_rms_norm(x, residual, weight, 1e-6, "before_scale")
    torch.testing.assert_close(added, x + residual)
    cos, sin = torch.randn(6, 64, device="cuda", dtype=dtype), torch.randn(6, 64, device="cuda", dtype=dtype)
    rotated = ops.rotary_embedding(x, cos, sin)
    half = x.float().chunk(2, dim=-1)
    want = x.float() * cos.float() + torch.cat((-half[1], half[0]), dim=-1) * sin.float()
    torch.testing.assert_close(rotated.float(), want, atol=atol * 4, rtol=rtol)
