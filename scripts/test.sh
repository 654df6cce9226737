#!/usr/bin/env bash
# Installs dependencies, builds everything, and runs the whole test suite with ctest.
# Tests run two at a time; each test process uses one intra-op thread. Their temporary files
# go to one directory of this run's, removed when every test passes and kept when one fails.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./scripts/setup.sh
./scripts/build.sh
export OMP_NUM_THREADS=1
TMPDIR="$(mktemp -d "${TMPDIR:-/tmp}/fsdpp-tests.XXXXXX")"
export TMPDIR
ctest --test-dir build --output-on-failure -j 2 "$@" || {
  status=$?
  echo "test.sh: the tests' temporary files are kept in $TMPDIR" >&2
  exit "$status"
}
rm -rf "$TMPDIR"
