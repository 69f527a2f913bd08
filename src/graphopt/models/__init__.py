"""Reference models: a Llama-style decoder with a slot KV cache, greedy generation, and a small ResNet."""

from .decoder import Decoder, DecoderConfig
from .generate import generate
from .resnet import ResNet, ResNetConfig

__all__ = ["Decoder", "DecoderConfig", "ResNet", "ResNetConfig", "generate"]
