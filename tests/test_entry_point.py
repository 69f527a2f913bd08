"""The `torch_dynamo_backends` entry point on first use: a fresh process that never
imported graphopt names the backend, and torch loads the package itself.

Each case runs in its own process, since the failure it guards against (torch
registering the name a second time while loading the entry point) happens only on
the process's first lookup.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# Both scripts check that nothing imported graphopt before torch looked it up, and
# print "ok" only when the compiled result equals eager's.
TORCH_COMPILE = """
import sys, torch
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
assert "graphopt" not in sys.modules
compiled = torch.compile(model, backend="graphopt", options={"graph_opt_level": 1, "use_cudagraph": False})
with torch.inference_mode():
    x = torch.randn(3, 8)
    torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
import graphopt
assert len(graphopt.backends()) == 1 and graphopt.backends()[0].report().graphs
print("ok")
"""

COMPILE_CONFIG = """
import sys, torch, transformers
def tiny():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=64)).eval()
eager, model = tiny(), tiny()
# Without host graphs: the entry point is what is tested here, and test_hf_generate
# captures them through generate() already, at half this process's time.
config = transformers.CompileConfig(backend="graphopt", mode=None,
                                    options={"graph_opt_level": 1, "use_cudagraph": False})
config._compile_all_devices = True  # transformers compiles only on accelerators otherwise
ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False,
              cache_implementation="static")
assert "graphopt" not in sys.modules
expected = eager.generate(ids, **kwargs)
out = model.generate(ids, compile_config=config, **kwargs)
assert torch.equal(out, expected), (out, expected)
import graphopt
assert graphopt.backends() and graphopt.backends()[-1].report().graphs
print("ok")
"""


def _run_fresh(script: str) -> None:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_torch_compile_by_name_works_in_a_fresh_process():
    _run_fresh(TORCH_COMPILE)


def test_transformers_compile_config_by_name_works_in_a_fresh_process():
    pytest.importorskip("transformers")
    _run_fresh(COMPILE_CONFIG)
