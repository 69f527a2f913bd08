import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from graphopt.config import tolerance
from graphopt.models import Decoder, DecoderConfig, generate

ATOL, RTOL = tolerance(torch.float32)


def make_model(**overrides) -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig.tiny(**overrides)).eval()


def caches(model: Decoder) -> list[torch.Tensor]:
    return [c for layer in model.layers for c in (layer.self_attn.k_cache, layer.self_attn.v_cache)]


def snapshot(model: Decoder) -> list[torch.Tensor]:
    return [c.clone() for c in caches(model)]


def restore(model: Decoder, saved: list[torch.Tensor]) -> None:
    for cache, value in zip(caches(model), saved):
        cache.copy_(value)


def prefill(model, ids, slots):
    b, t = ids.shape
    return model.prefill(ids, torch.arange(t).expand(b, t), slots)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_decode_step_matches_prefill_of_whole_sequence():
    model = make_model()
    ids = torch.randint(0, 512, (3, 10))
    slots = torch.tensor([4, 0, 9])
    whole = prefill(model, ids, slots)

    model.reset_cache()  # so the step has to write position 9 itself
    prefill(model, ids[:, :9], slots)
    step = model(ids[:, 9], torch.full((3,), 9), slots)
    close(step, whole[:, 9])


@torch.no_grad()
def test_padded_rows_on_scratch_slot_change_no_real_row():
    model = make_model()
    slots = torch.tensor([0, 1, 2])
    prefill(model, torch.randint(0, 512, (3, 6)), slots)
    ids, positions = torch.randint(0, 512, (3,)), torch.tensor([6, 3, 5])
    before = snapshot(model)

    alone = model(ids, positions, slots)
    after_alone = snapshot(model)
    restore(model, before)
    pad = torch.full((2,), model.scratch_slot)
    padded = model(torch.cat([ids, torch.tensor([7, 7])]), torch.cat([positions, torch.tensor([0, 40])]),
                   torch.cat([slots, pad]))

    close(padded[:3], alone)
    scratch = model.scratch_slot
    for cache, expected, untouched in zip(caches(model), after_alone, before):
        close(cache[:scratch], expected[:scratch])  # a matmul over more rows may round differently
        assert torch.equal(cache[3:scratch], untouched[3:scratch])
        assert not torch.equal(cache[scratch], untouched[scratch])  # the padding did write, there


@torch.no_grad()
def test_sequences_in_different_slots_decode_independently():
    model = make_model()
    short, long = torch.randint(0, 512, (1, 5)), torch.randint(0, 512, (1, 9))

    def decode(sequences, slots):  # prefill each sequence alone, then three batched greedy steps
        tokens = torch.cat([prefill(model, seq, slot[None])[:, -1].argmax(-1) for seq, slot in zip(sequences, slots)])
        positions = torch.tensor([seq.shape[1] for seq in sequences])
        logits = []
        for k in range(3):
            logits.append(model(tokens, positions + k, slots))
            tokens = logits[-1].argmax(-1)
        return torch.stack(logits, dim=1)

    batch = decode([short, long], torch.tensor([3, 7]))
    model.reset_cache()
    close(batch[0], decode([short], torch.tensor([3]))[0])
    model.reset_cache()
    close(batch[1], decode([long], torch.tensor([7]))[0])


def test_generate_is_greedy_and_deterministic():
    model = make_model()
    prompt = torch.randint(0, 512, (2, 7))
    tokens = generate(model, prompt, 6)
    assert tokens.shape == (2, 6) and tokens.dtype == torch.long

    # By hand, without the cache's history: re-prefill the whole sequence for every token.
    sequence = prompt
    with torch.no_grad():
        for _ in range(6):
            model.reset_cache()
            next_token = prefill(model, sequence, torch.arange(2))[:, -1].argmax(-1)
            sequence = torch.cat([sequence, next_token[:, None]], dim=1)
    assert torch.equal(tokens, sequence[:, 7:])
    assert torch.equal(generate(model, prompt, 6), tokens)
    assert torch.equal(generate(model, prompt, 6, slots=torch.tensor([11, 5])), tokens)


