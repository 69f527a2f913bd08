"""graph_opt_level="auto": each graph's level chosen by timing both on its first call."""

import pytest
import torch
from decoder_spellings import SPELLINGS, decode_inputs

import graphopt
from graphopt import FallbackKind
from graphopt._compat import background
from graphopt.backend import candidates, tiers
from graphopt.config import tolerance
from graphopt.passes import lowered_error
from graphopt.report import Report


class FakeClock:
    """Time that passes only when a fake runtime says it ran."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_runtime(clock: FakeClock, seconds: float, state: torch.Tensor, result=None, error=None):
    """A runtime that takes `seconds` of fake time, adds 1 to `state` as a KV-cache write
    would, and returns twice its input (or `result`, or raises `error`)."""

    def run(x, state_arg):
        clock.now += seconds
        state_arg.add_(1)
        if error is not None:
            raise error
        return (x * 2 if result is None else result,)

    return run


class FakePending:
    """A level 2 compiling in the background: ready when the test says, failed with `error`."""

    def __init__(self, error=None):
        self.done, self.failure = False, error

    def ready(self):
        return self.done

    def why(self):
        return None if self.failure is None else f"{type(self.failure).__name__}: {self.failure}".splitlines()[0]


def choice_of(costs: dict[int, float], pending=None):
    """A LevelChoice between fake runtimes of the given per-call costs; (choice, state,
    report, what `chosen` received)."""
    clock, state, report, received = FakeClock(), torch.zeros(3), Report("auto"), []
    runtimes = {level: fake_runtime(clock, cost, state) for level, cost in costs.items()}

    def eager(x, state_arg):
        state_arg.add_(1)
        return (x * 2,)

    record = {"graph": 0}
    choice = tiers.LevelChoice(runtimes, eager, [1], record, report, received.append, clock=clock, pending=pending)
    return choice, state, report, received


@pytest.mark.parametrize("costs, level", [
    ({1: 3e-3, 2: 5e-3}, 1),
    ({1: 5e-3, 2: 3e-3}, 2),
    ({1: 1.00e-3, 2: 0.99e-3}, 1),   # within MARGIN: a tie goes to level 1
    ({1: 1.00e-3, 2: 0.90e-3}, 2),
])
def test_the_faster_level_serves_by_the_clock(costs, level):
    choice, state, report, received = choice_of(costs)
    x = torch.arange(3.0)
    out = choice(x, state)
    assert torch.equal(out[0], x * 2)
    # Every timed run was undone: the caller sees one call's write, as eager's.
    assert torch.equal(state, torch.ones(3))
    assert len(received) == 1 and received[0]["level"] == level
    assert received[0]["seconds"] == {"1": pytest.approx(costs[1]), "2": pytest.approx(costs[2])}
    other = 3 - level
    assert received[0]["reason"].startswith(f"{costs[other] / costs[level]:.2f}x level {other}")
    # Later calls run the chosen level only, once each.
    choice(x, state)
    assert torch.equal(state, torch.full((3,), 2.0))
    assert choice.run is not choice._first


@pytest.mark.parametrize("costs, rounds", [({"fast": 1e-3, "slow": 3e-3}, candidates.DECIDED_AFTER),
                                           ({"fast": 1e-3, "close": 1.2e-3}, tiers.ROUNDS)])
def test_a_race_far_apart_is_decided_in_fewer_rounds(costs, rounds):
    """Candidates 3x apart stop after DECIDED_AFTER rounds; 1.2x apart run every round.
    Each call of a round (two at least) counts, after one warm-up call."""
    clock, calls = FakeClock(), dict.fromkeys(costs, 0)

    def timed(name):
        def run():
            calls[name] += 1
            clock.now += costs[name]
        return run

    seconds = candidates.median_seconds({name: timed(name) for name in costs}, (), tiers.ROUNDS, 0.0, clock=clock)
    assert calls == dict.fromkeys(costs, 1 + 2 * rounds)
    assert seconds == {name: pytest.approx(cost) for name, cost in costs.items()}


def test_the_race_calls_each_candidate_while_its_previous_result_is_held():
    """A caller that keeps its results (PyTorch's harness keeps each call's) makes a level
    whose outputs live in its graph pool copy the held one out at every call: Electra's
    62 MB of logits turned level 1 from 1.08x Inductor into 0.91x. The race times that."""
    import weakref

    clock, previous, held_at_call = FakeClock(), [], []

    def run():
        held_at_call.append(bool(previous) and previous[-1]() is not None)
        clock.now += 1e-3
        out = torch.zeros(2)
        previous.append(weakref.ref(out))
        return out

    candidates.median_seconds({"pooled": run}, (), 3, 0.0, clock=clock)
    assert held_at_call[0] is False and all(held_at_call[1:]), held_at_call


def test_pick_is_deterministic_given_the_timings():
    assert tiers.pick({1: 1.0, 2: 0.98}) == 1
    assert tiers.pick({1: 1.0, 2: 0.96}) == 2
    assert tiers.pick({2: 0.5}) == 2


def test_a_level_that_fails_leaves_the_other_serving_and_says_why():
    clock = FakeClock()
    broken = fake_runtime(clock, 1e-3, torch.zeros(3), error=RuntimeError("boom"))
    choice, state, report, received = choice_of({1: 2e-3, 2: 1e-3})
    choice.runtimes[2] = broken
    out = choice(torch.ones(3), state)
    assert torch.equal(out[0], torch.full((3,), 2.0))
    assert received[0]["level"] == 1
    assert received[0]["reason"] == ("level 1 is the only level whose outputs equal eager's (level 2 failed on its "
                                     "first call (RuntimeError: boom))")
    assert report.fallback_counts == {FallbackKind.LEVEL: 1}


def test_a_level_whose_outputs_differ_from_eager_is_not_a_candidate_and_the_reason_gives_the_tolerance():
    clock = FakeClock()
    # eager's output is 2.0 everywhere; 1e-3 off is past float32's 1e-4 + 1e-4 x 2.0
    wrong = fake_runtime(clock, 1e-4, torch.zeros(3), result=torch.tensor([2.0, 2.001, 2.0]))
    choice, state, report, received = choice_of({1: 2e-3, 2: 1e-3})
    choice.runtimes[2] = wrong  # the faster one is wrong: never chosen
    choice(torch.ones(3), state)
    assert received[0]["level"] == 1
    assert received[0]["reason"] == (
        "level 1 is the only level whose outputs equal eager's (level 2 gave output 0 that differs from eager's by "
        "up to 0.001 (at |eager| = 2), beyond float32's |diff| <= 0.0001 + 0.0001 x |eager| (config.TOLERANCES))")
    assert report.fallback_counts == {FallbackKind.LEVEL: 1}


def test_how_unequal_names_shape_and_dtype_before_values():
    assert candidates.how_unequal(torch.zeros(2, 3), torch.zeros(3, 2)) == \
        "is torch.float32 (2, 3) where eager's is torch.float32 (3, 2)"
    assert candidates.how_unequal(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3)) == \
        "is torch.bfloat16 (3,) where eager's is torch.float32 (3,)"


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x))).softmax(-1)


def test_auto_is_the_default_chooses_a_level_and_a_later_process_compiles_only_that_one(tmp_path):
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(4, 32)
    config = graphopt.GraphOptimizationConfig(cache_dir=str(tmp_path), max_num_seqs=4)
    assert (config.graph_opt_level, config.level_choice) == ("auto", "first_call")
    with torch.no_grad():
        expected = model(x)
        first = graphopt.optimize(model, config)
        atol, rtol = tolerance(torch.float32)
        torch.testing.assert_close(first(x), expected, atol=atol, rtol=rtol)  # both levels, and the choice
        report = first.report()
        assert len(report.graphs) == 2  # one graph, compiled at both levels
        [choice] = report.level_choices
        assert choice["level"] in (1, 2) and set(choice["seconds"]) == {"1", "2"}
        assert f"level of graph 0: {choice['level']} (" in str(report)
        # The time to the choice: from the graph's compile (both levels) to the race's end.
        compiled = sum(g.compile_seconds for g in report.graphs)
        assert compiled - 0.1 <= choice["chosen_after_s"] < compiled + 60
        assert f"chosen {choice['chosen_after_s']:g} s after its compile began)" in str(report)
        torch.testing.assert_close(first(x), expected, atol=atol, rtol=rtol)

        torch._dynamo.reset()
        later = graphopt.optimize(model, config)
        torch.testing.assert_close(later(x.clone()), expected, atol=atol, rtol=rtol)
    [again] = later.report().level_choices
    assert again["cached"] and again["level"] == choice["level"]
    assert len(later.report().graphs) == 1
    assert "chosen in an earlier process" in str(later.report())
    # The first process stored no trace (its level was not chosen yet), and says so in a
    # note, not a fallback; the later one compiled the chosen level, so its trace names
    # it, and a third process runs that trace.
    assert (first.report().traces_stored, later.report().traces_stored) == (0, 1)
    assert not first.report().fallbacks and any("trace is stored by" in n for n in first.report().notes)
    torch._dynamo.reset()
    third = graphopt.optimize(model, config)
    with torch.no_grad():  # a new tensor, as a new process has: Dynamo's marks on x would fail the guards
        torch.testing.assert_close(third(x.clone()), expected, atol=atol, rtol=rtol)
    assert (third.report().traces_used, third.report().traces_stored) == (1, 0)


def test_level_2_starts_at_a_graphs_second_call_so_the_first_pays_level_1_alone():
    """With level_choice="background", on the CPU the first call compiles level 1 only (on
    the ~1B decoder with frozen weights, level 2's tracing and passes had made it 45 s
    instead of 16 s); the second starts level 2, whose code the child generates while
    level 1 serves."""
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(4, 32)
    config = graphopt.GraphOptimizationConfig(graph_opt_level="auto", level_choice="background", cache_dir=None,
                                              use_cudagraph=False)
    atol, rtol = tolerance(torch.float32)
    with torch.no_grad():
        expected = model(x)
        optimized = graphopt.optimize(model, config)
        torch.testing.assert_close(optimized(x), expected, atol=atol, rtol=rtol)
        assert [g.level for g in optimized.report().graphs] == [1]
        assert "level of graph 0: not chosen yet: level 1 serves" in str(optimized.report())
        torch.testing.assert_close(optimized(x), expected, atol=atol, rtol=rtol)  # level 1; level 2 started
        assert [g.level for g in optimized.report().graphs] == [1, 2]
        assert tiers.wait_for_background(timeout=600)
        torch.testing.assert_close(optimized(x), expected, atol=atol, rtol=rtol)  # the choice
    [choice] = optimized.report().level_choices
    assert set(choice["seconds"]) == {"1", "2"} and not optimized.report().fallbacks


def test_with_lowered_precision_level_2_is_held_to_precision_tolerance_against_level_1():
    """compute_dtype and weight_quantization move outputs by more than float32's
    tolerances, by design: each level's error was measured and bounded when it compiled,
    so the choice holds level 2 to precision_tolerance against level 1's outputs (the
    same lowering) instead."""
    clock, state = FakeClock(), torch.zeros(3)
    x = torch.tensor([1.0, 2.0, 4.0])
    near = fake_runtime(clock, 1e-3, state, result=x * 2 * 1.01)   # 1% off: bfloat16's error
    far = fake_runtime(clock, 1e-4, state, result=x * 2 * 1.2)     # 20% off
    for bound, chosen in [(None, None), (lowered_error.Bound(0.05, set(), 32), 1)]:
        report, received = Report("auto"), []
        runtimes = {1: near, 2: far}
        choice = tiers.LevelChoice(runtimes, lambda x, s: (x * 2,), [1], {"graph": 0}, report, received.append,
                                   clock=clock, bound=bound)
        choice(x, state)
        if chosen is None:  # float32's tolerances: neither is eager's, so eager serves
            assert received[0]["level"] == 0 and report.fallback_counts == {FallbackKind.LEVEL: 2}
        else:
            assert received[0]["level"] == 1 and report.fallback_counts == {FallbackKind.LEVEL: 1}
            assert "has an error of 0.188 of an output's largest magnitude against level 1's, over " \
                   "precision_tolerance=0.05; it is not a candidate" in next(iter(report.fallbacks))


def test_a_lowering_past_the_bound_on_the_choices_inputs_keeps_its_levels_and_their_race():
    """Gemma-3's int4 prefill graph: held to 0.05 nats at compile, 0.066 on the choice's
    inputs at both levels. Its levels still race (level 2, faster here, serves) where
    judging them against eager at the bound left the graph to eager float32 at a fifth of
    the speed. Level 2 is still refused where its own code moves the results from level
    1's, and level 1 where it is past CHOICE_SLACK times the bound (wrong code, not the
    lowering's error: Gemma-3's int8 decode graph was once 22 nats away)."""
    clock, state = FakeClock(), torch.zeros(3)
    x = torch.tensor([1.0, 2.0, 4.0])
    lowered, wrong = x * 2 * 1.1, x * 2 * 3  # 10% off eager: twice the bound, within CHOICE_SLACK times it
    for level_1_result, level_2_result, chosen, refused in [(lowered, lowered, 2, ""), (lowered, lowered * 1.5, 1, "2"),
                                                             (wrong, lowered, 2, "1"), (wrong, wrong, 0, "12")]:
        report, received = Report("auto"), []
        runtimes = {1: fake_runtime(clock, 1e-3, state, result=level_1_result),
                    2: fake_runtime(clock, 1e-4, state, result=level_2_result)}
        choice = tiers.LevelChoice(runtimes, lambda x, s: (x * 2,), [1], {"graph": 0}, report, received.append,
                                   clock=clock, bound=lowered_error.Bound(0.05, set(), 32))
        out = choice(x, state)[0]
        torch.testing.assert_close(out, x * 2 if chosen == 0 else runtimes[chosen](x, torch.zeros(3))[0])
        assert received[0]["level"] == chosen
        assert sorted(why.split("level ")[1][0] for why in report.fallbacks) == list(refused), report.fallbacks
        if "1" in refused:
            assert "against eager's, over 4x precision_tolerance=0.2" in next(iter(report.fallbacks))


def test_the_precision_bound_follows_the_config_and_knows_the_graphs_vocabulary():
    config, graph = graphopt.GraphOptimizationConfig, torch.fx.Graph()
    ids, table = graph.placeholder("ids"), graph.placeholder("table")
    table.meta["example_value"] = torch.empty(10, 4)  # as Dynamo's graph carries it
    graph.output(graph.call_function(torch.nn.functional.embedding, (ids, table)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert tiers.precision_bound(config(), gm) is None
    bounds = [tiers.precision_bound(config(compute_dtype="bfloat16"), gm),
              tiers.precision_bound(config(freeze_parameters=True, weight_quantization="int8",
                                           precision_tolerance=0.1), gm),
              tiers.precision_bound(config(compute_dtype="bfloat16", precision_tolerance=None), gm)]
    assert [b.tolerance for b in bounds] == [0.05, 0.1, float("inf")]
    assert bounds[0].vocab == {10}


def test_a_causal_lms_level_is_held_to_the_kl_of_its_logits_not_their_largest_error():
    """Logits over the graph's vocabulary are judged by how far their next-token
    distribution moved: a large error on a logit that keeps its token's probability
    passes; a distribution moved past the bound does not."""
    bound = lowered_error.Bound(0.05, {3}, 32)
    eager = torch.tensor([[[8.0, 0.0, -8.0]]])
    assert bound.past([eager], [torch.tensor([[[8.0, 0.0, -4.0]]])]) is None  # 0.5 of the largest logit
    why = bound.past([eager], [torch.tensor([[[1.0, 1.0, -8.0]]])])
    assert why is not None and "nats (mean KL)" in why
    assert lowered_error.Bound(0.05, set(), 32).past([eager], [torch.tensor([[[8.0, 0.0, -4.0]]])]) is not None


def test_auto_with_int8_weights_chooses_between_the_quantized_levels():
    """Both levels quantize, both are off eager's float32 by int8's error, and both stay
    candidates: the choice is a level, not eager."""
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(4, 32)
    config = graphopt.GraphOptimizationConfig(freeze_parameters=True, weight_quantization="int8", cache_dir=None,
                                              use_cudagraph=False)
    opt = graphopt.optimize(model, config)
    with torch.no_grad():
        expected, out = model(x), opt(x)  # both levels, chosen between
    [choice] = opt.report().level_choices
    assert choice["level"] in (1, 2) and set(choice["seconds"]) == {"1", "2"}, choice
    assert not opt.report().fallbacks, opt.report().fallbacks
    assert [g.precision["dtype"] for g in opt.report().graphs] == ["int8 weights"] * 2
    error = (out - expected).abs().max() / expected.abs().max()
    assert 0 < error < 0.05  # quantized, within the default precision_tolerance


def test_auto_is_a_level_the_config_accepts():
    assert graphopt.GraphOptimizationConfig(graph_opt_level="auto").graph_opt_level == "auto"
    with pytest.raises(TypeError, match=r"graph_opt_level must be an int in \{0, 1, 2\} or 'auto', got 'fast' \(str\)"):
        graphopt.GraphOptimizationConfig(graph_opt_level="fast")
    with pytest.raises(ValueError, match=r"level_choice must be one of 'first_call', 'background', got 'later'"):
        graphopt.GraphOptimizationConfig(level_choice="later")


def test_a_level_2_that_fails_to_compile_leaves_level_1_serving_and_says_why():
    report, record, level1 = Report("auto"), {"graph": 3}, (lambda x: (x,))

    def compile_at(level):
        if level == 2:
            raise RuntimeError("no C++ compiler\nand more")
        return level1

    runtime = tiers.choose(compile_at, level1, [], record, report, chosen=pytest.fail)
    assert runtime is level1
    assert record == {"graph": 3, "level": 1, "seconds": {},
                      "reason": "level 2 failed to compile (RuntimeError: no C++ compiler)"}
    assert report.fallback_counts == {FallbackKind.LEVEL: 1}


def test_a_graph_that_fails_when_timed_keeps_level_1_and_says_why():
    choice, state, report, received = choice_of({1: 2e-3, 2: 1e-3})
    runs = []

    def fails_when_repeated(x, state_arg):
        runs.append(1)
        if len(runs) > 1:  # the check's run passes; a repeat, as a counter past its end would, fails
            raise IndexError("index 9 is out of bounds")
        return (x * 2,)

    choice.runtimes[2] = fails_when_repeated
    out = choice(torch.ones(3), state)
    assert torch.equal(out[0], torch.full((3,), 2.0)) and torch.equal(state, torch.ones(3))
    assert received[0]["level"] == 1
    assert received[0]["reason"] == "timing its levels failed (IndexError: index 9 is out of bounds)"
    assert report.fallback_counts == {FallbackKind.LEVEL: 1}


def test_level_1_serves_while_level_2_compiles_in_the_background_then_the_faster_serves():
    pending = FakePending()
    choice, state, report, received = choice_of({1: 5e-3, 2: 3e-3}, pending)
    calls = {level: 0 for level in (1, 2)}
    for level in (1, 2):
        runtime = choice.runtimes[level]
        choice.runtimes[level] = lambda *args, level=level, runtime=runtime: (calls.update({level: calls[level] + 1}),
                                                                              runtime(*args))[1]
    x = torch.arange(3.0)
    for _ in range(3):
        assert torch.equal(choice(x, state)[0], x * 2)
    assert calls == {1: 3, 2: 0} and received == [] and torch.equal(state, torch.full((3,), 3.0))
    pending.done = True
    assert torch.equal(choice(x, state)[0], x * 2)
    assert received[0]["level"] == 2 and set(received[0]["seconds"]) == {"1", "2"}
    assert torch.equal(state, torch.full((3,), 4.0))  # the choosing call's timed runs were undone: one call's effect
    before = calls[2]
    choice(x, state)
    assert calls[2] == before + 1 and list(report.fallbacks) == []


def test_a_background_compile_that_fails_leaves_level_1_serving_and_says_why():
    pending = FakePending(RuntimeError("C++ compile error\ncc1plus: fatal"))
    choice, state, report, received = choice_of({1: 5e-3, 2: 3e-3}, pending)
    x = torch.arange(3.0)
    choice(x, state)
    pending.done = True
    assert torch.equal(choice(x, state)[0], x * 2) and torch.equal(state, torch.full((3,), 2.0))
    assert received == []  # not stored: a later process compiles level 2 again
    assert choice.record == {"graph": 0, "level": 1, "seconds": {},
                             "reason": "level 2 failed to compile in the background (RuntimeError: C++ compile error)"}
    assert list(report.fallbacks) == ["graph_opt_level='auto': level 2 failed to compile in the background "
                                      "(RuntimeError: C++ compile error); level 1 serves graph 0"]


class Attention(torch.nn.Module):
    """softmax(q·kᵀ·s)·v written out, which graphopt's level 2 fuses into SDPA."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 8).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-1, -2) * 8 ** -0.5, dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(x.shape))


