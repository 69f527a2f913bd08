"""Reference models: a Llama-style decoder with a slot KV cache, and greedy generation."""

from .decoder import Decoder, DecoderConfig
from .generate import generate

__all__ = ["Decoder", "DecoderConfig", "generate"]
