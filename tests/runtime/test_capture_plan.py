"""cudagraph_capture_sizes="auto" and graph_memory_budget, on the CPU's host graphs
(the CUDA variant, whose pools are measured with torch.cuda.memory_stats, at the end)."""

import random

import pytest
import torch

import graphopt
from graphopt import FallbackKind
from graphopt.config import tolerance
from graphopt.runtime.capture_plan import HOLD_CAPTURED, RANGE_WINDOWS, STEP_OVERHEAD_ROWS, Traffic, plan

ATOL, RTOL = tolerance(torch.float32)
TRAFFIC = {3: 100, 5: 80, 6: 10, 12: 30, 200: 2}


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def auto(**kw):
    kw.setdefault("graph_opt_level", 1)
    kw.setdefault("cudagraph_capture_sizes", "auto")
    kw.setdefault("capture_replan_interval", 8)
    kw.setdefault("max_num_seqs", 32)
    kw.setdefault("cudagraph_num_of_warmups", 1)
    return graphopt.GraphOptimizationConfig(**kw)


def feed(opt, model, batches, device="cpu"):
    """Run every batch; each output must equal eager's."""
    torch.manual_seed(1)
    with torch.no_grad():
        for batch in batches:
            x = torch.randn(batch, 16, device=device)
            torch.testing.assert_close(opt(x), model(x), atol=ATOL, rtol=RTOL)


def test_the_plan_captures_the_sizes_that_pay_and_pads_the_rest():
    chosen = plan(TRAFFIC, limit=256, warmups=2, padding=True)
    # 6 (10 steps) pads one row to 12's graph; 200 (2 steps) cannot pay for a capture of 3 x 216 rows.
    assert chosen.sizes == (3, 5, 12)
    assert chosen.padded_rows == 10 * (12 - 6)
    assert chosen.eager_steps == 2
    assert "sizes 6 pad to the next capture size: cheaper than a capture each" in chosen.reasons
    assert "sizes 200 run without a graph: too few steps to pay for a capture" in chosen.reasons
    assert plan(TRAFFIC, limit=256, warmups=2, padding=True) == chosen  # deterministic


def test_a_size_captured_already_costs_nothing_more_and_released_when_its_traffic_goes():
    assert 200 in plan(TRAFFIC, limit=256, warmups=2, padding=True, captured=frozenset({200})).sizes
    later = plan({3: 100, 5: 80}, limit=256, warmups=2, padding=True, captured=frozenset({5, 48}))
    assert later.sizes == (3, 5)
    assert "release 48: its traffic has gone" in later.reasons


def test_without_padding_each_size_pays_for_itself():
    weights = {3: 100, 7: 2 * 3 * (7 + STEP_OVERHEAD_ROWS) / STEP_OVERHEAD_ROWS, 9: 1}
    assert plan(weights, limit=256, warmups=2, padding=False).sizes == (3, 7)


def test_limit_and_budget_cap_the_largest_size():
    over = plan({3: 100, 300: 50}, limit=256, warmups=2, padding=True)
    assert over.sizes == (3,) and "sizes 300 run without a graph: above max_num_seqs=256" in over.reasons
    within = plan(TRAFFIC, limit=256, warmups=2, padding=True, fits=lambda size: size <= 8)
    assert within.sizes == (3, 5, 6)
    assert "sizes 12, 200 run without a graph: their pool would not fit graph_memory_budget" in within.reasons


def test_traffic_decays_and_forgets_a_size_nobody_asks_for():
    traffic = Traffic()
    traffic.observe(4)
    assert traffic.fold() == {4: 1.0}
    traffic.fold()
    traffic.fold()
    assert traffic.fold() == {}
    assert traffic.seen == {4: 1}


def test_a_recurring_burst_is_kept_longer_each_time_it_returns():
    """A burst at 24 rows every 20 plans: forgotten after 3 plans, then kept 6, 12,
    24 plans on its returns, so it is captured 4 times over 40 bursts, not 40."""
    interval, traffic, sizes, captures = 8, Traffic(), (), 0
    for period in range(40):
        for calls, batch in enumerate([24] * 8 + [3] * (20 * interval - 8), 1):
            traffic.observe(batch)
            if calls % interval == 0:
                new = plan(traffic.fold(), limit=32, warmups=1, padding=True, captured=frozenset(sizes)).sizes
                captures += 24 in new and 24 not in sizes
                sizes = new
    assert captures == 4 and traffic.returns[24] == 3
    assert 24 in sizes  # still kept: its hold (24 plans) outlasts the period


