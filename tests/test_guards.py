"""guards: "all" (default) checks every Dynamo guard; "inputs" only those on the step's
arguments and torch's global state, trusting the module's Python state."""

import pytest
import torch
from support import Switch

import graphopt
from graphopt import FallbackKind
from graphopt.api.guards import keep_input_guards


def optimized(guards, **kw):
    torch.manual_seed(0)
    model = Switch().eval()
    kw.setdefault("graph_opt_level", 1)
    config = graphopt.GraphOptimizationConfig(guards=guards, max_num_seqs=8, cache_dir=None, **kw)
    return model, graphopt.optimize(model, config)


@pytest.mark.parametrize("kw", [dict(), dict(use_cudagraph=False), dict(graph_opt_level=2, use_cudagraph=False),
                                dict(freeze_parameters=True)])
def test_inputs_gives_eager_outputs_over_batch_sizes_and_compiles_a_new_dtype(kw):
    model, opt = optimized("inputs", **kw)
    with torch.no_grad():
        for batch in (4, 3, 1, 8, 5):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(opt(x), torch.relu(model.lin(x)), atol=1e-4, rtol=1e-4)
        graphs = len(opt.report().graphs)
        x = torch.randn(4, 8, dtype=torch.float64)
        # The input's dtype is guarded: a new graph, not the float32 one.
        model.double()
        torch.testing.assert_close(opt(x), torch.relu(model.lin(x)))
    assert len(opt.report().graphs) > graphs


def test_inputs_trusts_the_module_where_all_sees_it_change():
    x = torch.randn(4, 8)
    for guards, expected in (("all", torch.tanh), ("inputs", torch.relu)):
        model, opt = optimized(guards)
        with torch.no_grad():
            opt(x)
            model.act = "tanh"  # outside the contract of "inputs"
            torch.testing.assert_close(opt(x), expected(model.lin(x)), msg=guards)


def test_inputs_still_guards_grad_mode():
    model, opt = optimized("inputs", use_cudagraph=False)
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert not opt(x).requires_grad
    assert opt(x).requires_grad  # grad mode is torch's global state: guarded, a new graph


def test_in_place_weight_updates_are_read_with_inputs():
    model, opt = optimized("inputs")
    x = torch.randn(4, 8)
    with torch.no_grad():
        opt(x)
        model.lin.weight.mul_(2)
        torch.testing.assert_close(opt(x), torch.relu(model.lin(x)))


class _Entry:
    def __init__(self, name, guard_type="TENSOR_MATCH", is_global=False):
        self.name, self.guard_type, self.is_global = name, guard_type, is_global


def test_the_filter_keeps_argument_and_global_state_guards_only():
    keep = keep_input_guards(["self", "x", "kwargs"])
    entries = [_Entry("x"), _Entry("L['x']"), _Entry("type(x)", "TYPE_MATCH"), _Entry("kwargs['mask']"),
               _Entry("", "GRAD_MODE"), _Entry("", "SHAPE_ENV"),
               _Entry("self._modules['lin']._parameters['weight']"), _Entry("self.act", "EQUALS_MATCH"),
               _Entry("L['self'].act", "EQUALS_MATCH"), _Entry("G['torch'].relu", "FUNCTION_MATCH", is_global=True),
               _Entry("dict(type(self).__dict__)", "DICT_NOT_CONTAINS"), _Entry("xs", "TENSOR_MATCH")]
    assert keep(entries) == [True] * 6 + [False] * 6


def test_a_backend_given_to_torch_compile_cannot_filter_and_says_so():
    backend = graphopt.Backend(graphopt.GraphOptimizationConfig(
        graph_opt_level=1, guards="inputs", use_cudagraph=False, cache_dir=None))
    torch.compile(Switch(), backend=backend)(torch.randn(4, 8))
    reasons = backend.report().reasons(FallbackKind.GUARDS)
    assert reasons and "guard_filter_fn" in reasons[0]  # the message users read: it names the fix


def test_unknown_guards_value_names_the_choices():
    with pytest.raises(ValueError, match="guards must be one of 'all', 'inputs'"):
        graphopt.GraphOptimizationConfig(graph_opt_level=1, guards="none")
    with pytest.raises(TypeError, match="guards must be"):
        graphopt.GraphOptimizationConfig(graph_opt_level=1, guards=True)


def test_generate_with_inputs_gives_eager_tokens_over_new_caches_and_batches():
    """A decoder's step takes a cache object: its guards are on an argument, so kept;
    each generate()'s new StaticCache and each batch still finds (or makes) its graph."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config).eval()
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(eager.state_dict())
    model.forward = graphopt.optimize(model.forward, graphopt.GraphOptimizationConfig(graph_opt_level=1,
        guards="inputs", max_num_seqs=4, cache_dir=None))

    def generate(m, ids):
        return m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                          do_sample=False, cache_implementation="static")

    for batch in (1, 2, 1, 3):
        ids = torch.randint(0, 128, (batch, 5), generator=torch.Generator().manual_seed(batch))
        assert torch.equal(generate(model, ids), generate(eager, ids)), f"batch {batch}"
    assert model.forward.report().replays > 0
