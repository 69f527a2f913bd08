"""Starts of the tiny decoder through the compile cache, for the tests of the compile
cache and of whom it trusts: `run` is one start, as a new process would make it, and
`fill` a cache one such start filled (a test module's module-scoped fixture), which a
test copies (`copy_filled`) before it reads or changes it: most of these tests are about a second
start, and the first start's compile is the same in each of them."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch._dynamo

import graphopt
from graphopt.models import Decoder, DecoderConfig, generate

PROMPTS = torch.randint(500, (3, 6), generator=torch.Generator().manual_seed(0))


def run(decoder, cache_dir, **config) -> tuple[torch.Tensor, graphopt.Report]:
    """Generate with a fresh optimized step, as a new process would."""
    torch._dynamo.reset()
    cfg = graphopt.GraphOptimizationConfig(**{"graph_opt_level": 1, "cache_dir": str(cache_dir), "use_cudagraph": False,
                                              "cache_traces": False, **config})
    step = graphopt.optimize(decoder, cfg, pad_values={"slots": decoder.scratch_slot})
    return generate(decoder, PROMPTS, 6, step=step), step.report()


@dataclass(frozen=True)
class Filled:
    """A cache directory a first `run` made and filled (never changed after), with that
    start's tokens and report."""

    directory: Path
    tokens: torch.Tensor
    report: graphopt.Report


def fill(tmp_path_factory: pytest.TempPathFactory) -> Filled:
    torch.manual_seed(0)  # the weights of conftest's `decoder`
    decoder = Decoder(DecoderConfig.tiny()).eval()
    directory = tmp_path_factory.mktemp("filled") / "cache"
    tokens, report = run(decoder, directory)
    torch._dynamo.reset()
    return Filled(directory, tokens, report)


def copy_filled(filled: Filled, target: Path) -> Path:
    """A copy of the filled cache at `target` (modes kept: the signing key's, the directory's)."""
    shutil.copytree(filled.directory, target)
    return target


class Kept:
    """A cache directory a first start filled, put back as it was at the same path for
    each test that reads it (a stored trace is found under its own cache_dir only: the
    config is in its key). A module-scoped fixture makes one; its tests run one at a time."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.pristine = directory.with_name(directory.name + ".pristine")
        shutil.copytree(directory, self.pristine)

    def restore(self) -> Path:
        shutil.rmtree(self.directory, ignore_errors=True)
        shutil.copytree(self.pristine, self.directory)
        return self.directory
