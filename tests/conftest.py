"""Shared fixtures: GPU-only tests skip without CUDA; Dynamo's caches are reset
between tests so one test's graphs and recompile counts never leak into another.
Each test gets a new, empty compile cache directory, so `optimize()` runs as it
does for a user by default (through stored traces, traces.py) and no test reads
what another stored; tests of Dynamo's own dispatch set `cache_dir=None`."""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo

from graphopt.models import Decoder, DecoderConfig

# Configs built while collecting (module level) get no cache; each test gets its own below.
os.environ["GRAPHOPT_CACHE_DIR"] = ""


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


@pytest.fixture(autouse=True)
def fresh_cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path_factory.mktemp("graphopt-cache")))


@pytest.fixture
def decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig.tiny()).eval()
