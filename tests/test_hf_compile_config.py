"""transformers' own auto-compile path: `generate(..., compile_config=CompileConfig(...))`
with graphopt's backend name (CompileConfig's default mode, "reduce-overhead") and
with a `Backend` object (which transformers deep-copies), on the models of
test_hf_generate.py: eager's tokens, and the decode steps replay host graphs.

transformers compiles only on accelerators unless `_compile_all_devices` is set;
its prefill runs uncompiled, so every compiled call is a decode step.
"""

from __future__ import annotations

import pytest
import torch
from test_hf_generate import BUILDERS, NEW_TOKENS, CounterProbe, assert_replays_from, generate, prompt, twins

import graphopt

transformers = pytest.importorskip("transformers")


def _compile_config(backend) -> "transformers.CompileConfig":
    """By name, level 1 through `options` (torch.compile takes a mode or options, not both);
    a Backend object carries its own config and takes CompileConfig's mode, "reduce-overhead"."""
    if backend == "graphopt":
        config = transformers.CompileConfig(backend=backend, mode=None, options={"graph_opt_level": 1})
    else:
        config = transformers.CompileConfig(backend=backend)
    config._compile_all_devices = True  # compile on the CPU too
    return config


# Each case compiles a decode graph (~30 s on 2 cores). How the Backend is reached does
# not depend on the architecture: the default run takes the name on all six and the
# object on Llama; `-m slow` runs the object on the other five.
CASES = [pytest.param(name, way, id=f"{name}-{way}",
                      marks=[pytest.mark.slow] if way == "object" and name != "llama" else [])
         for way in ("name", "object") for name in BUILDERS]


@pytest.mark.parametrize("name, way", CASES)
def test_generate_with_compile_config_gives_eager_tokens_and_replays(name: str, way: str) -> None:
    torch._dynamo.reset()
    eager, model = twins(name)
    earlier = graphopt.backends()  # held: the registry lists live Backends only
    backend = "graphopt" if way == "name" else graphopt.Backend(graphopt.GraphOptimizationConfig(
        graph_opt_level=1, max_num_seqs=4))

    def report() -> graphopt.Report:
        if way == "object":
            return backend.report()
        made = graphopt.backends()[len(earlier):]
        return made[-1].report() if made else graphopt.Report(1)

    ids = prompt(1)
    probe = CounterProbe(report)
    out = generate(model, ids, probe, compile_config=_compile_config(backend))
    assert torch.equal(out, generate(eager, ids)), f"{name} ({way}): tokens differ from eager's"
    # Decode step 1 warms up, step 2 captures, steps 3.. replay.
    assert_replays_from(probe.steps, 3, f"{name} ({way})")
    assert probe.steps[-1].replays == NEW_TOKENS - 3, probe.steps
    if way == "object":
        assert len(graphopt.backends()) == len(earlier), "a Backend object is used as it is, not replaced"
