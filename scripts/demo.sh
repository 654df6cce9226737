#!/usr/bin/env bash
# Everything from a fresh machine to a trained model: installs dependencies, builds,
# makes the corpus, and trains the default example (examples/tiny-llama.toml) on the CPU.
# Extra arguments go to `fsdpp train` (e.g. --set train.steps=100).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./scripts/setup.sh
./scripts/build.sh fsdpp
bash scripts/make_corpus.sh
rm -rf runs/tiny-llama  # the demo's own run directory: each demo trains afresh
./build/fsdpp train examples/tiny-llama.toml "$@"
./build/fsdpp eval examples/tiny-llama.toml --set model.path=runs/tiny-llama/model
