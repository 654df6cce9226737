#!/usr/bin/env bash
# Configures (once) and builds fsdpp into build/ with ccache and -j2: LibTorch units are
# memory-hungry, and two parallel compiles are what a 2-core, 24 GiB machine sustains.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ ! -f build/build.ninja ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
ninja -C build -j "${FSDPP_JOBS:-2}" "$@"
# The venv's Python finds the fsdpp package where the build puts it.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$root/build/python" >"$site/fsdpp-build.pth"
