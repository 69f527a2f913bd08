"""llama.cpp as a contender on a workload loaded from a GGUF file: the same file, read by
llama.cpp with its own kernels (llama-cpp-python), on the bench's thread count.

    greedy(ids, n):  the prompt in one batch, then n tokens one a step -> (tokens, the first one's logits)
    losses(ids):     -log p(token | the tokens before it), one token a step

The checkpoint cases (checkpoints.py) call these where a torch contender runs the model:
the same token ids in, the same outputs out, so llama.cpp's rows are judged as graphopt's
lowered ones are (next-token KL, greedy-token agreement, perplexity).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON '
         '-DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON" pip install llama-cpp-python')
# Logits are read one row at a time, so the context's own logits buffer needs few rows.
BATCH = 32
CONTEXT = 1024


class LlamaCppStep:
    """One llama.cpp context on `path`, with `threads` threads for decode and prompt alike."""

    def __init__(self, path: Path, threads: int) -> None:
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.model = llama_cpp.Llama(model_path=str(path), n_ctx=CONTEXT, n_batch=BATCH, n_threads=threads,
                                     n_threads_batch=threads, verbose=False)
        self.vocab = self.model.n_vocab()

    def greedy(self, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`new_tokens` greedy tokens after the prompt `ids` ([1, n]), and the logits ([1, vocab])
        the first was picked from, as generate()'s case returns them."""
        self.model.reset()
        first = logits = self._eval(ids[0].tolist())
        tokens = []
        for _ in range(new_tokens):
            tokens.append(int(logits.argmax()))
            logits = self._eval(tokens[-1:])
        return torch.tensor([tokens]), first.unsqueeze(0)

    def losses(self, ids: torch.Tensor) -> torch.Tensor:
        """Each position's loss after the first, one token a step, as the decode graph serves them."""
        self.model.reset()
        tokens = ids[0].tolist()
        logits = torch.stack([self._eval([t]) for t in tokens[:-1]])
        return torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")

    def _eval(self, tokens: list[int]) -> torch.Tensor:
        """The logits after the last of `tokens`, in float32 (a copy: llama.cpp reuses its buffer)."""
        self.model.eval(tokens)
        row = self.llama_cpp.llama_get_logits_ith(self.model.ctx, -1)
        return torch.from_numpy(np.ctypeslib.as_array(row, shape=(self.vocab,)).copy())
