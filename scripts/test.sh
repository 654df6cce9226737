#!/usr/bin/env bash
# Installs dependencies, builds everything, and runs the whole test suite with ctest.
# Tests run two at a time; each test process uses one intra-op thread.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./scripts/setup.sh
./scripts/build.sh
export OMP_NUM_THREADS=1
ctest --test-dir build --output-on-failure -j 2 "$@"
