"""Greedy generation with the reference decoder: one prefill, then one decode step per token."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .decoder import Decoder

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def generate(
    model: Decoder,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    step: Step | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedily decode ``max_new_tokens`` tokens after each prompt; returns ``[b, max_new_tokens]``.

    ``prompt_ids [b, t]`` are prefilled into cache rows ``slots`` (default ``0..b-1``), which
    are zeroed first. Every later token comes from ``step(input_ids [b], positions [b],
    slots [b])`` -- ``model`` itself by default, or an optimized version of its forward that
    shares the model's cache buffers.
    """
    config = model.config
    if prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids must be 2-D [batch, prompt_len], got shape {tuple(prompt_ids.shape)}; "
                         "for a single prompt pass prompt_ids[None]")
    b, t = prompt_ids.shape
    if b == 0 or t == 0:
        raise ValueError(f"prompt_ids of shape {tuple(prompt_ids.shape)} is empty; give at least one "
                         "prompt of at least one token")
    if b > config.max_num_seqs:
        raise ValueError(f"{b} prompts exceed max_num_seqs={config.max_num_seqs} cache slots; split the "
                         "batch or build the model with a larger max_num_seqs")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if t + max_new_tokens > config.max_seq_len:
        raise ValueError(f"prompt length {t} + max_new_tokens {max_new_tokens} exceeds max_seq_len="
                         f"{config.max_seq_len}; shorten the prompt, ask for fewer tokens or build the "
                         "model with a larger max_seq_len")
    device = prompt_ids.device
    if slots is None:
        slots = torch.arange(b, device=device)
    elif slots.shape != (b,):
        raise ValueError(f"slots must have shape ({b},), one cache row per prompt, got {tuple(slots.shape)}")
    elif slots.min() < 0 or slots.max() >= config.max_num_seqs or slots.unique().numel() != b:
        raise ValueError(f"slots must be distinct cache rows in [0, {config.max_num_seqs}), got "
                         f"{slots.tolist()}; row {model.scratch_slot} is the scratch slot for padding")
    step = model if step is None else step

    with torch.inference_mode():
        model.reset_cache(slots)
        positions = torch.arange(t, device=device).expand(b, t)
        token = model.prefill(prompt_ids, positions, slots)[:, -1].argmax(-1)
        tokens = [token]
        for position in range(t, t + max_new_tokens - 1):
            token = step(token, torch.full((b,), position, device=device), slots).argmax(-1)
            tokens.append(token)
    return torch.stack(tokens, dim=1)
