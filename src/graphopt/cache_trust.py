"""Whom the compile cache trusts: entries are pickles, so loading one runs what it holds.

An entry is loaded only from a directory the current user owns and nobody else can
write (as ssh treats `~/.ssh`), and only when its HMAC-SHA256 signature, made with a
key that lives in that directory (`signing.key`, mode 0600), matches; the signature is
checked before anything is unpickled. A directory that fails the check is refused
whole: nothing is read from it or written to it.

Why a key in the directory rather than a sha256 index of the entries: an index is one
file every writer must rewrite (a lock, or lost updates between processes), and it
proves nothing a writer of the directory could not forge; a signature needs no shared
state, and an entry written without the key (copied in, edited, planted while the
directory was open to others) is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path

KEY_FILE = "signing.key"
_KEY_BYTES = 32


class Untrusted(Exception):
    """Why a cache directory (or its key) is not trusted, and what to do about it."""


def check_directory(directory: Path) -> None:
    """Raise Untrusted unless `directory` is owned by this user and only they can write it."""
    if not hasattr(os, "getuid"):  # no POSIX owners (Windows): the signatures still hold
        return
    info = os.stat(directory)
    if info.st_uid != os.getuid():
        raise Untrusted(f"{directory} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}); "
                        "point cache_dir (or $GRAPHOPT_CACHE_DIR) at a directory you own")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "its group and others" if info.st_mode & stat.S_IWOTH and info.st_mode & stat.S_IWGRP else \
            "others" if info.st_mode & stat.S_IWOTH else "its group"
        raise Untrusted(f"{directory} is writable by {who} (mode {stat.S_IMODE(info.st_mode):o}); "
                        f"run `chmod go-w {directory}` or point cache_dir at a directory only you can write")


def signing_key(directory: Path) -> bytes:
    """The directory's signing key, made on first use. Raises Untrusted for a key
    another user owns or others can read or write, OSError where it cannot be made."""
    path = directory / KEY_FILE
    if not path.exists():
        _make_key(path)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    handle = os.open(path, flags)
    try:
        info = os.fstat(handle)
        key = os.read(handle, _KEY_BYTES + 1)
    finally:
        os.close(handle)
    if hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & 0o077):
        raise Untrusted(f"its signing key {path} is not this user's alone (uid {info.st_uid}, mode "
                        f"{stat.S_IMODE(info.st_mode):o}); delete it (the cache is then compiled anew)")
    if len(key) != _KEY_BYTES:
        raise Untrusted(f"its signing key {path} is not a graphopt key; delete it (the cache is then "
                        "compiled anew)")
    return key


def _make_key(path: Path) -> None:
    """Write a new key beside `path` (mkstemp makes it 0600) and link it into place:
    of two processes making one at once, the first link wins and both read its key."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".key.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(secrets.token_bytes(_KEY_BYTES))
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(temporary)


def sign(key: bytes, entry_key: str, body: bytes) -> str:
    """The signature of one entry: its cache key and its payload."""
    return hmac.new(key, entry_key.encode() + b"\0" + body, hashlib.sha256).hexdigest()


def verify(key: bytes, entry_key: str, body: bytes, signature: object) -> bool:
    return isinstance(signature, str) and hmac.compare_digest(sign(key, entry_key, body), signature)
