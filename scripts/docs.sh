#!/usr/bin/env bash
# Set up the venv with the docs extra and build the docs site strictly (a broken link,
# anchor or API reference fails): ./scripts/docs.sh builds into build/site/,
# ./scripts/docs.sh serve [mkdocs serve options] previews it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" "[docs]"
export NO_MKDOCS_2_WARNING=1  # Material's banner about its successor, on every run
if [ "${1:-}" = serve ]; then
    shift
    exec "$venv/bin/mkdocs" serve --strict "$@"
fi
exec "$venv/bin/mkdocs" build --strict "$@"