@torch.no_grad()
def test_generate_leaves_other_slots_alone():
    model = make_model()
    prefill(model, torch.randint(0, 512, (1, 4)), torch.tensor([2]))
    before = snapshot(model)
    generate(model, torch.randint(0, 512, (1, 3)), 4, slots=torch.tensor([0]))
    for cache, old in zip(caches(model), before):
        assert torch.equal(cache[1:], old[1:])


@pytest.mark.parametrize(
    "prompt, max_new_tokens, slots, message",
    [
        (torch.zeros(5, dtype=torch.long), 2, None, r"must be 2-D .*prompt_ids\[None\]"),
        (torch.zeros(1, 0, dtype=torch.long), 2, None, "is empty"),
        (torch.zeros(17, 3, dtype=torch.long), 2, None, "17 prompts exceed max_num_seqs=16 .*larger max_num_seqs"),
        (torch.zeros(1, 3, dtype=torch.long), 0, None, "max_new_tokens must be at least 1"),
        (torch.zeros(1, 100, dtype=torch.long), 29, None, "100 .* 29 exceeds max_seq_len=128.*larger max_seq_len"),
        (torch.zeros(2, 3, dtype=torch.long), 2, torch.tensor([0]), r"slots must have shape \(2,\)"),
        (torch.zeros(2, 3, dtype=torch.long), 2, torch.tensor([0, 16]), r"distinct cache rows in \[0, 16\).*scratch"),
        (torch.zeros(2, 3, dtype=torch.long), 2, torch.tensor([1, 1]), "distinct cache rows"),
    ],
)
def test_generate_rejects_bad_input(prompt, max_new_tokens, slots, message):
    with pytest.raises(ValueError, match=message):
        generate(make_model(), prompt, max_new_tokens, slots=slots)


@torch.no_grad()
def test_step_compiles_as_one_graph_for_every_batch_size():
    torch._dynamo.reset()
    model = make_model()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter, dynamic=True, fullgraph=True)
    prefill(model, torch.randint(0, 512, (5, 8)), torch.arange(5))

    for b in range(2, 6):
        ids, positions, slots = torch.randint(0, 512, (b,)), torch.arange(8, 8 + b), torch.arange(b)
        before = snapshot(model)
        expected = model(ids, positions, slots)
        expected_caches = snapshot(model)
        restore(model, before)
        close(compiled(ids, positions, slots), expected)
        for cache, want in zip(caches(model), expected_caches):
            close(cache, want)
    assert counter.frame_count == 1

    prompt = torch.randint(0, 512, (3, 4))
    assert torch.equal(generate(model, prompt, 5, step=compiled), generate(model, prompt, 5))


def test_parameter_counts():
    with torch.device("meta"):
        bench = Decoder(DecoderConfig.bench())
    assert all(c.is_meta for c in caches(bench))
    assert 90e6 <= sum(p.numel() for p in bench.parameters()) <= 110e6
    assert sum(p.numel() for p in make_model().parameters()) < 250_000


def test_cache_layout():
    model = make_model()
    config = model.config
    assert model.scratch_slot == config.max_num_seqs == 16
    for cache in caches(model):
        assert cache.shape == (config.max_num_seqs + 1, config.max_seq_len, config.num_kv_heads, config.head_dim)
    assert not any("cache" in name or "inv_freq" in name for name in model.state_dict())


@torch.no_grad()
def test_bfloat16_decode_step_is_finite():
    model = make_model(dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {c.dtype for c in caches(model)} == {torch.bfloat16}
    assert model.rotary_emb.inv_freq.dtype == torch.float32
    prefill(model, torch.randint(0, 512, (4, 5)), torch.arange(4))
    logits = model(torch.randint(0, 512, (4,)), torch.full((4,), 5), torch.arange(4))
    assert logits.shape == (4, 512) and logits.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"vocab_size": 0}, "vocab_size must be positive"),
        ({"num_layers": -1}, "num_layers must be positive"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps must be positive"),
        ({"num_heads": 5}, r"hidden_size \(64\) must be divisible by num_heads \(5\)"),
        ({"num_kv_heads": 3}, r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"),
        ({"hidden_size": 12, "num_heads": 4, "num_kv_heads": 1}, "must be even"),
        ({"dtype": torch.int32}, "dtype must be a floating-point dtype"),
    ],
)
def test_config_validation_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig.tiny(**overrides)