def test_auto_compiles_level_2_in_a_child_process_with_graphopts_passes_and_swaps_it_in():
    torch.manual_seed(0)
    model, x = Attention().eval(), torch.randn(2, 16, 32)
    config = graphopt.GraphOptimizationConfig(graph_opt_level="auto", level_choice="background", cache_dir=None)
    atol, rtol = tolerance(torch.float32)
    with torch.no_grad():
        expected = model(x)
        optimized = graphopt.optimize(model, config)
        torch.testing.assert_close(optimized(x), expected, atol=atol, rtol=rtol)
        assert graphopt.wait_for_background(timeout=600)
        for _ in range(3):
            torch.testing.assert_close(optimized(x), expected, atol=atol, rtol=rtol)
    report = optimized.report()
    [choice] = report.level_choices
    assert choice["level"] in (1, 2) and set(choice["seconds"]) == {"1", "2"}
    level2 = report.graphs[1]  # the pass ran in this process, on the graph the child compiled
    assert level2.fused_ops.get("scaled_dot_product_attention") == 1, str(report)
    assert not report.fallbacks, report.fallbacks  # the child compiled it: nothing in the foreground


def test_auto_compiles_a_decoders_level_2_in_a_child_process():
    """A decoder's graph after graphopt's pass holds what Inductor's pickler refuses by
    default: `prims.convert_element_type` (a decomposed `.float()`), graphopt's operators,
    and fake values that are views (from pattern replacements)."""
    model = SPELLINGS["sdpa"]().eval()
    config = graphopt.GraphOptimizationConfig(graph_opt_level="auto", level_choice="background", cache_dir=None)
    atol, rtol = tolerance(torch.float32)
    with torch.no_grad():
        optimized = graphopt.optimize(model, config)
        for step in range(4):
            inputs = decode_inputs(3, 5 + step)
            torch.testing.assert_close(optimized(*inputs), model(*inputs), atol=atol, rtol=rtol)
            if step == 0:
                assert graphopt.wait_for_background(timeout=600)
    report = optimized.report()
    assert [set(c["seconds"]) for c in report.level_choices] == [{"1", "2"}], report.level_choices
    assert not report.fallbacks, report.fallbacks


