import json

import pytest
import torch

from graphopt.config import (
    CAPTURE_ERROR_MODES,
    TOLERANCES,
    GraphOptimizationConfig,
    default_capture_sizes,
    tolerance,
)

SIZES_256 = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128,
             144, 160, 176, 192, 208, 224, 240, 256]


# --- defaults and capture sizes ---------------------------------------------------------


def test_defaults():
    cfg = GraphOptimizationConfig()
    assert cfg.graph_opt_level == "auto"
    assert cfg.use_cudagraph is True
    assert cfg.max_num_seqs == 256
    assert cfg.cudagraph_num_of_warmups == 1
    assert cfg.capture_error_mode == "thread_local"
    assert cfg.graph_pool is None
    assert cfg.reuse_pool_in_same_graph is True
    assert cfg.clone_input is True
    assert cfg.clone_output is False
    assert cfg.freeze_parameters is False
    assert cfg.disabled_passes == []
    assert cfg.debug_dump_dir is None
    assert cfg.verify is False
    assert cfg.inductor_compile_config == {}
    assert cfg.cudagraph_capture_sizes == SIZES_256
    assert len(cfg.cudagraph_capture_sizes) == 27
    assert cfg.cudagraph_capture_sizes[0] == 1
    assert cfg.cudagraph_capture_sizes[-1] == 256


def test_default_disabled_passes_not_shared():
    a, b = GraphOptimizationConfig(), GraphOptimizationConfig()
    a.disabled_passes.append("cse")
    assert b.disabled_passes == []


@pytest.mark.parametrize(
    "max_num_seqs, expected",
    [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 9]), (256, SIZES_256)],
)
def test_default_capture_sizes_exact(max_num_seqs, expected):
    assert default_capture_sizes(max_num_seqs) == expected


def test_default_capture_sizes_100():
    sizes = default_capture_sizes(100)
    assert sizes == [1, 2, 4] + [8 * i for i in range(1, 13)] + [100]
    assert sizes[-2:] == [96, 100]


def test_default_capture_sizes_300():
    sizes = default_capture_sizes(300)
    assert sizes[-3:] == [256, 288, 300]
    assert 288 in sizes and 300 in sizes


def test_default_capture_sizes_1024():
    sizes = default_capture_sizes(1024)
    assert sizes[-2:] == [992, 1024]
    assert {288, 320, 512} <= set(sizes)
    assert len(sizes) == 27 + 24


def test_default_capture_sizes_above_1024():
    sizes = default_capture_sizes(2000)
    assert sizes[-2:] == [1024, 2000]


@pytest.mark.parametrize("max_num_seqs", [1, 3, 7, 100, 129, 256, 257, 300, 1000, 1024, 5000])
def test_default_capture_sizes_properties(max_num_seqs):
    sizes = default_capture_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes))
    assert sizes[0] == 1
    assert sizes[-1] == max_num_seqs
    assert all(s <= max_num_seqs for s in sizes)


def test_max_num_seqs_drives_default_sizes():
    assert GraphOptimizationConfig(max_num_seqs=32).cudagraph_capture_sizes == [1, 2, 4, 8, 16, 24, 32]


def test_explicit_sizes_sorted_and_deduped():
    cfg = GraphOptimizationConfig(cudagraph_capture_sizes=[9, 1, 5, 3, 5, 7, 1])
    assert cfg.cudagraph_capture_sizes == [1, 3, 5, 7, 9]


def test_explicit_sizes_tuple_becomes_list():
    cfg = GraphOptimizationConfig(cudagraph_capture_sizes=(4, 2))
    assert cfg.cudagraph_capture_sizes == [2, 4]
    assert isinstance(cfg.cudagraph_capture_sizes, list)


def test_explicit_sizes_kept_beyond_max_num_seqs():
    cfg = GraphOptimizationConfig(max_num_seqs=4, cudagraph_capture_sizes=[2, 64])
    assert cfg.cudagraph_capture_sizes == [2, 64]


