#!/usr/bin/env bash
# Downloads, on a machine with Debian's package mirror, the Debian packages fsdpp builds
# against into .gpu-deps/ (git-ignored), for a GPU machine that has CUDA, PyTorch, CMake
# and ninja but no package manager or network: scripts/gpu_check.sh unpacks them there
# into a private prefix. Idempotent: packages already downloaded are kept.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# The headers and libraries of scripts/setup.sh's build packages, with the shared
# libraries they link to; compilers and build tools are the GPU machine's own.
packages=(liblua5.4-dev liblua5.4-0 libgloo-dev libtomlplusplus-dev libtomlplusplus3 libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
          catch2 nlohmann-json3-dev libprotobuf-dev libprotobuf32 protobuf-compiler libprotoc32
          libcli11-dev)
mkdir -p .gpu-deps
cd .gpu-deps
missing=()
for p in "${packages[@]}"; do
  compgen -G "${p}_*.deb" >/dev/null || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  apt-get download -qq "${missing[@]}"
fi
echo "gpu-deps: $(ls ./*.deb | wc -l) packages in .gpu-deps/"