def test_a_graph_a_child_cannot_take_is_compiled_at_once_and_says_why(monkeypatch):
    from torch._inductor import config as inductor_config

    def unpicklable(gm, *args):
        inductor_config.post_grad_custom_post_pass(gm.graph)  # as the real one does before pickling
        raise background.NotSerializable("Inductor could not pickle the graph")

    monkeypatch.setattr(background, "_start", unpicklable)
    torch.manual_seed(0)
    model, x = Attention().eval(), torch.randn(2, 16, 32)
    atol, rtol = tolerance(torch.float32)
    with torch.no_grad():
        expected = model(x)
        optimized = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level="auto", cache_dir=None,
                                                                              level_choice="background"))
        for _ in range(2):
            torch.testing.assert_close(optimized(x), expected, atol=atol, rtol=rtol)
    report = optimized.report()
    [choice] = report.level_choices  # made at the first call: nothing to wait for
    assert set(choice["seconds"]) == {"1", "2"}
    assert report.graphs[1].fused_ops.get("scaled_dot_product_attention") == 1, str(report)
    [why] = report.reasons(FallbackKind.IN_FOREGROUND)
    assert "not in a child process (Inductor could not pickle the graph)" in why


def test_a_child_compile_that_fails_is_tried_in_this_process_and_both_failures_are_said_end_to_end():
    model, x = MLP().eval(), torch.randn(4, 32)
    # A compiler that cannot run: level 2 fails in the child, then in this process.
    config = graphopt.GraphOptimizationConfig(graph_opt_level="auto", level_choice="background", cache_dir=None,
                                              inductor_compile_config={"cpp.cxx": "/nonexistent/c++"})
    atol, rtol = tolerance(torch.float32)
    with torch.no_grad():
        expected = model(x)
        optimized = graphopt.optimize(model, config)
        torch.testing.assert_close(optimized(x), expected, atol=atol, rtol=rtol)
        assert tiers.wait_for_background(timeout=600)
        torch.testing.assert_close(optimized(x), expected, atol=atol, rtol=rtol)
    [choice] = optimized.report().level_choices
    assert choice["level"] == 1 and choice["reason"].startswith("level 2 failed to compile in the background (")
    child, here = choice["reason"].split(", and in this process (")
    assert "No working C++ compiler" in child and "No working C++ compiler" in here, choice["reason"]
    assert list(optimized.report().fallbacks) == [
        f"graph_opt_level='auto': {choice['reason']}; level 1 serves graph 0"]


