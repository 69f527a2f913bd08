# Sourced by the other scripts: create .venv and install graphopt into it.
# torch is pinned through constraints.txt to the CPU build this project's machines
# carry on disk; the package itself accepts any torch >= 2.11.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".${extras}"
