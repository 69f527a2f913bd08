"""A C++ build killed mid-way leaves torch's build lock behind; the next process must
build again instead of waiting on it forever."""

from __future__ import annotations

import os
import time

from graphopt._compat import autotune
from graphopt.kernels import native


def test_a_lock_older_than_any_build_is_removed_and_a_recent_one_kept(tmp_path, caplog):
    stale, recent = tmp_path / "stale.lock", tmp_path / "recent.lock"
    stale.write_text("")
    recent.write_text("")
    old = time.time() - native.STALE_LOCK_SECONDS - 60
    os.utime(stale, (old, old))
    native._remove_stale_lock(str(stale))
    native._remove_stale_lock(str(recent))
    native._remove_stale_lock(str(tmp_path / "absent.lock"))
    assert not stale.exists() and recent.exists()
    assert "left 16 minutes ago by a build that did not finish" in caplog.text


def test_the_lock_is_where_torchs_loader_puts_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert autotune.extension_build_lock("graphopt_x") == os.path.join(tmp_path, "graphopt_x", "lock")


def test_a_kernel_built_before_is_loaded_without_torchs_loader(monkeypatch):
    from torch.utils import cpp_extension

    from graphopt.runtime import native_tape

    _, error = native.build("graphopt_tape", native_tape.SOURCE, ["-O2"])
    assert error is None

    def load(*args, **kwargs):
        raise AssertionError("torch's loader ran for a kernel already built")

    monkeypatch.setattr(cpp_extension, "load", load)
    module, error = native.build("graphopt_tape", native_tape.SOURCE, ["-O2"])
    assert error is None and hasattr(module, "Tape")
