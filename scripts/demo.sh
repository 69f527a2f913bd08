#!/usr/bin/env bash
# Set up the venv and run `graphopt demo`: the reference decoder, eager against every level.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" ""
exec "$venv/bin/graphopt" demo "$@"
