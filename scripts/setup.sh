# Sourced by the other scripts: create a venv and install graphopt into it; sets $venv.
# The package accepts any torch >= 2.11. By default (GRAPHOPT_TORCH=pinned) the venv
# is .venv and torch is pinned through constraints.txt to the CPU build this project's
# machines carry on disk. GRAPHOPT_TORCH=newest uses .venv-newest, without the pin,
# and upgrades torch to the newest release pip resolves. GRAPHOPT_TORCH=oldest uses
# .venv-oldest with the oldest torch the package accepts (2.11.0, a CUDA build that
# runs on the CPU, as on the project's GPU machine). Both are CUDA builds of several GB,
# downloaded: pip keeps no second copy of them in its cache.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras="${1:-}"
# --no-compile: Python compiles a module when it is first imported; pip would compile all
# of torch's and transformers' tens of thousands of modules up front.
pip=(--quiet --disable-pip-version-check --no-compile)
case "${GRAPHOPT_TORCH:-pinned}" in
    pinned) venv=.venv; pin=(-c constraints.txt) ;;
    newest) venv=.venv-newest; pin=(); pip+=(--no-cache-dir) ;;
    oldest) venv=.venv-oldest; pin=(torch==2.11.0); pip+=(--no-cache-dir) ;;
    *) echo "GRAPHOPT_TORCH=${GRAPHOPT_TORCH}: expected 'pinned', 'newest' or 'oldest'" >&2; exit 2 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
# A venv installed from this pyproject.toml and constraints.txt, with these extras, is not
# installed again (a few seconds of pip for every test run); the newest torch always is.
stamp="$venv/graphopt-setup-${extras//[^a-z]/}"
wanted=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum)
if [ "$venv" = .venv-newest ] || [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    # torch first, outside the lock below: its download (minutes for a CUDA build) must
    # not hold up the other venvs' installs.
    if [ "$venv" = .venv-newest ]; then
        "$venv/bin/python" -m pip install "${pip[@]}" --upgrade torch
    elif [ "$venv" = .venv-oldest ]; then
        "$venv/bin/python" -m pip install "${pip[@]}" "${pin[@]}"
    fi
    # The editable install writes src/graphopt.egg-info: one at a time when CI sets up
    # the three venvs at once.
    lock=()
    if command -v flock >/dev/null; then lock=(flock scripts/setup.sh); fi
    "${lock[@]}" "$venv/bin/python" -m pip install "${pip[@]}" "${pin[@]}" -e ".${extras}"
    echo "$wanted" >"$stamp"
fi
echo "$venv: torch $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')" >&2
# Compiled modules, kept in the venv: where PYTHONDONTWRITEBYTECODE is set (this project's
# development machine sets it) every process compiled torch's, transformers' and graphopt's
# modules from source again at import, about 8 s of CPU a process; the suite starts many
# (its workers, the tests of a fresh process, level "auto"'s child compiles).
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$PWD/$venv/pycache"
