"""A held output never changes: the next replay overwrites the device graph's memory,
so an output of the last replay the caller still holds is first copied out
(report().held_copies counts it). On the CPU's host graphs; on CUDA too when present."""

import gc

import pytest
import torch
from test_runner import DEVICES, optimized, step_inputs, twin_decoders, warm_and_capture

import graphopt
from graphopt.config import tolerance
from graphopt.models import DecoderConfig

ATOL, RTOL = tolerance(torch.float32)


def varied_inputs(device, position):
    """A decode step of 2 sequences whose tokens differ from position to position
    (the same token at every position gives the same logits)."""
    ids, positions, slots = step_inputs(device, 2, position)
    generator = torch.Generator().manual_seed(position)
    ids = torch.randint(0, DecoderConfig.tiny().vocab_size, (2,), generator=generator).to(device)
    return ids, positions, slots


@pytest.mark.parametrize("device", DEVICES)
def test_an_output_held_across_replays_keeps_its_values(device):
    eager, model = twin_decoders(device)
    opt = optimized(model)
    with torch.inference_mode():
        inputs = step_inputs(device, 2)
        warm_and_capture(opt, *inputs)
        for _ in range(3):
            eager(*inputs)
        held, expected = [], []
        for position in range(3):  # each replay would overwrite the one before
            inputs = varied_inputs(device, position)
            held.append(opt(*inputs))
            expected.append(eager(*inputs))
    for ours, theirs in zip(held, expected):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)
    assert held[0].data_ptr() != held[1].data_ptr()
    assert opt.report().held_copies == 2 and opt.report().replays == 3


@pytest.mark.parametrize("device", DEVICES)
def test_a_second_replay_within_one_call_keeps_the_first_output(device):
    eager, model = twin_decoders(device)
    opt = optimized(model)

    def two_steps(step, position):
        first = step(*varied_inputs(device, position))
        return first, step(*varied_inputs(device, position + 1))

    with torch.inference_mode():
        warm_and_capture(opt, *step_inputs(device, 2))
        for _ in range(3):
            eager(*step_inputs(device, 2))
        ours, theirs = two_steps(opt, 0), two_steps(eager, 0)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)
    assert opt.report().replays == 2


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_let_go_are_not_copied(device):
    _, model = twin_decoders(device)
    opt = optimized(model)
    with torch.inference_mode():
        warm_and_capture(opt, *step_inputs(device, 2))
        for position in range(3):
            opt(*step_inputs(device, 2, position)).sum()  # read, then let go
            gc.collect()
    assert opt.report().held_copies == 0 and opt.report().replays == 3


def test_generate_called_again_keeps_the_earlier_results():
    """transformers' generate() called repeatedly on one model, until its prefill too
    is captured and replayed: each call's tokens, logits and returned cache are, after
    the last call, what eager's are."""
    pytest.importorskip("transformers")
    from test_hf_generate import generate, prompt, twins

    eager, model = twins("llama")
    model.forward = graphopt.optimize(model.forward, graphopt.GraphOptimizationConfig(
        graph_opt_level=1, max_num_seqs=4))

    def calls(m):  # two warm-ups, the capture, a replay (cudagraph_num_of_warmups=2)
        return [generate(m, prompt(1).roll(shift, 1), return_dict_in_generate=True, output_logits=True)
                for shift in range(4)]

    ours, theirs = calls(model), calls(eager)
    assert model.forward.report().replays > 0
    for a, b in zip(ours, theirs):
        assert torch.equal(a.sequences, b.sequences)
        torch.testing.assert_close(a.logits, b.logits, atol=ATOL, rtol=RTOL)
        for layer_a, layer_b in zip(a.past_key_values.layers, b.past_key_values.layers):
            torch.testing.assert_close(layer_a.keys, layer_b.keys, atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(layer_a.values, layer_b.values, atol=ATOL, rtol=RTOL)
