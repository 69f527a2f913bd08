"""Whom the compile cache trusts (cache_trust.py): a directory others can write is
refused whole, an entry whose signature does not match is never unpickled, and a
normal second start still loads what the first stored."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from cache_starts import PROMPTS, Filled, copy_filled, fill, run
from support import cache_entries

from graphopt import FallbackKind, cache_trust
from graphopt.models import generate

POSIX_OWNERS = pytest.mark.skipif(not hasattr(os, "getuid"), reason="needs POSIX owners and modes")


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> Filled:
    """A good entry, stored while the directory was this user's alone."""
    return fill(tmp_path_factory)


class Planted:
    """A payload that creates a file when unpickled: proof that it was."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


@POSIX_OWNERS
@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_directory_others_can_write_is_refused(decoder, filled, tmp_path, mode):
    cache_dir = copy_filled(filled, tmp_path / "cache")
    stored = cache_entries(cache_dir)
    cache_dir.chmod(mode)
    tokens, report = run(decoder, cache_dir)
    assert torch.equal(tokens, generate(decoder, PROMPTS, 6))
    assert (report.cache_hits, report.cache_rebuilt) == (0, 0)
    assert report.fallback_counts[FallbackKind.CACHE_OFF] >= 1
    [reason] = report.reasons(FallbackKind.CACHE_OFF)  # the message users read: it names the fix
    assert f"{cache_dir} is writable by" in reason and f"chmod go-w {cache_dir}" in reason
    assert cache_entries(cache_dir) == stored  # nothing written into it either
    cache_dir.chmod(0o700)
    _, trusted = run(decoder, cache_dir)
    assert trusted.cache_hits == 1


def test_a_tampered_entry_is_refused_before_unpickling(decoder, filled, tmp_path):
    cache_dir = copy_filled(filled, tmp_path / "cache")
    [entry] = cache_entries(cache_dir)
    header, _, _ = entry.read_bytes().partition(b"\n")
    marker = tmp_path / "unpickled"
    # The header of the real entry (its key, versions and signature) over another payload.
    entry.write_bytes(header + b"\n" + pickle.dumps(Planted(str(marker))))
    tokens, report = run(decoder, cache_dir)
    assert not marker.exists()
    assert torch.equal(tokens, generate(decoder, PROMPTS, 6))
    assert (report.cache_hits, report.cache_rebuilt) == (0, 1)
    [reason] = report.reasons(FallbackKind.CACHE_NOT_LOADED)
    assert str(entry) in reason and "signature does not match" in reason
    _, again = run(decoder, cache_dir)
    assert again.cache_hits == 1


def test_an_entry_signed_with_another_key_is_refused(decoder, filled, tmp_path):
    """A cache copied from elsewhere, header and all, but signed with that place's key."""
    cache_dir = copy_filled(filled, tmp_path / "cache")
    [entry] = cache_entries(cache_dir)
    header, _, body = entry.read_bytes().partition(b"\n")
    fields = json.loads(header)
    fields["hmac"] = cache_trust.sign(b"k" * 32, fields["key"], body)
    entry.write_bytes(json.dumps(fields).encode() + b"\n" + body)
    _, report = run(decoder, cache_dir)
    assert (report.cache_hits, report.cache_rebuilt) == (0, 1)


@POSIX_OWNERS
def test_a_signing_key_others_can_read_is_refused(decoder, filled, tmp_path):
    assert (filled.directory / cache_trust.KEY_FILE).stat().st_mode & 0o777 == 0o600  # as the first start made it
    cache_dir = copy_filled(filled, tmp_path / "cache")
    key = cache_dir / cache_trust.KEY_FILE
    key.chmod(0o644)
    _, report = run(decoder, cache_dir)
    assert report.cache_hits == 0
    assert any(str(key) in r for r in report.reasons(FallbackKind.CACHE_OFF))


def test_a_normal_round_trip_still_hits(decoder, filled, tmp_path):
    assert filled.directory.stat().st_mode & 0o777 == 0o700  # the first start made it for this user alone
    cache_dir = copy_filled(filled, tmp_path / "new")
    tokens, report = run(decoder, cache_dir)
    assert torch.equal(tokens, generate(decoder, PROMPTS, 6))
    assert (report.cache_hits, report.cache_misses) == (1, 0) and not report.fallbacks


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_directory_another_user_owns_is_refused(decoder, filled, tmp_path):
    cache_dir = copy_filled(filled, tmp_path / "cache")
    os.chown(cache_dir, 65534, 65534)
    _, report = run(decoder, cache_dir)
    assert report.cache_hits == 0
    assert any("uid 65534" in r for r in report.reasons(FallbackKind.CACHE_OFF))
