"""The llama.cpp contender's adapter (bench/llamacpp.py) on a stand-in for llama-cpp-python
whose next token is always the last one plus 1: greedy decoding and the losses come out of
the logits llama.cpp leaves after each eval, one token a step."""

import ctypes
import sys
import types

import numpy as np
import torch

from graphopt.bench.llamacpp import LlamaCppStep

VOCAB = 16


class FakeLlama:
    """Holds the tokens evaluated since reset; its logits favour (last token + 1) % VOCAB."""

    def __init__(self, model_path, n_ctx, n_batch, n_threads, n_threads_batch, verbose):
        self.tokens: list[int] = []
        self.evals: list[list[int]] = []
        self.ctx = self
        self.row = np.zeros(VOCAB, dtype=np.float32)

    def n_vocab(self):
        return VOCAB

    def reset(self):
        self.tokens = []

    def eval(self, tokens):
        self.evals.append(list(tokens))
        self.tokens += tokens
        self.row[:] = 0
        self.row[(self.tokens[-1] + 1) % VOCAB] = 5.0


def fake_llama_cpp(monkeypatch):
    module = types.ModuleType("llama_cpp")
    module.Llama = FakeLlama
    module.llama_get_logits_ith = lambda ctx, i: ctx.row.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    monkeypatch.setitem(sys.modules, "llama_cpp", module)


def test_greedy_takes_the_prompt_in_one_eval_then_a_token_a_step(monkeypatch, tmp_path):
    fake_llama_cpp(monkeypatch)
    step = LlamaCppStep(tmp_path / "model.gguf", threads=2)
    tokens, first = step.greedy(torch.tensor([[3, 5]]), 4)
    assert tokens.tolist() == [[6, 7, 8, 9]]
    assert first.shape == (1, VOCAB) and first[0].argmax() == 6
    assert step.model.evals == [[3, 5], [6], [7], [8], [9]]
    again, _ = step.greedy(torch.tensor([[1]]), 2)  # reset between runs: no earlier context
    assert again.tolist() == [[2, 3]]


def test_losses_are_each_positions_cross_entropy_after_the_first(monkeypatch, tmp_path):
    fake_llama_cpp(monkeypatch)
    step = LlamaCppStep(tmp_path / "model.gguf", threads=2)
    ids = torch.tensor([[1, 2, 3, 9]])
    losses = step.losses(ids)
    row = torch.zeros(VOCAB)
    row[0] = 5.0
    expected = [torch.nn.functional.cross_entropy(row.roll(k).unsqueeze(0), torch.tensor([t])).item()
                for k, t in ((2, 2), (3, 3), (4, 9))]
    assert torch.allclose(losses, torch.tensor(expected))
    assert losses[0] < 0.1 and losses[2] > 4.0
