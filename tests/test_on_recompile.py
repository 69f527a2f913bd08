"""on_recompile: "recompile" (default), "warn" once per guard, "error" naming the guard and its value."""

import warnings

import pytest
import torch
from support import Switch

import graphopt


def run(policy, **kw):
    torch.manual_seed(0)
    model = Switch().eval()
    kw.setdefault("graph_opt_level", 1)
    opt = graphopt.optimize(model, graphopt.GraphOptimizationConfig(on_recompile=policy, max_num_seqs=8, **kw))
    with torch.no_grad():
        for batch in (4, 3, 1, 4):  # batch 1's own graph (0/1 specialisation) is never refused
            opt(torch.randn(batch, 8))
    return model, opt


def test_the_default_recompiles_and_counts_the_guard():
    model, opt = run("recompile", cache_dir=None)  # stored traces choose among their traces without Dynamo's words
    model.act = "tanh"
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), torch.tanh(model.lin(x)))
    reasons = opt.report().recompile_reasons
    assert any(reason.startswith("self.act == 'relu'") for reason in reasons)


def test_warn_warns_once_per_guard():
    model, opt = run("warn")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.act = "tanh"
        opt(torch.randn(4, 8))
        model.act = "relu"
        opt(torch.randn(4, 8))  # the graph for relu is still there: no recompile
    said = [str(w.message) for w in caught if "guard of a compiled step failed" in str(w.message)]
    assert len(said) == 1 and "self.act == 'relu'" in said[0] and "(the value now: 'tanh')" in said[0]


def test_error_names_the_guard_and_the_value_and_leaves_the_model_usable():
    model, opt = run("error")
    model.act = "tanh"
    with torch.no_grad(), pytest.raises(graphopt.RecompileError) as raised:
        opt(torch.randn(4, 8))
    message = str(raised.value)
    assert "self.act == 'relu'" in message and "(the value now: 'tanh')" in message
    assert "a Python value forward reads (an attribute, a flag, a global) changed" in message
    assert raised.value.guard.startswith("self.act == 'relu'")
    model.act = "relu"
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), torch.relu(model.lin(x)))


MODES = {"act": "relu"}


class GlobalSwitch(torch.nn.Module):
    """A linear then the activation a module global's item names."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return torch.relu(y) if MODES["act"] == "relu" else torch.tanh(y)


def test_error_reads_the_value_of_a_global_item(monkeypatch):
    """The value is read by walking the guard's source (a global, an item), never by
    evaluating its text."""
    monkeypatch.setitem(MODES, "act", "relu")
    opt = graphopt.optimize(GlobalSwitch().eval(), graphopt.GraphOptimizationConfig(
        graph_opt_level=1, on_recompile="error"))
    with torch.no_grad():
        opt(torch.randn(4, 8))
        MODES["act"] = "tanh"
        with pytest.raises(graphopt.RecompileError) as raised:
            opt(torch.randn(4, 8))
    assert "MODES" in raised.value.guard and "(the value now: 'tanh')" in str(raised.value)


def test_on_recompile_is_validated():
    with pytest.raises(ValueError, match="on_recompile must be one of 'recompile', 'warn', 'error'"):
        graphopt.GraphOptimizationConfig(graph_opt_level=1, on_recompile="fail")