def skewed_trace(steps, seed=0):
    """Most steps at 9, 10, 17 or 18; one step in ten a burst at a random size in 41..60."""
    rng = random.Random(seed)
    return [rng.randint(41, 60) if rng.random() < 0.1 else rng.choice([9, 10, 17, 18]) for _ in range(steps)]


def test_a_recurring_range_is_covered_when_its_steps_pay_for_the_capture():
    traffic, sizes, reasons = Traffic(), (), []
    for calls, batch in enumerate(skewed_trace(1000), 1):
        traffic.observe(batch)
        if calls % 64 == 0:
            chosen = plan(traffic.fold(), limit=64, warmups=2, padding=True, captured=frozenset(sizes),
                          history=traffic.history)
            sizes, reasons = chosen.sizes, reasons + list(chosen.reasons)
    assert sizes[:2] == (10, 18) and max(sizes) >= 58
    assert any("it covers a recurring range" in reason for reason in reasons)
    # The same steps once, in one window: no range recurs, no size pays on its own.
    assert plan(traffic.weights, limit=64, warmups=2, padding=True).sizes == (10, 18)
    # A range whose steps cannot pay: one step per window, each at another size in 41..184.
    spread = [{9: 63, 41 + 13 * i: 1} for i in range(RANGE_WINDOWS)]
    assert plan({9: 100}, limit=256, warmups=2, padding=True, history=spread).sizes == (9,)


def test_auto_replays_a_trace_with_recurring_bursts():
    torch.manual_seed(0)
    model = MLP().eval()
    opt = graphopt.optimize(model, auto(cache_dir=None, capture_replan_interval=64, max_num_seqs=64,
                                        cudagraph_num_of_warmups=2))
    feed(opt, model, skewed_trace(2000))
    report = opt.report()
    assert report.steps == 2000 and report.steps_replayed >= 0.95 * report.steps, report.plans[0].reasons
    assert max(report.plans[0].sizes) >= 58


@pytest.mark.parametrize("bad, error", [("all", TypeError), (0, ValueError), (1.5, TypeError)])
def test_config_keys_are_validated(bad, error):
    with pytest.raises(error, match="capture_replan_interval|cudagraph_capture_sizes"):
        if isinstance(bad, str):
            graphopt.GraphOptimizationConfig(graph_opt_level=1, cudagraph_capture_sizes=bad)
        else:
            graphopt.GraphOptimizationConfig(graph_opt_level=1, capture_replan_interval=bad)
    with pytest.raises(ValueError, match="graph_memory_budget must be an int number of bytes >= 0"):
        graphopt.GraphOptimizationConfig(graph_opt_level=1, graph_memory_budget=-1)
    with pytest.raises(TypeError, match="graph_memory_budget"):
        graphopt.GraphOptimizationConfig(graph_opt_level=1, graph_memory_budget=1.0)
    config = graphopt.GraphOptimizationConfig.from_json(
        '{"cudagraph_capture_sizes": "auto", "graph_memory_budget": 1024, "capture_replan_interval": 4}')
    assert config.auto_capture_sizes and config.largest_capture_size() == config.max_num_seqs
    assert graphopt.GraphOptimizationConfig.from_json(config.to_json()) == config


