"""`graphopt bench`'s ~1B decoder (decoder-1b), run on the tiny config (--quick): its
table's rows and columns, the bandwidth floor per weight format, torchao and llama.cpp
left out with the reason where they do not import, start-up's time to the first token. No timing is
asserted."""

import sys

import pytest
import torch
from rich.console import Console

from graphopt.bench import llm, output
from graphopt.bench.contenders import Unavailable, build, contenders
from graphopt.bench.startup import WEIGHTS_FILE, measure_startup
from graphopt.bench.suite import Options, run
from graphopt.bench.workloads import LARGE, Sizes
from graphopt.cli.main import _workloads
from graphopt.models import generate

QUICK = Sizes(quick=True, device="cpu")


def block_torchao(monkeypatch):
    """As if torchao were not installed: its imports raise ImportError."""
    for name in ("torchao", "torchao.quantization", "torchao.prototype.quantization.int4.inference_workflow"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture(scope="module")
def quick_run():
    """decoder-1b by its own contender list (cut to the cheap ones: level 1 compiles in
    seconds) with torchao blocked, as a run without --contenders picks it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm, "CONTENDERS", ("eager", "L1", "L1+int8", "torchao-int8"))
        block_torchao(patch)
        options = Options(["decoder-1b"], ["eager", "L0"], quick=True, rounds=1, startup=False, named=False)
        result, = run(options, Console(quiet=True))
    return result


def test_decoder_1b_runs_when_named_or_with_large():
    assert "decoder-1b" in LARGE
    assert "decoder-1b" not in _workloads(None, large=False)
    assert "decoder-1b" in _workloads(None, large=True) and _workloads(["decoder-1b"], large=False) == ["decoder-1b"]


def test_a_run_without_named_contenders_takes_the_workloads_own_and_says_why_torchao_has_no_row(quick_run):
    assert [case.case for case in quick_run.cases] == ["generate 4 tokens, batch 1", "generate 4 tokens, batch 2"]
    for case in quick_run.cases:
        assert [row.contender for row in case.rows] == ["eager", "graphopt L1", "graphopt L1 int8 weights"]
    assert quick_run.skipped.keys() == {"torchao int8 + torch.compile"}
    assert "torchao does not import here" in quick_run.skipped["torchao int8 + torch.compile"]
    assert "pip install 'graphopt[bench]'" in quick_run.skipped["torchao int8 + torch.compile"]


def test_float32_rows_decode_eagers_tokens_and_lowered_rows_show_error_and_agreement(quick_run):
    for case in quick_run.cases:
        rows = {row.contender: row for row in case.rows}
        assert rows["graphopt L1"].outputs_equal and rows["graphopt L1"].agreement is None
        int8 = rows["graphopt L1 int8 weights"]
        assert int8.outputs_equal and 0 < int8.relative_error <= 0.05
        assert 0.0 <= int8.agreement <= 1.0


def test_each_row_has_its_formats_bandwidth_floor(quick_run):
    for case in quick_run.cases:
        rows = {row.contender: row for row in case.rows}
        assert [row.weight_format for row in case.rows] == ["float32", "float32", "int8"]
        assert all(row.bandwidth_floor_us > 0 for row in case.rows)
        assert rows["graphopt L1 int8 weights"].bandwidth_floor_us < rows["eager"].bandwidth_floor_us
        assert "GB/s" in case.bandwidth_how


def test_table_has_throughput_floor_error_and_agreement_columns(quick_run):
    table = output.result_cells(quick_run.cases)
    for header in ("throughput", "weights", "bandwidth floor", "of floor", "error vs eager", "tokens = eager"):
        assert header in table.headers
    column = {h: i for i, h in enumerate(table.headers)}
    int8 = next(r for r in table.rows if r[column["contender"]] == "graphopt L1 int8 weights")
    assert int8[column["weights"]] == "int8" and int8[column["tokens = eager"]].endswith("%")
    assert table.rows[0][column["bandwidth floor"]].endswith("tokens/s[1]")
    assert "GB/s" in table.notes[0]


def test_decode_is_generate_with_a_one_token_prompt():
    workload = llm.decoder_1b(QUICK)
    prompt, new_tokens = workload.cases[1].inputs
    tokens, first_logits = llm.decode(workload.model, (prompt, new_tokens))
    # generate() leaves room for one position past its last token: one token fewer fits the cache.
    assert torch.equal(tokens[:, :-1], generate(workload.model, prompt[:, None], new_tokens - 1))
    assert first_logits.shape == (prompt.shape[0], workload.model.config.vocab_size)


def test_contenders_share_the_weights_and_a_bfloat16_copy_leaves_them_alone():
    workload = llm.decoder_1b(QUICK)
    weight = workload.model.lm_head.weight
    shared = llm.shared_copy(workload.model)
    assert shared.lm_head.weight is weight and shared.layers[0].self_attn.k_cache is not \
        workload.model.layers[0].self_attn.k_cache
    half = llm.shared_copy(workload.model, torch.bfloat16)
    assert weight.dtype == torch.float32 and half.lm_head.weight.dtype == torch.bfloat16
    assert half.config.dtype == torch.bfloat16 and half.layers[0].self_attn.k_cache.dtype == torch.bfloat16
    prompt, new_tokens = workload.cases[0].inputs
    assert llm.decode(half, (prompt, new_tokens))[1].dtype == torch.bfloat16


def test_weight_bytes_per_step_shrink_with_the_format():
    weights = [torch.empty(64, 128), torch.empty(512, 64)]
    found = {fmt: llm.weight_bytes(weights, fmt) for fmt in llm.FORMAT_BYTES}
    count = 64 * 128 + 512 * 64
    assert found["float32"] == 4 * count and found["bfloat16"] == 2 * count
    assert found["int8"] == count + 2 * (64 + 512)          # a bfloat16 scale per output channel
    assert found["int4"] == count // 2 + count // 32 * 4    # a scale and a zero per group of 32
    assert llm.weight_bytes(weights, "int4", steps=3) == 3 * found["int4"]


@pytest.mark.parametrize("key", ["torchao-int8", "torchao-int4"])
def test_torchao_is_left_out_with_the_reason_when_it_does_not_import(monkeypatch, key):
    contender = next(c for c in contenders("cpu") if c.key == key)
    block_torchao(monkeypatch)
    with pytest.raises(Unavailable, match=r"torchao does not import here .*pip install 'graphopt\[bench\]'"):
        build(contender, llm.decoder_1b(QUICK), "cpu")


def test_torchao_runs_on_decoding_workloads_only():
    from graphopt.bench.workloads import resnet

    contender = next(c for c in contenders("cpu") if c.key == "torchao-int8")
    with pytest.raises(Unavailable, match="decoding workloads only"):
        build(contender, resnet(QUICK), "cpu")


def test_llama_cpp_runs_on_a_workload_loaded_from_a_gguf_file_only(monkeypatch, tmp_path):
    contender = next(c for c in contenders("cpu") if c.key == "llama.cpp")
    workload = llm.decoder_1b(QUICK)
    with pytest.raises(Unavailable, match="loaded from a GGUF file"):
        build(contender, workload, "cpu")
    workload.gguf = tmp_path / "model.gguf"
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(Unavailable, match=r"llama-cpp-python does not import here \(.*\); CMAKE_ARGS=.*NATIVE=OFF"):
        build(contender, workload, "cpu")


def test_startup_of_the_decoder_gives_the_first_tokens_time_cold_and_warm():
    found = measure_startup("decoder-1b", "eager", quick=True, device="cpu", threads=1)
    assert found.keys() == {"cold_s", "warm_s", "peak_mib", "first_token_cold_s", "first_token_warm_s"}, found
    assert 0 < found["first_token_cold_s"] <= found["cold_s"] and 0 < found["first_token_warm_s"] <= found["warm_s"]
    table = output.startup_cells({"eager": found, "graphopt L2 frozen": {"error": "exit 1: boom"}}, "cpu")
    assert table.headers[-2:] == ["first token, cold", "first token, warm"]
    assert table.rows[1] == ["graphopt L2 frozen", "failed [1]", "", "", "", ""]


def test_a_start_loads_the_weights_the_first_wrote_and_decodes_the_same(tmp_path, monkeypatch):
    """With WEIGHTS_FILE named (as measure_startup does), the first build writes its random
    weights and buffers there; a later one loads them, memory-mapped, and decodes alike."""
    monkeypatch.setenv(WEIGHTS_FILE, str(tmp_path / "weights.pt"))
    built = llm.decoder_1b(QUICK)
    assert (tmp_path / "weights.pt").exists()
    normal_ = torch.Tensor.normal_
    monkeypatch.setattr(torch.Tensor, "normal_", lambda t, *a, **k: normal_(t, *a, **k) if t.is_meta
                        else pytest.fail("a loaded model draws no weights"))
    loaded = llm.decoder_1b(QUICK)
    theirs, ours = dict(built.model.named_parameters()), dict(loaded.model.named_parameters())
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    assert all(isinstance(p, torch.nn.Parameter) for p in ours.values())
    assert all(b.device.type == "cpu" for b in loaded.model.buffers())  # none left on the meta device
    with torch.no_grad():
        for case, again in zip(built.cases, loaded.cases):
            assert torch.equal(case.runner(built.model)()[0], again.runner(loaded.model)()[0])


@pytest.mark.slow
def test_every_contender_of_the_workload_decodes_on_the_tiny_config():
    """Level 2 and torch.compile at each precision, torchao where it imports: the float32
    rows give eager's tokens, the lowered ones stay within their contender's bound."""
    result, = run(Options(["decoder-1b"], [], quick=True, rounds=1, startup=False, named=False),
                  Console(quiet=True))
    torchao = "torchao int8 + torch.compile"
    assert not result.skipped or set(result.skipped) == {torchao, "torchao int4 + torch.compile"}
    for case in result.cases:
        rows = {row.contender: row for row in case.rows}
        assert len(rows) == len(llm.CONTENDERS) - len(result.skipped)
        assert all(row.outputs_equal for row in case.rows), [r.contender for r in case.rows if not r.outputs_equal]
        for name in ("torch.compile", "graphopt L2 frozen"):
            assert rows[name].relative_error is None and rows[name].weight_format == "float32"
        assert rows["graphopt L2 int4 weights"].weight_format == "int4"
        assert rows["graphopt L2 int4 weights"].agreement is not None
