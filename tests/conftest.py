"""Shared fixtures: GPU-only tests skip without CUDA; Dynamo's caches are reset
between tests so one test's graphs and recompile counts never leak into another.
The tests of one module share a compile cache directory, so `optimize()` runs as it
does for a user by default (through stored traces, traces.py) and a module's tests
that compile the same graph pay for its compile once: the later ones load it, as a
second start would (docs/development.md, "A compile cache per test module"). A test
that asserts what a compile does (its misses, recompiles, dumps, a patched pass, the
batch it planned at) is marked `fresh_cache` and gets an empty directory of its own;
tests of Dynamo's own dispatch set `cache_dir=None`."""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo

from graphopt.models import Decoder, DecoderConfig

# Configs built while collecting (module level) get no cache; each test gets its own below.
os.environ["GRAPHOPT_CACHE_DIR"] = ""


# What CI also runs on the newest and the oldest torch (`-m version_sensitive`): a test
# (or, for a file, all of it) for each part of torch graphopt reaches through `_compat/`,
# the cheapest that exercises it. A name here that no longer matches a test fails a
# `-m version_sensitive` run of the suite.
VERSION_SENSITIVE = (
    # Dynamo's dynamic batch (torch 2.11 specialised a batch 2.13 kept symbolic), levels
    # 0-2 on a decoder, the runner's guards and rebinding
    "tests/test_api.py::test_one_graph_serves_every_batch_size",
    "tests/test_api.py::test_decode_steps_match_eager_logits_and_caches",
    "tests/runtime/test_runner.py::test_padding_goes_to_the_capture_size_and_the_scratch_slot",
    "tests/runtime/test_runner.py::test_moved_cache_and_new_parameters_give_fresh_results",
    "tests/test_guards.py",
    # Inductor's kernel templates parsed once, a GEMM weight blocked without an empty pad
    # (private methods of Inductor's)
    "tests/test_inductor_templates.py",
    # Dynamo's stored traces (torch 2.14 moved the precompile API)
    "tests/test_traces.py::test_second_start_runs_the_stored_trace",
    "tests/test_traces.py::test_a_trace_stored_in_inference_mode_is_not_used_outside_it",
    "tests/test_traces.py::test_guard_sources_are_read_by_a_walker_never_evaluated",
    "tests/test_traces.py::test_a_guard_torch_cannot_store_leaves_the_step_to_dynamo",
    # Dynamo's guards on the module registration hooks, where a forward builds a module
    "tests/test_frozen_changes.py::test_a_forward_that_builds_a_module_loads_its_stored_trace_in_a_later_process",
    # Dynamo's type guards on a class made inside a function, which graphopt takes over
    "tests/test_traces.py::test_function_modules_of_local_classes_are_stored_and_told_apart",
    # transformers' Llama through a stored trace (2.11 refused one reading the builtin `type`)
    "tests/test_hf_generate.py::test_llama_second_start_runs_the_stored_trace",
    # AOTAutograd and Inductor through the compile cache
    "tests/test_cache.py::test_second_start_loads_the_graph_and_its_report",
    "tests/test_cache.py::test_level_1_hit_skips_aot_autograd_and_the_passes",
    "tests/test_cache.py::test_level_2_hit_keeps_the_report",
    "tests/test_inductor_cache_reads.py::test_a_graph_new_to_graphopts_cache_is_compiled_once_with_its_passes[frozen]",
    # Inductor's compiled graph stored without its constants, and the GEMM template's packings
    "tests/test_cache_frozen.py::test_level_2_frozen_entry_holds_the_code_without_the_weights",
    # the Backend's hold on Dynamo: its name, its recompile budget, Dynamo giving up
    "tests/test_backend.py::test_torch_compile_with_backend_name",
    "tests/test_backend.py::test_dynamo_giving_up_is_counted",
    "tests/test_backend.py::test_a_backend_gives_its_recompile_budget_back_when_it_goes",
    "tests/test_registry.py",
    # level 2: Inductor's post-grad pass, its options, frozen weights and refresh's recompile
    # without caches
    "tests/passes/test_pipeline.py::test_level_2_takes_inductor_options_and_refresh_repacks_packed_weights",
    "tests/test_frozen_changes.py::test_a_module_built_inside_a_compiled_forward_does_not_recompile_it",
    # level 2's code generated in a child process (Inductor's subprocess compile)
    "tests/test_tiers.py::test_auto_compiles_level_2_in_a_child_process_with_graphopts_passes_and_swaps_it_in",
    "tests/test_tiers.py::test_auto_compiles_a_decoders_level_2_in_a_child_process",
    # the ATen graphs the canonical forms and fusions match, and level 1's bindings
    "tests/passes/fusion/test_attention.py",
    "tests/test_lowering.py",
    # Inductor's pattern classes pickled and loaded (traced search patterns in the compile cache)
    "tests/passes/fusion/test_search_cache.py::test_every_builtin_search_pattern_survives_the_round_trip_and_owns_its_key",
    "tests/passes/fusion/test_search_cache.py::test_a_second_process_loads_the_searches_instead_of_tracing_them",
    # transformers' generate() traced by Dynamo
    "tests/test_hf_generate.py::test_llama_generate_through_each_way_in",
    # Dynamo's fake tensors made without inference-ness, which a deferred level 2 needs too
    "tests/test_hf_generate.py::test_llama_generate_under_inference_mode_times_both_levels_and_keeps_eagers_tokens",
)

