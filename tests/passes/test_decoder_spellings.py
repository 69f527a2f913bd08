"""One Llama-style decoder written four ways (decoder_spellings.py): at levels 1 and 2
(two layers at level 1, one at level 2) each gives eager's logits, and `report()` shows
every attention site fused (decode attention for the decode steps over the cache, SDPA
for the prefill) and, at level 1, every RMSNorm, rotary embedding (each spelling writes
it another way; Meta's complex form is made real math at level 2 instead) and SwiGLU
gate."""

import pytest
import torch
from decoder_spellings import LAYERS, SPELLINGS, decode_inputs, prefill_inputs
from support import unexpected_fallbacks

import graphopt
from graphopt._compat import inductor
from graphopt.config import tolerance

LEVEL_2 = pytest.mark.skipif(not inductor.inductor_available(), reason="level 2 needs a C++ compiler")
# A prefill, decode steps whose rows sit at different positions, then a batch of
# another size (rows that the prefill never wrote read a cache of zeros, in both).
STEPS = [prefill_inputs(2, 5), decode_inputs(2, 5), decode_inputs(2, 6, seed=1), decode_inputs(3, 7, seed=2)]


@pytest.mark.parametrize("level", [1, pytest.param(2, marks=LEVEL_2)])
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_every_site_fuses(name, level):
    # One layer at level 2, whose code generation costs per layer: its sites are of the kinds
    # two layers have (a norm reading the embedding, norms reading a residual add); level 1
    # keeps the second layer, whose sites read the first one's output.
    layers = LAYERS if level == 1 else 1
    reference, model = SPELLINGS[name](layers=layers), SPELLINGS[name](layers=layers)
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(graph_opt_level=level, use_cudagraph=False))
    atol, rtol = tolerance(torch.float32)
    with torch.inference_mode():
        for step, inputs in enumerate(STEPS):
            torch.testing.assert_close(opt(*[x.clone() for x in inputs]), reference(*inputs), atol=atol, rtol=rtol,
                                       msg=lambda m: f"{name}, level {level}, step {step}: {m}")
    report = opt.report()
    assert not unexpected_fallbacks(report)
    prefill, *decode = [g.fused_ops for g in report.graphs]
    assert decode, "the decode steps compiled no graph of their own"
    assert prefill.get("scaled_dot_product_attention") == layers and "decode_attention" not in prefill, prefill
    for fused in decode:
        assert fused.get("decode_attention") == layers and "scaled_dot_product_attention" not in fused, fused
    # Meta's complex products (grouped) stay at level 1, where each is one ATen kernel; at level 2 they
    # become real math, which Inductor compiles (it leaves complex math to ATen).
    rotary = 0 if name == "grouped" else 2 * layers
    if level == 1:  # the other fusions are level 1 only: Inductor makes one kernel of each chain itself
        for fused in (prefill, *decode):
            assert fused.get("rms_norm", 0) + fused.get("add_rms_norm", 0) == 2 * layers + 1, fused
            assert fused.get("rotary_embedding", 0) == rotary and fused.get("silu_and_mul") == layers, fused
    if name == "grouped":
        made_real = [p.counts.get("complex_rotary", 0) for p in report.passes if p.name == "canonicalize_rotary"]
        assert made_real == [2 * layers if level == 2 else 0] * len(report.graphs), made_real
