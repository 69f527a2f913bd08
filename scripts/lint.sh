#!/usr/bin/env bash
# The linter: ruff with the house's small rule set (pyproject.toml, [tool.ruff]).
# It installs itself into .venv-lint, beside the test venvs, so it needs no torch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv-lint/bin/ruff ]; then
    python3 -m venv .venv-lint
    .venv-lint/bin/python -m pip install --quiet --disable-pip-version-check "ruff==0.17.6"
fi
if [ "$#" -eq 0 ]; then set -- src tests benchmarks; fi
exec .venv-lint/bin/ruff check "$@"
