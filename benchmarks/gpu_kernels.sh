#!/usr/bin/env bash
# On a machine with one NVIDIA GPU and the project installed (make install SMOE_EXTRA=gpu):
# the shuffle kernels against their torch references, and their achieved bandwidth.
# Has NOT run yet: no GPU was available to the sessions that wrote it (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
timeout 300 "$BIN/smoe-bench" kernels "$@"
