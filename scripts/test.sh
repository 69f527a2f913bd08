#!/usr/bin/env bash
# Set up the venv with the test extras and run the test suite (GPU tests are skipped
# without CUDA). GRAPHOPT_TORCH=newest runs it on the newest torch (see setup.sh).
# pytest-xdist spreads the tests over GRAPHOPT_TEST_WORKERS processes (default: one a
# core; 0 runs them in this process), each with one intra-op thread so that the
# workers do not fight over the cores.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" "[test]"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$venv/bin/python" -m pytest -n "${GRAPHOPT_TEST_WORKERS:-auto}" --dist worksteal "$@"
