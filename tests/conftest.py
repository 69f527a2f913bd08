"""Shared fixtures: GPU-only tests skip without CUDA; Dynamo's caches are reset
between tests so one test's graphs and recompile counts never leak into another,
and graphopt's compile cache is off unless a test turns it on (tests/test_cache.py),
so no test reads what an earlier run stored. GRAPHOPT_TEST_CACHE_DIR=<new dir>
runs the suite with the cache and its stored traces on instead (.ci/run does,
for the end-to-end files)."""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo

from graphopt.models import Decoder, DecoderConfig

os.environ["GRAPHOPT_CACHE_DIR"] = os.environ.get("GRAPHOPT_TEST_CACHE_DIR", "")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig.tiny()).eval()