def test_explicit_sizes_do_not_alias_caller_list():
    sizes = [1, 2]
    cfg = GraphOptimizationConfig(cudagraph_capture_sizes=sizes)
    sizes.append(3)
    assert cfg.cudagraph_capture_sizes == [1, 2]


# --- JSON and dict forms ----------------------------------------------------------------


def test_from_json_command_line_form():
    cfg = GraphOptimizationConfig.from_json('{"graph_opt_level": 1, "cudagraph_capture_sizes": [1, 3, 5, 7, 9]}')
    assert cfg.graph_opt_level == 1
    assert cfg.cudagraph_capture_sizes == [1, 3, 5, 7, 9]
    assert cfg.max_num_seqs == 256


def test_from_json_empty_object_is_default():
    assert GraphOptimizationConfig.from_json("{}") == GraphOptimizationConfig()


def test_from_json_null_sizes_means_default():
    cfg = GraphOptimizationConfig.from_json('{"max_num_seqs": 8, "cudagraph_capture_sizes": null}')
    assert cfg.cudagraph_capture_sizes == [1, 2, 4, 8]


@pytest.mark.parametrize(
    "cfg",
    [
        GraphOptimizationConfig(),
        GraphOptimizationConfig(
            graph_opt_level=2,
            use_cudagraph=False,
            cudagraph_capture_sizes=[3, 1, 17],
            max_num_seqs=17,
            cudagraph_num_of_warmups=0,
            capture_error_mode="relaxed",
            reuse_pool_in_same_graph=False,
            clone_input=False,
            clone_output=True,
            freeze_parameters=True,
            disabled_passes=["cse", "dce"],
            debug_dump_dir="/tmp/graphopt-dump",
            verify=True,
            inductor_compile_config={"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                                     "freezing": True},
        ),
    ],
)
def test_json_round_trip(cfg):
    text = cfg.to_json()
    assert isinstance(json.loads(text), dict)
    assert "graph_pool" not in json.loads(text)
    assert GraphOptimizationConfig.from_json(text) == cfg


def test_to_json_omits_graph_pool():
    pool = object()
    cfg = GraphOptimizationConfig(graph_pool=pool)
    assert "graph_pool" not in json.loads(cfg.to_json())
    assert GraphOptimizationConfig.from_json(cfg.to_json()) == cfg.replace(graph_pool=None)


def test_dict_round_trip_keeps_pool_handle():
    pool = object()
    cfg = GraphOptimizationConfig(max_num_seqs=8, graph_pool=pool, disabled_passes=["cse"])
    d = cfg.to_dict()
    assert d["graph_pool"] is pool
    assert d["cudagraph_capture_sizes"] == [1, 2, 4, 8]
    back = GraphOptimizationConfig.from_dict(d)
    assert back == cfg
    assert back.graph_pool is pool


def test_to_dict_lists_are_copies():
    cfg = GraphOptimizationConfig(disabled_passes=["cse"])
    d = cfg.to_dict()
    d["disabled_passes"].append("dce")
    d["cudagraph_capture_sizes"].append(10_000)
    assert cfg.disabled_passes == ["cse"]
    assert cfg.cudagraph_capture_sizes[-1] == 256


def test_replace_validates_again():
    cfg = GraphOptimizationConfig()
    assert cfg.replace(verify=True).verify is True
    assert cfg.verify is False
    with pytest.raises(ValueError, match=r"graph_opt_level must be an int in \{0, 1, 2\} or 'auto', got 5"):
        cfg.replace(graph_opt_level=5)
    with pytest.raises(ValueError, match="did you mean 'verify'"):
        cfg.replace(verfy=True)


def test_replace_max_num_seqs_recomputes_default_sizes_only():
    assert GraphOptimizationConfig().replace(max_num_seqs=8).cudagraph_capture_sizes == [1, 2, 4, 8]
    explicit = GraphOptimizationConfig(cudagraph_capture_sizes=[3, 5])
    assert explicit.replace(max_num_seqs=8).cudagraph_capture_sizes == [3, 5]


# --- bad input --------------------------------------------------------------------------


def test_unknown_key_with_suggestion():
    with pytest.raises(ValueError, match=r"unknown .*'use_cuda_graph'.*did you mean 'use_cudagraph'\?.*Accepted keys:.*graph_opt_level"):
        GraphOptimizationConfig.from_dict({"use_cuda_graph": True})


def test_unknown_key_suggestion_through_json():
    with pytest.raises(ValueError, match="did you mean 'max_num_seqs'"):
        GraphOptimizationConfig.from_json('{"max_num_seq": 8}')


def test_unknown_key_without_close_match():
    with pytest.raises(ValueError, match=r"unknown .*'zzzz'\. Accepted keys: graph_opt_level, level_choice, use_cudagraph") as info:
        GraphOptimizationConfig.from_dict({"zzzz": 1})
    assert "did you mean" not in str(info.value)


def test_from_dict_rejects_non_mapping():
    with pytest.raises(TypeError, match="must be a mapping"):
        GraphOptimizationConfig.from_dict([("graph_opt_level", 1)])


@pytest.mark.parametrize(
    "key, value, exc, pattern",
    [
        ("graph_opt_level", "1", TypeError, r"graph_opt_level must be an int in \{0, 1, 2\} or 'auto', got '1' \(str\)"),
        ("graph_opt_level", True, TypeError, r"graph_opt_level must be an int .*got True \(bool\)"),
        ("graph_opt_level", 1.5, TypeError, r"graph_opt_level must be an int .*got 1\.5 \(float\)"),
        ("graph_opt_level", 1.0, TypeError, r"graph_opt_level must be an int .*\(float\)"),
        ("graph_opt_level", 3, ValueError, r"graph_opt_level must be an int in \{0, 1, 2\} or 'auto', got 3$"),
        ("graph_opt_level", -1, ValueError, r"graph_opt_level must be an int in \{0, 1, 2\} or 'auto', got -1$"),
        ("max_num_seqs", "8", TypeError, r"max_num_seqs must be an int >= 1, got '8' \(str\)"),
        ("max_num_seqs", 0, ValueError, r"max_num_seqs must be an int >= 1, got 0"),
        ("max_num_seqs", False, TypeError, r"max_num_seqs must be an int >= 1, got False \(bool\)"),
        ("cudagraph_num_of_warmups", -1, ValueError, r"cudagraph_num_of_warmups must be an int >= 0, got -1"),
        ("cudagraph_num_of_warmups", 2.0, TypeError, r"cudagraph_num_of_warmups must be an int >= 0"),
        ("use_cudagraph", "yes", TypeError, r"use_cudagraph must be a bool \(true/false\), got 'yes' \(str\)"),
        ("use_cudagraph", 1, TypeError, r"use_cudagraph must be a bool \(true/false\), got 1 \(int\)"),
        ("clone_input", 0, TypeError, r"clone_input must be a bool"),
        ("clone_output", "false", TypeError, r"clone_output must be a bool"),
        ("reuse_pool_in_same_graph", None, TypeError, r"reuse_pool_in_same_graph must be a bool"),
        ("freeze_parameters", 1, TypeError, r"freeze_parameters must be a bool"),
        ("verify", "true", TypeError, r"verify must be a bool"),
        ("capture_error_mode", "strict", ValueError,
         r"capture_error_mode must be one of 'global', 'thread_local', 'relaxed', got 'strict'"),
        ("capture_error_mode", 1, TypeError, r"capture_error_mode must be one of 'global', 'thread_local', 'relaxed'"),
        ("cudagraph_capture_sizes", [1, 0, 4], ValueError, r"cudagraph_capture_sizes must be .*ints >= 1.*got 0 at index 1"),
        ("cudagraph_capture_sizes", [4, -8], ValueError, r"cudagraph_capture_sizes must be .*ints >= 1.*got -8 at index 1"),
        ("cudagraph_capture_sizes", [], ValueError, r"cudagraph_capture_sizes must be a non-empty list.*got an empty list"),
        ("cudagraph_capture_sizes", 8, TypeError, r"cudagraph_capture_sizes must be a non-empty list .*got 8 \(int\)"),
        ("cudagraph_capture_sizes", "1,2", TypeError, r"cudagraph_capture_sizes must be a non-empty list .*got '1,2' \(str\)"),
        ("cudagraph_capture_sizes", [1, "2"], TypeError, r"cudagraph_capture_sizes .*got '2' \(str\) at index 1"),
        ("cudagraph_capture_sizes", [1, 2.0], TypeError, r"cudagraph_capture_sizes .*got 2\.0 \(float\) at index 1"),
        ("cudagraph_capture_sizes", [True], TypeError, r"cudagraph_capture_sizes .*got True \(bool\) at index 0"),
        ("disabled_passes", "cse", TypeError, r"disabled_passes must be a list of pass names.*got 'cse' \(str\)"),
        ("disabled_passes", None, TypeError, r"disabled_passes must be a list of pass names.*got None"),
        ("disabled_passes", ["cse", 3], TypeError, r"disabled_passes must be a list of pass names.*got 3 \(int\) at index 1"),
        ("disabled_passes", ["cse", ""], ValueError, r"disabled_passes .*non-empty strings.*empty string at index 1"),
        ("debug_dump_dir", 3, TypeError, r"debug_dump_dir must be a non-empty str"),
        ("debug_dump_dir", "", ValueError, r"debug_dump_dir must be a non-empty str"),
    ],
)
def test_bad_values(key, value, exc, pattern):
    with pytest.raises(exc, match=pattern):
        GraphOptimizationConfig(**{key: value})
    with pytest.raises(exc, match=pattern):
        GraphOptimizationConfig.from_dict({key: value})


def test_bad_values_through_json():
    with pytest.raises(TypeError, match=r"graph_opt_level must be an int .*got '1' \(str\)"):
        GraphOptimizationConfig.from_json('{"graph_opt_level": "1"}')
    with pytest.raises(TypeError, match=r"use_cudagraph must be a bool \(true/false\), got 1 \(int\)"):
        GraphOptimizationConfig.from_json('{"use_cudagraph": 1}')
    with pytest.raises(TypeError, match=r"max_num_seqs must be an int >= 1, got True \(bool\)"):
        GraphOptimizationConfig.from_json('{"max_num_seqs": true}')
    with pytest.raises(ValueError, match=r"cudagraph_capture_sizes .*got 0 at index 0"):
        GraphOptimizationConfig.from_json('{"cudagraph_capture_sizes": [0]}')


def test_capture_error_mode_message_lists_modes():
    with pytest.raises(ValueError) as info:
        GraphOptimizationConfig(capture_error_mode="strict")
    for mode in CAPTURE_ERROR_MODES:
        assert repr(mode) in str(info.value)


@pytest.mark.parametrize("text", ["not json", '{"graph_opt_level": 1,}', "", "{'graph_opt_level': 1}"])
def test_from_json_not_json(text):
    with pytest.raises(ValueError, match=r"not valid JSON: .* at line \d+ column \d+"):
        GraphOptimizationConfig.from_json(text)


def test_from_json_reports_position():
    with pytest.raises(ValueError, match="at line 2 column"):
        GraphOptimizationConfig.from_json('{"graph_opt_level": 1,\n oops}')


@pytest.mark.parametrize(
    "text, kind", [("[1, 2]", "array"), ("3", "number"), ('"x"', "string"), ("null", "null"), ("true", "boolean")]
)
def test_from_json_not_an_object(text, kind):
    with pytest.raises(ValueError, match=rf"must be an object.*got a JSON {kind}"):
        GraphOptimizationConfig.from_json(text)


@pytest.mark.parametrize("value", [b'{"graph_opt_level": 1}', {"graph_opt_level": 1}, None, 1])
def test_from_json_non_str(value):
    with pytest.raises(TypeError, match=r"JSON must be a str, got"):
        GraphOptimizationConfig.from_json(value)


def test_from_json_rejects_graph_pool():
    with pytest.raises(ValueError, match=r"graph_pool cannot come from JSON.*pool handle.*pass it in Python"):
        GraphOptimizationConfig.from_json('{"graph_pool": 1}')
    with pytest.raises(ValueError, match=r"graph_pool cannot come from JSON"):
        GraphOptimizationConfig.from_json('{"graph_pool": null}')


def test_from_json_rejects_duplicate_keys():
    with pytest.raises(ValueError, match=r"'graph_opt_level' more than once"):
        GraphOptimizationConfig.from_json('{"graph_opt_level": 1, "graph_opt_level": 2}')


def test_default_capture_sizes_rejects_bad_max_num_seqs():
    with pytest.raises(ValueError, match=r"max_num_seqs must be an int >= 1, got 0"):
        default_capture_sizes(0)
    with pytest.raises(TypeError, match=r"max_num_seqs must be an int >= 1"):
        default_capture_sizes(8.0)


# --- passes -----------------------------------------------------------------------------


def test_pass_enabled_by_default():
    cfg = GraphOptimizationConfig()
    assert cfg.pass_enabled("cse")
    assert cfg.pass_enabled("dce")


def test_pass_enabled_with_names():
    cfg = GraphOptimizationConfig(disabled_passes=["cse", "constant_fold"])
    assert not cfg.pass_enabled("cse")
    assert not cfg.pass_enabled("constant_fold")
    assert cfg.pass_enabled("dce")


def test_pass_enabled_star_disables_all():
    cfg = GraphOptimizationConfig(disabled_passes=["*"])
    assert not cfg.pass_enabled("cse")
    assert not cfg.pass_enabled("anything")


def test_disabled_passes_tuple_becomes_list():
    assert GraphOptimizationConfig(disabled_passes=("cse",)).disabled_passes == ["cse"]


# --- inductor_compile_config -----------------------------------------------------------


def test_inductor_compile_config_is_a_copy():
    options = {"max_autotune": True}
    cfg = GraphOptimizationConfig(inductor_compile_config=options)
    options["cpp_wrapper"] = False
    assert cfg.inductor_compile_config == {"max_autotune": True}


@pytest.mark.parametrize("options,exc,pattern", [
    ({"max_autotun": True}, ValueError, "'max_autotun' is not an Inductor option; did you mean 'max_autotune'"),
    ({"no_such_thing_at_all": 1}, ValueError, r"torch._inductor.list_options\(\) lists them"),
    ({"triton.cudagraphs": True}, ValueError, "'triton.cudagraphs' is set by graphopt itself"),
    ({"fx_graph_cache": True}, ValueError, "'fx_graph_cache' is set by graphopt itself"),
    ({"max_autotune": [True]}, TypeError, "'max_autotune' is \\[True\\] \\(list\\)"),
    (["max_autotune"], TypeError, "must be a mapping of Inductor option names"),
    ({"freezing": True}, ValueError, "freezing=True bakes the weights .* needs freeze_parameters=True"),
])
def test_inductor_compile_config_refuses(options, exc, pattern):
    with pytest.raises(exc, match=pattern):
        GraphOptimizationConfig(inductor_compile_config=options)


def test_inductor_freezing_with_frozen_parameters():
    cfg = GraphOptimizationConfig(freeze_parameters=True, inductor_compile_config={"freezing": True})
    assert cfg.inductor_compile_config == {"freezing": True}


# --- tolerances -------------------------------------------------------------------------


def test_tolerance_float_dtypes():
    assert tolerance(torch.float32) == (1e-4, 1e-4)
    assert tolerance(torch.float64) == (1e-7, 1e-7)
    assert tolerance(torch.float16) == (1e-2, 1e-2)
    assert tolerance(torch.bfloat16) == (5e-2, 5e-2)
    assert set(TOLERANCES) == {torch.float32, torch.float64, torch.float16, torch.bfloat16}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool])
def test_tolerance_exact_dtypes(dtype):
    assert tolerance(dtype) == (0.0, 0.0)


def test_tolerance_other_dtypes():
    assert tolerance(torch.float8_e4m3fn) == TOLERANCES[torch.float32]
    assert tolerance(torch.complex64) == TOLERANCES[torch.float32]
    assert tolerance(torch.complex128) == TOLERANCES[torch.float64]
    with pytest.raises(TypeError, match="expects a torch.dtype"):
        tolerance("float32")
