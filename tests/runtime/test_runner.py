"""GraphRunner rules, on the CPU's host graphs (the same tests run on CUDA when one is present)."""

import threading
import warnings

import pytest
import torch
from support import decode_inputs

import graphopt
from graphopt import FallbackKind
from graphopt.config import tolerance
from graphopt.models import Decoder, DecoderConfig, generate

ATOL, RTOL = tolerance(torch.float32)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# One layer: every runner rule shows on it, and each test compiles it afresh.
CONFIG = DecoderConfig.tiny(num_layers=1)


def twin_decoders(device="cpu"):
    torch.manual_seed(0)
    eager = Decoder(CONFIG).eval().to(device)
    model = Decoder(CONFIG).eval().to(device)
    model.load_state_dict(eager.state_dict())
    return eager, model


def runner_config(level=1, **kw):
    kw.setdefault("cudagraph_capture_sizes", [1, 2, 4, 8])
    return graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=True, **kw)


def optimized(model, level=1, **kw):
    return graphopt.optimize(model, runner_config(level, **kw), pad_values={"slots": model.scratch_slot})


def step_inputs(device, batch, position=5):
    return tuple(x.to(device) for x in decode_inputs(batch, position))


def warm_and_capture(opt, *inputs):
    """The warm-up calls (cudagraph_num_of_warmups), then the call that captures."""
    for _ in range(max(opt.config.cudagraph_num_of_warmups, 1) + 1):
        opt(*inputs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", [0, 1])
def test_random_batch_stream_gives_eager_tokens(device, level):
    eager, model = twin_decoders(device)
    opt = optimized(model, level)
    generator = torch.Generator().manual_seed(3)
    for _ in range(4):
        batch = int(torch.randint(1, 9, (1,), generator=generator))
        prompt = torch.randint(0, 512, (batch, 5), generator=generator).to(device)
        assert torch.equal(generate(model, prompt, 6, step=opt), generate(eager, prompt, 6))
    report = opt.report()
    assert report.replays > 0 and report.captures
    assert {c.size for c in report.captures} <= {1, 2, 4, 8}
    assert not report.fallback_counts[FallbackKind.CAPTURE_REFUSED]


@pytest.mark.parametrize("device", DEVICES)
def test_padding_goes_to_the_capture_size_and_the_scratch_slot(device):
    eager, model = twin_decoders(device)
    opt = optimized(model)
    with torch.inference_mode():
        for position in range(3):
            inputs = step_inputs(device, 3, position)
            torch.testing.assert_close(opt(*inputs), eager(*inputs), atol=ATOL, rtol=RTOL)
    assert [c.size for c in opt.report().captures] == [4]
    for ours, theirs in zip(model.buffers(), eager.buffers()):
        if ours.dim() == 4:  # caches: real rows equal; only the scratch row may differ
            torch.testing.assert_close(ours[:-1], theirs[:-1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("device", DEVICES)
def test_batch_above_the_largest_capture_size_falls_back(device):
    eager, model = twin_decoders(device)
    opt = optimized(model)
    with torch.inference_mode():
        inputs = step_inputs(device, 12)
        torch.testing.assert_close(opt(*inputs), eager(*inputs), atol=ATOL, rtol=RTOL)
        opt(*step_inputs(device, 12))
    assert opt.report().fallback_counts == {FallbackKind.NO_DEVICE_GRAPH: 2}


@pytest.mark.parametrize("device", DEVICES)
def test_moved_cache_and_new_parameters_give_fresh_results(device):
    """Dynamo guards on a buffer's or parameter's identity: a reassigned one
    recompiles (and so recaptures) before any replay could read the old one."""
    eager, model = twin_decoders(device)
    opt = optimized(model)
    inputs = step_inputs(device, 2)
    with torch.inference_mode():
        warm_and_capture(opt, *inputs)
        eager(*inputs)
        for module in (model, eager):  # a cache reassigned elsewhere in memory
            attention = module.layers[0].self_attn
            attention.k_cache = attention.k_cache.clone()
        torch.testing.assert_close(opt(*inputs), eager(*inputs), atol=ATOL, rtol=RTOL)
        assert opt.report().recompiles == 1
        new_weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
        model.lm_head.weight = new_weight
        eager.lm_head.weight = torch.nn.Parameter(new_weight.detach().clone())
        for _ in range(3):  # warm-ups, then a capture that reads the new weight
            torch.testing.assert_close(opt(*inputs), eager(*inputs), atol=ATOL, rtol=RTOL)
        assert opt.report().recompiles == 2
        assert [c.size for c in opt.report().captures] == [2, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_load_state_dict_in_place_is_seen_without_recapture(device):
    eager, model = twin_decoders(device)
    opt = optimized(model)
    inputs = step_inputs(device, 2)
    with torch.inference_mode():
        warm_and_capture(opt, *inputs)
    assert opt.report().captures
    torch.manual_seed(7)
    fresh = Decoder(CONFIG).state_dict()
    model.load_state_dict(fresh)
    eager.load_state_dict(fresh)
    with torch.inference_mode():
        torch.testing.assert_close(opt(*inputs), eager(*inputs), atol=ATOL, rtol=RTOL)
    assert opt.report().recaptures == 0


def test_shared_pool_is_smaller_than_separate_pools():
    def pool_bytes(**kw):
        _, model = twin_decoders()
        # Without size 1, which Dynamo specialises into a graph (and pool) of its own.
        opt = optimized(model, cudagraph_capture_sizes=[2, 4, 8], **kw)
        with torch.inference_mode():
            opt.capture_all(*decode_inputs(3))
        assert [c.size for c in opt.report().captures] == [8, 4, 2]
        return opt.report().pool_bytes, sum(c.nbytes for c in opt.report().captures)

    shared, parts = pool_bytes()
    separate, _ = pool_bytes(reuse_pool_in_same_graph=False)
    assert shared < 0.6 * separate
    assert separate == parts


def test_user_pool_is_shared_across_runners():
    pool = graphopt.graph_pool_handle("cpu")
    _, first = twin_decoders()
    _, second = twin_decoders()
    a, b = optimized(first, graph_pool=pool), optimized(second, graph_pool=pool)
    with torch.inference_mode():
        a.capture_all(*decode_inputs(8))
        b.capture_all(*decode_inputs(4))
    assert pool.nbytes == max(c.nbytes for c in a.report().captures + b.report().captures)


def sync_inside(x):
    scale = x.abs().max().item()  # a device->host sync: Dynamo breaks the graph here
    return x / scale


def test_a_sync_splits_the_graph_and_the_number_it_reads_is_never_frozen():
    """Dynamo breaks the graph at .item() and, once the scale varies, compiles the
    rest with .item() inside: that piece, and the one reading its number, run
    between replays; the result follows every new scale."""
    # Dynamo's own dispatch: a stored trace needs one graph, so this step runs under it anyway.
    opt = graphopt.optimize(sync_inside, runner_config(1, cudagraph_num_of_warmups=1, cache_dir=None))
    for _ in range(5):
        x = torch.randn(3, 4)
        torch.testing.assert_close(opt(x), sync_inside(x))
    pieces = [piece for graph in opt.report().pieces for piece in graph]
    (item,) = [p for p in pieces if p.split_reason and "_local_scalar_dense" in p.split_reason]
    assert "test_runner.py" in item.split_reason
    assert any(p.split_reason and "a number computed at run time" in p.split_reason for p in pieces)
    assert pieces[0].split_reason is None and pieces[0].replays == 3  # x.abs().max() replays


@pytest.mark.parametrize("device", DEVICES)
def test_clone_output_returns_fresh_tensors(device):
    _, model = twin_decoders(device)
    opt = optimized(model, clone_output=True)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error")
        warm_and_capture(opt, *step_inputs(device, 2))
        first = opt(*step_inputs(device, 2))
        kept = first.clone()
        second = opt(*step_inputs(device, 2, position=1))
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first, kept)


@pytest.mark.parametrize("device", DEVICES)
def test_four_threads_get_their_own_results(device):
    eager, model = twin_decoders(device)
    opt = optimized(model)
    batches = [1, 2, 3, 4]
    with torch.inference_mode():
        opt.capture_all(*step_inputs(device, 4))
    expected = {}
    results = {}

    def call(batch):
        ids, positions, _ = step_inputs(device, batch)
        slots = torch.arange(4 * (batch - 1), 4 * (batch - 1) + batch, device=device)  # disjoint cache rows
        with torch.inference_mode():
            for _ in range(20):
                results[batch] = opt(ids, positions, slots)
            expected[batch] = (ids, positions, slots)

    threads = [threading.Thread(target=call, args=(b,)) for b in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with torch.inference_mode():
        for batch in batches:
            torch.testing.assert_close(results[batch], eager(*expected[batch]), atol=ATOL, rtol=RTOL)


@pytest.mark.fresh_cache
@pytest.mark.parametrize("device", DEVICES)
def test_a_graph_a_worker_thread_compiles_still_clones_its_outputs(device):
    """The step was captured in the main thread; a worker's inputs are not inference
    tensors, so its call compiles a new graph with a runner of its own. A second
    worker replays that runner: the first worker's outputs must be its own."""
    eager, model = twin_decoders(device)
    opt = optimized(model)
    with torch.inference_mode():
        opt.capture_all(*step_inputs(device, 4))
    results, inputs = {}, {}

    def call(batch):
        ids, positions, _ = step_inputs(device, batch)
        inputs[batch] = (ids, positions, torch.arange(4 * (batch - 1), 4 * (batch - 1) + batch, device=device))
        with torch.inference_mode():
            for _ in range(5):  # warm-up, capture, replays
                results[batch] = opt(*inputs[batch])

    for batch in (3, 4):  # one after the other: batch 3 replays the size-4 graph batch 4 replays
        worker = threading.Thread(target=call, args=(batch,))
        worker.start()
        worker.join()
    assert opt.report().recompiles >= 2  # the workers' graph is not the main thread's
    with torch.inference_mode():
        for batch in (3, 4):
            torch.testing.assert_close(results[batch], eager(*inputs[batch]), atol=ATOL, rtol=RTOL)


def write_state(x, state):
    state.add_(x.sum(0))
    return state * 2


def test_mutated_input_is_written_in_place_once_per_call_and_a_new_one_is_rebound():
    """A tensor argument the graph writes is used in place, never copied; another
    tensor of its size in its place is what the host graph then reads and writes
    (rebound, not captured again: test_rebind.py)."""
    opt = graphopt.optimize(write_state, runner_config(0), dynamic_dims={"x": 0})
    state = torch.zeros(4)
    x = torch.ones(3, 4)
    for _ in range(3):  # a warm-up, the capture, a replay: each one real call
        opt(x, state)
    torch.testing.assert_close(state, torch.full((4,), 9.0))
    # x.sum(0) reads every row: captured at the batch's own size, not padded to 4.
    assert [c.size for c in opt.report().captures] == [3] and opt.report().replays == 1
    moved = torch.zeros(4)
    torch.testing.assert_close(opt(x, moved), torch.full((4,), 6.0))
    torch.testing.assert_close(moved, torch.full((4,), 3.0))
    torch.testing.assert_close(state, torch.full((4,), 9.0))
    assert (opt.report().recaptures, opt.report().rebinds, len(opt.report().captures)) == (0, 1, 1)


def two_batch_dims(x):
    return x[:, None] * x[None, :]


@pytest.mark.parametrize("level", [0, 1])
def test_outputs_that_cannot_be_sliced_are_captured_at_exact_sizes(level):
    opt = graphopt.optimize(two_batch_dims, runner_config(level, cudagraph_num_of_warmups=1))
    for batch in (3, 3, 3, 5, 5, 5):
        x = torch.randn(batch)
        torch.testing.assert_close(opt(x), two_batch_dims(x))
    assert opt.report().fallback_counts == {FallbackKind.EXACT_SIZE: 1}
    (reason,) = opt.report().fallbacks
    # The outer product pairs every row with every other: the row analysis names the op.
    assert "aten.mul" in reason and "test_runner.py:" in reason
    assert [c.size for c in opt.report().captures] == [3, 5]


def batch_last(x):
    return (x * 2).transpose(0, 1)  # the output's batch dim is its dim 1


def test_output_batch_dims_come_from_the_graph():
    opt = graphopt.optimize(batch_last, runner_config(1, cudagraph_capture_sizes=[2, 4],
                                                        cudagraph_num_of_warmups=1))
    for batch in (3, 3, 3, 2, 2, 2):
        x = torch.randn(batch, 5)
        out = opt(x)
        assert out.shape == (5, batch)
        torch.testing.assert_close(out, batch_last(x))
    assert [c.size for c in opt.report().captures] == [4, 2] and opt.report().replays == 2
    assert not opt.report().fallbacks


def test_level_2_on_cpu_runs_inductor_kernels_without_device_graphs():
    eager, model = twin_decoders()
    opt = optimized(model, 2, cudagraph_capture_sizes=[4, 8])
    with torch.inference_mode():
        for batch in (3, 4, 7):
            inputs = decode_inputs(batch)
            torch.testing.assert_close(opt(*inputs), eager(*inputs), atol=ATOL, rtol=RTOL)
    assert FallbackKind.NO_DEVICE_GRAPH in opt.report().fallback_counts
    assert opt.report().captures == []
    assert len(opt.report().graphs) == 1  # one dynamic-shape kernel serves every batch size


def test_report_lists_runtime_figures():
    _, model = twin_decoders()
    opt = optimized(model)
    with torch.inference_mode():
        for position in range(4):  # a warm-up, the capture, two replays
            opt(*decode_inputs(3, position))
    report = opt.report().to_dict()
    assert report["capture_sizes"] == [1, 2, 4, 8]
    assert report["captures"][0]["size"] == 4 and report["captures"][0]["bytes"] > 0
    assert report["replays"] == 2 and report["recaptures"] == 0 and report["pool_bytes"] > 0
    assert "device graphs: 1 captured" in str(opt.report())


def test_capture_all_needs_inputs_once():
    _, model = twin_decoders()
    opt = optimized(model)
    with pytest.raises(ValueError, match="capture_all\\(\\) needs example inputs"):
        opt.capture_all()
    with pytest.raises(RuntimeError, match="needs use_cudagraph=True"):
        graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=1, use_cudagraph=False)).capture_all()


def test_out_of_range_dynamic_dim_is_an_error_with_device_graphs_too():
    opt = graphopt.optimize(two_batch_dims, runner_config(0), dynamic_dims={"x": 1})
    with pytest.raises(ValueError, match=r"dynamic dim 1 of argument 'x' is out of range for its shape \(3,\)"):
        opt(torch.randn(3))


def shifted(x, positions):
    return x * 2 + positions


def test_broadcast_inputs_keep_their_layout_in_the_static_buffers():
    """`positions` arrives expanded (stride 0 along the batch, as transformers builds
    position ids): its static buffer keeps one row, so the graph reads what it traced."""
    opt = graphopt.optimize(shifted, runner_config(1, cudagraph_capture_sizes=[2, 4], cudagraph_num_of_warmups=1))
    for batch in (3, 3, 3, 3, 2, 2, 2):
        x = torch.randn(batch, 5)
        positions = (torch.arange(5.0) + batch).expand(batch, 5)
        torch.testing.assert_close(opt(x, positions), shifted(x, positions))
    assert [c.size for c in opt.report().captures] == [4, 2] and opt.report().replays == 3


def masked_sums(x, mask):
    return x * 2, mask.sum(-1)


def test_each_batch_sized_input_may_have_its_own_symbol():
    """Dynamo gives input_ids and attention_mask a symbol each: both are the batch,
    padded together; inputs that disagree on the rows run without a graph."""
    opt = graphopt.optimize(masked_sums, runner_config(1, cudagraph_capture_sizes=[1, 2, 4],
                                                       cudagraph_num_of_warmups=1))
    for batch in (2, 2, 3, 3, 3, 3):
        x, mask = torch.randn(batch, 4), torch.ones(batch, 4)
        torch.testing.assert_close(opt(x, mask), masked_sums(x, mask))
    assert [c.size for c in opt.report().captures] == [2, 4] and opt.report().replays == 2
    x, mask = torch.randn(3, 4), torch.ones(2, 4)
    torch.testing.assert_close(opt(x, mask), masked_sums(x, mask))
    assert opt.report().fallback_counts == {FallbackKind.NO_DEVICE_GRAPH: 1}


class Counter:
    length = 0


def add_count(x, counter):
    counter.length += 1
    return x + counter.length


def test_a_number_that_changes_every_call_stops_capturing_and_says_so():
    opt = graphopt.optimize(add_count, runner_config(1, cudagraph_num_of_warmups=1))
    ours, theirs = Counter(), Counter()
    for _ in range(14):
        x = torch.randn(2, 4)
        torch.testing.assert_close(opt(x, ours), add_count(x, theirs))
    # Counted at each call that brings a new value once the runner holds 8.
    assert opt.report().fallback_counts == {FallbackKind.NO_DEVICE_GRAPH: 4}
    assert opt.report().replays == 0