def replica(batches, interval, limit=32, warmups=1):
    """The plans a runner makes of these calls, made by hand: every `interval`
    calls, every quarter of that while nothing is planned."""
    traffic, sizes = Traffic(), ()
    for calls, batch in enumerate(batches, 1):
        traffic.observe(batch)
        if calls % (interval if sizes else max(interval // 4, 1)) == 0:
            captured = frozenset(sizes)
            sizes = plan(traffic.fold(captured), limit=limit, warmups=warmups, padding=True, captured=captured).sizes
    return list(sizes)


def test_auto_captures_the_planned_sizes_and_releases_a_size_whose_traffic_went():
    torch.manual_seed(0)
    model = MLP().eval()
    opt = graphopt.optimize(model, auto(cache_dir=None, capture_replan_interval=16))
    busy = [3, 3, 3, 3, 5, 5, 5, 6] * 2
    feed(opt, model, busy * 3)
    report = opt.report()
    assert report.plans[0].sizes == replica(busy * 3, 16) == [3, 6]
    feed(opt, model, busy)  # captured on first use (a warm-up, then the capture), then replayed
    assert {c.size for c in report.captures} == {3, 6}
    replayed, padded = report.steps_replayed, report.padded_rows
    feed(opt, model, busy)
    assert report.steps == 80 and report.steps_replayed - replayed == 16
    assert report.padded_rows - padded == 6 * (6 - 5)
    arena = report.pool_bytes
    moved = [2] * 16 * (6 + HOLD_CAPTURED)  # the traffic moves: 6, then 3 fade; 2 pads to 3 until 3 goes
    feed(opt, model, moved)
    assert report.plans[0].sizes == replica(busy * 5 + moved, 16) == [2]
    assert report.plans[0].released == 2
    assert "release 3: its traffic has gone" in report.plans[0].reasons
    feed(opt, model, [2] * 4)
    assert sorted(c.size for c in report.captures) == [2, 3, 6] and report.captures[-1].size == 2
    assert report.pool_bytes < arena  # 6's and 3's graphs gave their arena back
    assert f"batch sizes seen: 2: {len(moved) + 4}, 3: 40, 5: 30, 6: 10" in str(report)


def test_the_histogram_is_kept_in_the_compile_cache_and_capture_all_captures_its_sizes(tmp_path):
    torch.manual_seed(0)
    model = MLP().eval()
    first = graphopt.optimize(model, auto(cache_dir=str(tmp_path)))
    window = [2, 2, 2, 2, 2, 2, 7, 7]
    feed(first, model, window * 6)
    planned = first.report().plans[0].sizes
    assert planned == replica(window * 6, 8) == [2, 7]
    torch._dynamo.reset()
    again = graphopt.optimize(model, auto(cache_dir=str(tmp_path)))
    with torch.no_grad():
        again.capture_all(torch.randn(2, 16))
    report = again.report()
    assert sorted(c.size for c in report.captures) == planned
    assert report.steps == 0  # capture_all()'s calls are not traffic
    feed(again, model, [2, 7])
    assert report.steps_replayed == 2


def test_a_budget_refuses_a_capture_past_it_and_the_pool_never_grows_past_it():
    torch.manual_seed(0)
    model = MLP().eval()
    sizes = [2, 8, 32]
    roomy = graphopt.optimize(model, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, cudagraph_capture_sizes=sizes, cache_dir=None,
                                                                      cudagraph_num_of_warmups=1))
    feed(roomy, model, [2, 2, 2, 32, 32, 32])
    small_pool = roomy.report().captures[0].nbytes
    budget = roomy.report().pool_bytes // 2
    assert small_pool <= budget
    torch._dynamo.reset()
    tight = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=1,
        cudagraph_capture_sizes=sizes, cache_dir=None, cudagraph_num_of_warmups=1, graph_memory_budget=budget))
    feed(tight, model, [2, 2, 2, 32, 32, 32, 32, 2])  # outputs stay eager's throughout
    report = tight.report()
    assert [c.size for c in report.captures] == [2]
    assert report.pool_bytes <= budget
    refusal, = report.budget_refusals
    assert refusal.size == 32 and refusal.needed > budget and refusal.available == budget
    assert report.fallback_counts[FallbackKind.CAPTURE_REFUSED] == 1


def test_auto_plans_within_the_budget():
    torch.manual_seed(0)
    model = MLP().eval()
    opt = graphopt.optimize(model, auto(cache_dir=None, graph_memory_budget=1))  # no room for any arena
    feed(opt, model, [4] * 40)
    report = opt.report()
    assert report.pool_bytes <= 1 and report.captures == []
    assert report.plans[0].sizes == []  # the refused size, and every larger one, left out
    assert any("would not fit graph_memory_budget" in reason for reason in report.plans[0].reasons)


@pytest.mark.cuda
def test_cuda_pools_are_measured_and_kept_within_the_budget():
    torch.manual_seed(0)
    model = MLP().eval().cuda()
    roomy = graphopt.optimize(model, auto(cache_dir=None))
    feed(roomy, model, [3, 5, 6] * 8 + [24] * 16, device="cuda")
    assert roomy.report().pool_bytes > 0
    budget = roomy.report().pool_bytes // 2
    torch._dynamo.reset()
    tight = graphopt.optimize(model, auto(cache_dir=None, graph_memory_budget=budget))
    before = torch.cuda.memory_stats()["reserved_bytes.all.current"]
    feed(tight, model, [3, 5, 6] * 8 + [24] * 16, device="cuda")
    assert tight.report().pool_bytes <= budget
    assert torch.cuda.memory_stats()["reserved_bytes.all.current"] - before <= budget + 2 * 2**20  # + buffers
