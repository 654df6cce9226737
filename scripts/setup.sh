#!/usr/bin/env bash
# Installs everything fsdpp needs on a fresh Debian machine, idempotently: the Debian
# packages for the C++ build and a project-local venv holding the torch wheel (LibTorch)
# plus the Python references used by tests and data scripts. Takes seconds when done.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# libgloo-dev: the torch wheel exports ProcessGroupGloo but ships no Gloo headers.
# clang and libclang-rt-14-dev: libFuzzer and the sanitizers for the fuzz targets.
# libprotobuf-dev and protobuf-compiler: TensorBoard's event records; libcli11-dev: the
# command line. python3-dev: the headers the Python module (bindings/python) compiles against.
debs=(liblua5.4-dev libgloo-dev libtomlplusplus-dev libspdlog-dev catch2 nlohmann-json3-dev ccache
      cmake ninja-build g++ python3-venv procps clang libclang-rt-14-dev libprotobuf-dev protobuf-compiler
      libcli11-dev python3-dev)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# torchvision: transformers' video processor (scripts/make_multimodal.py) needs it.
py_pins=(torch==2.11.0 torchvision==0.26.0 transformers==5.24.0 tokenizers==0.23.3 peft==0.21.2 safetensors numpy
         pillow crc32c==2.7.1 pyarrow==26.0.1 tensorboard==2.21.0 tqdm)
stamp=.venv/.fsdpp-setup-$(printf '%s\n' "${py_pins[@]}" | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  echo "setup: installing Python packages into .venv: ${py_pins[*]}"
  .venv/bin/pip install -q --disable-pip-version-check "${py_pins[@]}"
  touch "$stamp"
fi