def test_a_child_compile_that_fails_hands_level_2_to_this_process(monkeypatch):
    """What compiles here must not be lost to the trip to the child (the harness's timm
    CNNs met a child-only `ValueError: Exponent must be non-negative.`): the call that
    finds the child failed compiles level 2 here, and the choice goes on."""
    from concurrent.futures import Future

    def child_fails(pickled, env):
        failed = Future()
        failed.set_exception(ValueError("Exponent must be non-negative."))
        return failed

    monkeypatch.setattr(background, "_submit", child_fails)
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(4, 32)
    config = graphopt.GraphOptimizationConfig(graph_opt_level="auto", level_choice="background", cache_dir=None,
                                              use_cudagraph=False)
    atol, rtol = tolerance(torch.float32)
    with torch.no_grad():
        expected = model(x)
        optimized = graphopt.optimize(model, config)
        for _ in range(2):
            torch.testing.assert_close(optimized(x), expected, atol=atol, rtol=rtol)
        assert tiers.wait_for_background(timeout=600)
        torch.testing.assert_close(optimized(x), expected, atol=atol, rtol=rtol)  # compiles here, then chooses
    report = optimized.report()
    [choice] = report.level_choices
    assert set(choice["seconds"]) == {"1", "2"}, choice
    assert [g.level for g in report.graphs] == [1, 2, 2]  # level 2 traced for the child, then again here
    [why] = report.reasons(FallbackKind.IN_FOREGROUND)
    assert why == ("graph_opt_level='auto': level 2 failed to compile in the background (ValueError: Exponent must "
                   "be non-negative.); level 2 of graph 0 was compiled in this process instead, during a call")