# Tests inside VERSION_SENSITIVE's entries that another entry covers at less cost: the
# newest and oldest torch skip them. A name here that matches no test fails the run too.
NOT_VERSION_SENSITIVE = (
    # a level-2 compile of the decoder (test_pipeline's and test_cache's entries reach Inductor)
    "tests/passes/fusion/test_attention.py::test_level2_end_to_end",
    "tests/passes/fusion/test_attention.py::test_level2_decoder_leaves_decode_attention_to_inductor",
    "tests/test_guards.py::test_inputs_gives_eager_outputs_over_batch_sizes_and_compiles_a_new_dtype[kw2]",
    "tests/test_hf_generate.py::test_llama_generate_through_each_way_in[optimize-L2]",
    # the child-process compile of a decoder (the other test_tiers entry starts the same child)
    "tests/test_tiers.py::test_auto_compiles_a_decoders_level_2_in_a_child_process",
    # generate() through guards="inputs" (test_hf_generate's entry traces generate, the
    # other test_guards tests the guard filter)
    "tests/test_guards.py::test_generate_with_inputs_gives_eager_tokens_over_new_caches_and_batches",
    # host graphs' stored trace (level 1's and level 2's are the torch API)
    "tests/test_traces.py::test_second_start_runs_the_stored_trace[level 1 + host graphs]",
)


def _named(nodeid: str, names: tuple[str, ...]) -> set[str]:
    return {name for name in names if nodeid == name or nodeid.startswith((name + "::", name + "["))}


def pytest_collection_modifyitems(config, items):
    matched = set()
    for item in items:
        names, exceptions = _named(item.nodeid, VERSION_SENSITIVE), _named(item.nodeid, NOT_VERSION_SENSITIVE)
        if names and not exceptions:
            item.add_marker(pytest.mark.version_sensitive)
        matched |= names | exceptions
    unmatched = [name for name in VERSION_SENSITIVE + NOT_VERSION_SENSITIVE if name not in matched]
    if unmatched and "version_sensitive" in config.getoption("markexpr"):
        raise pytest.UsageError(f"VERSION_SENSITIVE or NOT_VERSION_SENSITIVE in {__file__} names no test: {unmatched}")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def module_cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("graphopt-cache"))


@pytest.fixture(autouse=True)
def cache_dir_env(request, tmp_path_factory, monkeypatch):
    if request.node.get_closest_marker("fresh_cache"):
        directory = str(tmp_path_factory.mktemp("graphopt-cache"))
    else:
        directory = request.getfixturevalue("module_cache_dir")
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", directory)


@pytest.fixture
def decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig.tiny()).eval()
