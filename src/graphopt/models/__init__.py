"""Reference models: a Llama-style decoder with a slot KV cache (and its tensor-parallel form),
greedy generation, and a small ResNet."""

from .decoder import Decoder, DecoderConfig
from .generate import generate
from .parallel import ParallelDecoder
from .resnet import ResNet, ResNetConfig

__all__ = ["Decoder", "DecoderConfig", "ParallelDecoder", "ResNet", "ResNetConfig", "generate"]
