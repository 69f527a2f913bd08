#!/usr/bin/env bash
# Set up the venv with the test extras and run the test suite (GPU tests are skipped
# without CUDA). GRAPHOPT_TORCH=newest runs it on the newest torch (see setup.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" "[test]"
exec "$venv/bin/python" -m pytest "$@"
