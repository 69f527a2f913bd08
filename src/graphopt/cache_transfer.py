"""Sharing a compile cache between machines of one kind (`graphopt cache export` /
`import`): a second machine starts warm from the first one's entries.

    export: archive = every entry of the cache whose signature this cache's key
            verifies, as written, and a manifest (each entry's sha256, the versions)
    import: each entry the manifest lists, unchanged, that this graphopt, torch,
            Python and CPU could load, signed again with this cache's key

An entry written for another graphopt, torch, Python or CPU model is refused with its
reason (logged and returned), never imported. The signing key stays behind: an archive
carries no trust, and importing one is trusting whoever made it, as copying the
directory would be (docs/compile-cache.md).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from . import cache, cache_trust
from .report import Report

log = logging.getLogger("graphopt")
MANIFEST = "graphopt-cache.json"
_ENTRY = re.compile(r"^[0-9a-f]{2}/[0-9a-f]{64}$")  # <key[:2]>/<key>, as CompileCache.path names it


@dataclass
class Transfer:
    """What an export or import did: the entries it moved, those it refused and why."""

    moved: int = 0
    refused: dict[str, str] = field(default_factory=dict)  # entry -> reason


def entries(directory: Path) -> list[Path]:
    """The entries of a cache directory (not its key, nor a writer's temporary file)."""
    found = (p for p in directory.glob("??/*") if p.is_file())
    return sorted(p for p in found if _ENTRY.match(f"{p.parent.name}/{p.name}"))


def export(directory: str | os.PathLike, archive: str | os.PathLike) -> Transfer:
    """Write the entries of the cache `directory` that its key verifies to `archive`
    (a .tar.gz). Raises cache_trust.Untrusted for a directory the cache would refuse."""
    directory, done = Path(directory), Transfer()
    cache_trust.check_directory(directory)
    key = cache_trust.signing_key(directory)
    manifest = {"format": cache.FORMAT, **cache.versions(), "entries": {}}
    with tarfile.open(archive, "w:gz") as tar:
        for path in entries(directory):
            name, data = f"{path.parent.name}/{path.name}", path.read_bytes()
            try:
                header, body = cache.split_entry(data, path.name)
            except ValueError as why:
                _refuse(done, name, str(why), "export")
                continue
            if not cache_trust.verify(key, path.name, body, header.get("hmac")):
                _refuse(done, name, "its signature does not match this cache's key", "export")
                continue
            _add(tar, name, data)
            manifest["entries"][name] = hashlib.sha256(data).hexdigest()
            done.moved += 1
        _add(tar, MANIFEST, json.dumps(manifest, indent=1).encode())
    return done


def import_(archive: str | os.PathLike, directory: str | os.PathLike) -> Transfer:
    """Add the entries of `archive` that this process could load to the cache
    `directory`, signed with its key. Raises ValueError for a file that is not an
    export, cache_trust.Untrusted or OSError where the directory cannot be written."""
    directory, done = Path(directory), Transfer()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    cache_trust.check_directory(directory)
    report = Report(0)
    target = cache.CompileCache(directory, report)
    with tarfile.open(archive, "r:*") as tar:
        listed = _manifest(tar)
        for name, digest in listed.items():
            data = _member(tar, name)
            try:
                if data is None or hashlib.sha256(data).hexdigest() != digest:
                    raise ValueError("missing from the archive or not what the manifest lists (truncated?)")
                _, body = cache.split_entry(data, name.split("/")[1])
            except ValueError as why:
                _refuse(done, name, str(why), "import")
                continue
            target.write(name.split("/")[1], body)
            done.moved += 1
    if report.fallbacks:
        raise OSError("; ".join(report.fallbacks))
    return done


def _manifest(tar: tarfile.TarFile) -> dict[str, str]:
    data = _member(tar, MANIFEST)
    try:
        listed = json.loads(data)["entries"] if data is not None else None
    except (ValueError, KeyError, TypeError):
        listed = None
    if not isinstance(listed, dict):
        raise ValueError(f"{tar.name} is not a graphopt cache export (no {MANIFEST}); make one with "
                         "`graphopt cache export PATH`")
    return {name: digest for name, digest in listed.items() if isinstance(name, str) and _ENTRY.match(name)}


def _member(tar: tarfile.TarFile, name: str) -> bytes | None:
    """A regular file's bytes; never a link or a path outside the archive's names."""
    try:
        member = tar.getmember(name)
    except KeyError:
        return None
    handle = tar.extractfile(member) if member.isreg() else None
    return handle.read() if handle is not None else None


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o600
    tar.addfile(info, io.BytesIO(data))


def _refuse(done: Transfer, name: str, reason: str, action: str) -> None:
    done.refused[name] = reason
    log.warning("graphopt cache %s: refused %s: %s", action, name, reason)
