"""Sliding-window caches replay (transformers' `StaticSlidingWindowLayer`).

Such a cache counts its tokens in a Python int besides its tensors; Dynamo passes
that int to the graph as a number, and the graph only returns it plus one (the
count after this step). No tensor depends on it, so one device graph serves every
value, and the runtime computes the returned number itself (a replay would return
the captured call's). Greedy `generate()` with 15 new tokens on tiny random models:
eager's tokens, and every decode step after the warm-ups and the capture replays.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import unexpected_fallbacks
from test_hf_generate import CounterProbe, config_for, prompt

import graphopt

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 15
WINDOW = 32  # larger than prompt + new tokens: the cache never rolls


def _config(cls: type, **extra: Any) -> Any:
    return cls(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, max_position_embeddings=64, **extra)


BUILDERS = {
    "mistral": lambda: transformers.MistralForCausalLM(_config(transformers.MistralConfig, sliding_window=WINDOW)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(_config(
        transformers.Qwen2Config, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(_config(transformers.Gemma2Config, sliding_window=WINDOW,
                                                             head_dim=16)),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(_config(transformers.Gemma3TextConfig, sliding_window=WINDOW,
                                                             head_dim=16)),
}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_sliding_window_cache_gives_eager_tokens_and_replays(name: str) -> None:
    torch.manual_seed(0)
    eager = BUILDERS[name]().eval()
    model = BUILDERS[name]().eval()
    model.load_state_dict(eager.state_dict())
    model.forward = graphopt.optimize(model.forward, config_for(1))
    ids, probe = prompt(1), CounterProbe(model.forward.report)
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                  cache_implementation="static", attention_mask=torch.ones_like(ids))
    out = model.generate(ids, logits_processor=transformers.LogitsProcessorList([probe]), **kwargs)
    assert torch.equal(out, eager.generate(ids, **kwargs)), f"{name}: tokens differ from eager's"
    # Decode step 1 warms up, step 2 captures, the other 12 of 14 replay.
    replays = [step.replays - probe.steps[0].replays for step in probe.steps]
    assert replays == [0, 0, 0, *range(1, NEW_TOKENS - 2)], probe.steps
    assert probe.steps[-1].recompiles == probe.steps[3].recompiles, probe.steps
    report = model.forward.report()
    assert not unexpected_fallbacks(report), unexpected_fallbacks(report)
