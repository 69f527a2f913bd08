#!/usr/bin/env bash
# Set up .venv with the test extras and run the test suite (GPU tests skip without CUDA).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" "[test]"
exec .venv/bin/python -m pytest "$@"