def test_a_failed_background_compile_that_also_fails_here_leaves_level_1_serving():
    pending = FakePending(RuntimeError("child-only error"))
    choice, state, report, received = choice_of({1: 5e-3, 2: 3e-3}, pending)
    tried = []

    def fails_here_too(args):
        tried.append(args)
        raise RuntimeError("fails here too\nmore")

    choice.in_process = fails_here_too
    x = torch.arange(3.0)
    pending.done = True
    assert torch.equal(choice(x, state)[0], x * 2) and len(tried) == 1
    assert choice.record["reason"] == ("level 2 failed to compile in the background (RuntimeError: child-only "
                                       "error), and in this process (RuntimeError: fails here too)")
    assert received == [] and report.fallback_counts == {FallbackKind.LEVEL: 1}


def test_inductors_pickling_warning_becomes_the_reason_and_prints_nothing(caplog):
    from torch._inductor.compile_fx import log

    try:
        raise AttributeError("Can't pickle local object 'f.<locals>.g'")
    except AttributeError:
        with background._pickling_errors() as errors:
            log.warning("Unable to pickle input graph or example inputs", exc_info=True)
            log.warning("another warning")
    assert errors == ["AttributeError: Can't pickle local object 'f.<locals>.g'"]
    assert [r.getMessage() for r in caplog.records if r.name == log.name] == ["another warning"]
