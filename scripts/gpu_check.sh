#!/usr/bin/env bash
# The GPU checks, run on a GPU machine that has CUDA, PyTorch (python3), CMake and ninja but
# no Debian packages or network. Carry .gpu-deps/ (scripts/gpu_deps.sh fills it) and, where
# the machine has no /usr/share/common-licenses, data/ (scripts/make_corpus.sh).
#   gpu_check.sh build    unpacks .gpu-deps/ into a private prefix and builds build-gpu/fsdpp
#                         and the unit tests against python3's torch; the configure fails
#                         without CUDA or NCCL
#   gpu_check.sh units    builds, then runs the unit tests tagged [gpu] on the GPU, which
#                         then fail where none is visible: the copy stream, experts in one
#                         grouped GEMM, and packed documents through the variable-length
#                         flash kernel, each against a computation that avoids it
#   gpu_check.sh parity   trains tests/assets/fsdp-llama.toml on the GPU (fp32, fp32 with
#                         offloaded masters, bf16 compute) and compares each with a CPU run
#                         whose bound comes from the CPU's own measured rounding noise
#   gpu_check.sh bench [plain|checkpoint|offload|moe|SHAPE ...]
#                         scripts/bench_fsdp.py on the GPU, fsdpp against PyTorch's
#                         fully_shard: the 1B Llama plain, with activation checkpointing,
#                         offloaded (fsdpp twice: host updates overlapped with the next
#                         forward and in the step), and the 1.4B Qwen3-MoE (all four unless named). A SHAPE
#                         (llama-3.2-1b, llama-3.2-3b, qwen3-4b, qwen3-30b-a3b-4l, qwen3-8b)
#                         runs examples/SHAPE-gpu.toml against fully_shard eager and with
#                         each decoder layer compiled; qwen3-8b trains LoRA adapters of rank
#                         16 on the attention and MLP projections. fp8 trains the 1B Llama
#                         300 steps with fsdpp in bf16 and with its layers' products in
#                         float8 (their final losses within 1%; no peer runs); SHAPE+fp8 adds
#                         that float8 run to a SHAPE's bench
#   gpu_check.sh python   the Python package on the GPU (tests/bindings/python/
#                         check_offload_device.py): offload() hands the device memory back,
#                         reload() brings the state back bitwise, full_weights' peak bounded;
#                         and check_generate.py, whose GPU case holds generate's tokens to
#                         transformers' on the GPU (the HF fixtures: build/tests/fixtures)
#   gpu_check.sh all      units, parity and bench in turn
#   gpu_check.sh session [SHAPE ...]
#                         what one lent GPU session runs, each step under its own deadline so
#                         that a slow one cannot spend the rest: units, python, then bench of
#                         each SHAPE named (default: llama-3.2-1b), within one 600 s call for
#                         one shape (90 + 120 + 180 s each; 240 s for offload, fp8 and SHAPE+fp8)
# Binaries come from build-gpu/ when this machine built them, else from a carried build/ (a
# CPU machine's build links CUDA and NCCL too: strip build/fsdpp and build/tests/fsdpp_tests,
# carry them with build/python, build/tests/fixtures, .gpu-deps/ and data/, and link the checkout's absolute path
# to the copy, since the RUNPATH and test paths are absolute). The Python module is built
# for one Python version; where this machine's python3 is another (3.12 where the venv has
# 3.11), configure the CPU build with -DFSDPP_EXTRA_PYTHONS=<a python3.12> so that build/python
# holds a module for it too: python and the peers' counts (--count-step) import it. The
# libraries of .gpu-deps/, of python3's torch and of its CUDA wheels are put on
# LD_LIBRARY_PATH. units, parity and bench build first when neither holds the binaries, and
# make the corpus when data/licenses.tok is missing. Logs go to $OUT when it is set, else to build-gpu/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/build-gpu}"
mkdir -p "$out"
prefix="${FSDPP_GPU_PREFIX:-/tmp/fsdpp-gpu-deps}"
lib="$prefix/usr/lib/x86_64-linux-gnu"
python="$(command -v python3)"
site="$("$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null || true)"
export LD_LIBRARY_PATH="$lib${site:+:$site/torch/lib:$site/nvidia/cu13/lib}:${LD_LIBRARY_PATH:-}"
# A carried build/ only where it links CUDA.
binaries="$root/build-gpu"
if [ ! -x "$binaries/fsdpp" ] && [ -x "$root/build/fsdpp" ] && readelf -d "$root/build/fsdpp" | grep -q 'NEEDED.*libtorch_cuda'; then
  binaries="$root/build"
fi
fsdpp="$binaries/fsdpp"
unit_tests="$binaries/tests/fsdpp_tests"

# dpkg -x where the image has dpkg, else the same by hand: a .deb is an ar archive whose
# data.tar.* holds the files.
unpack() {
  if command -v dpkg >/dev/null; then
    dpkg -x "$1" "$prefix"
    return
  fi
  local tmp
  tmp="$(mktemp -d)"
  (cd "$tmp" && ar x "$root/$1")
  tar -xf "$tmp"/data.tar.* -C "$prefix"
  rm -rf "$tmp"
}

# The Debian packages' headers and libraries, unpacked once into the private prefix.
deps() {
  [ -d "$lib" ] && return
  compgen -G ".gpu-deps/*.deb" >/dev/null || { echo "gpu_check: no .gpu-deps/*.deb (run scripts/gpu_deps.sh first)" >&2; exit 2; }
  mkdir -p "$prefix"
  for f in .gpu-deps/*.deb; do unpack "$f"; done
}

build() {
  deps
  binaries="$root/build-gpu" fsdpp="$root/build-gpu/fsdpp" unit_tests="$root/build-gpu/tests/fsdpp_tests"
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBUILD_TESTING=ON -DFSDPP_FUZZ=OFF -DFSDPP_REQUIRE_GPU=ON \
    -DFSDPP_PYTHON="$python" -DFSDPP_VENV="$("$python" -c 'import sys; print(sys.prefix)')" \
    -DCMAKE_CXX_FLAGS="-isystem $prefix/usr/include -isystem $prefix/usr/include/x86_64-linux-gnu" \
    -Dspdlog_DIR="$lib/cmake/spdlog" -Dfmt_DIR="$lib/cmake/fmt" -Dtomlplusplus_DIR="$lib/cmake/tomlplusplus" \
    -Dnlohmann_json_DIR="$prefix/usr/share/cmake/nlohmann_json" \
    -DLUA_INCLUDE_DIR="$prefix/usr/include/lua5.4" -DLUA_LIBRARY="$lib/liblua5.4.so" \
    -DProtobuf_INCLUDE_DIR="$prefix/usr/include" -DProtobuf_LIBRARY="$lib/libprotobuf.so" \
    -DProtobuf_PROTOC_EXECUTABLE="$prefix/usr/bin/protoc" -DCLI11_DIR="$prefix/usr/share/cmake/CLI11" \
    -DCatch2_DIR="$prefix/usr/lib/cmake/Catch2"
  ninja -C build-gpu -j "$(nproc)" fsdpp fsdpp_tests fsdpp_python
  readelf -d "$fsdpp" | grep -q 'NEEDED.*libtorch_cuda' || { echo "gpu_check: $fsdpp does not link libtorch_cuda" >&2; exit 1; }
}

inputs() {
  deps
  [ -x "$fsdpp" ] || build
  [ -f data/licenses.tok ] || bash scripts/make_corpus.sh
  touch data/licenses.tok  # newer than its tool, so make_corpus keeps a carried corpus
}

units() {
  deps
  [ "$binaries" = "$root/build" ] || build  # incremental where this machine builds
  FSDPP_REQUIRE_GPU_TESTS=1 OMP_NUM_THREADS=1 "$unit_tests" "[gpu]"
}

parity() {
  inputs
  export FSDPP="$fsdpp" WORK="$root/build-gpu/work" OMP_NUM_THREADS=1
  # The CPU references' bf16 matmuls below oneDNN's AMX kernels, which fault on hosts that
  # advertise AMX without enabling it; a cap changes nothing where the CPU has no AMX.
  export ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
  local cpu='parallel.device="cpu"' gpu='parallel.device="cuda"'
  # Each GPU run against the same settings on the CPU. The bound is measured, not chosen: the
  # CPU reference at world 2 differs from it only by the order of its fp32 sums, and a GPU
  # differs from a CPU by the same kind of reordering (other kernels, other blockings).
  local measured=(--dtype float32 --floor-world 2 --floor-factor 10 --reference-set "$cpu" --tested-set "$gpu")
  "$python" tests/fsdp/check_fsdp.py 1 --name gpu "${measured[@]}"
  "$python" tests/fsdp/check_fsdp.py 1 --name gpu-offload "${measured[@]}" --set 'policy.options.offload="cpu"'
  # bf16 compute against bf16 on the CPU, both launched (the fp32 masters are FSDP's).
  "$python" tests/fsdp/check_fsdp.py 1 --name gpu-bf16 --reference-world 1 --weights-by-norm "${measured[@]}" \
    --set 'policy.options.param_dtype="bfloat16"'
}

# bench [plain] [checkpoint] [offload] [moe] [SHAPE]: the variants to run (default: the first four).
bench() {
  inputs
  local variant flag config variants=("$@")
  ((${#variants[@]})) || variants=(plain checkpoint offload moe)
  for variant in "${variants[@]}"; do
    config=examples/llama-1b-gpu.toml
    local fp8="" threads=8
    # SHAPE+fp8: the shape, with fsdpp's float8 run beside its bf16 one.
    [[ "$variant" == *+fp8 ]] && fp8=--fp8 variant="${variant%+fp8}"
    case "$variant" in
      plain) flag="" ;;
      fp8) flag="--fp8 --no-peer --steps 300" ;;
      checkpoint) flag=--activation-checkpoint ;;
      # Both engines step AdamW on the host, with every core; step 10's GPU idle time is the host's share.
      offload) flag="--offload --profile-step 10" threads="$(nproc)" ;;
      moe) flag="" config=examples/qwen3-moe-gpu.toml ;;
      llama-3.2-1b|llama-3.2-3b|qwen3-4b|qwen3-30b-a3b-4l) flag=--compile config="examples/$variant-gpu.toml" ;;
      qwen3-8b) flag="--compile --lora-rank 16 --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
                config=examples/qwen3-8b-gpu.toml ;;
      *) echo "gpu_check: unknown bench variant '$variant' (plain, checkpoint, offload, moe, fp8, llama-3.2-1b," \
              "llama-3.2-3b, qwen3-4b, qwen3-30b-a3b-4l, qwen3-8b, each SHAPE+fp8)" >&2; exit 2 ;;
    esac
    echo "== bench $variant${fp8:+ +fp8}"
    # The package beside the binaries counts the peer's kernels (--count-step); a later --steps wins.
    PYTHONPATH="$binaries/python" PYTHONUNBUFFERED=1 "$python" scripts/bench_fsdp.py --fsdpp "$fsdpp" --config "$config" \
      --device cuda --param-dtype bfloat16 --steps 25 --threads "$threads" --count-step 2 $flag $fp8
  done
}

# The package beside the binaries.
python_api() {
  deps
  PYTHONPATH="$binaries/python" OMP_NUM_THREADS=8 "$python" tests/bindings/python/check_offload_device.py "$out/python-work"
  PYTHONPATH="$binaries/python" OMP_NUM_THREADS=1 FSDPP="$fsdpp" "$python" tests/bindings/python/check_generate.py \
    "$binaries/tests/fixtures" "$out/generate-work"
}

# session [SHAPE ...]: each step its own process under a deadline, its log under $out; a step
# that fails or runs out of time is reported and the next one runs.
session() {
  local shapes=("$@") step name limit failed=0
  ((${#shapes[@]})) || shapes=(llama-3.2-1b)
  deps
  local steps=(units:90 python:120) shape
  # A bench with a float8 run, and the offloaded one (fsdpp with host updates in the step too),
  # train once more: 60 s more.
  for shape in "${shapes[@]}"; do
    steps+=("bench-$shape:$([[ "$shape" == *fp8 || "$shape" == offload ]] && echo 240 || echo 180)")
  done
  for step in "${steps[@]}"; do
    name="${step%%:*}" limit="${step##*:}"
    echo "== $(date +%T) $name (deadline $limit s)"
    # bench-SHAPE runs `bench SHAPE`. A run told to stop finishes its step and saves: KILL
    # follows 15 s later, so that nothing holds the GPU when the next step starts.
    if ! timeout -k 15 "$limit" bash "$root/scripts/gpu_check.sh" ${name/-/ } >"$out/session-$name.log" 2>&1; then
      echo "gpu_check: $name failed or ran out of time (its log: $out/session-$name.log)"
      failed=1
    fi
  done
  return "$failed"
}

case "${1:-}" in
  build) build 2>&1 | tee "$out/build.log" ;;
  units) units 2>&1 | tee "$out/units.log" ;;
  parity) parity 2>&1 | tee "$out/parity.log" ;;
  bench) shift; bench "$@" 2>&1 | tee "$out/bench.log" ;;
  python) python_api 2>&1 | tee "$out/python.log" ;;
  session) shift; session "$@" 2>&1 | tee "$out/session.log" ;;
  all) { units; parity; bench; } 2>&1 | tee "$out/all.log" ;;
  *) echo "usage: gpu_check.sh build|units|parity|bench|python|session|all" >&2; exit 2 ;;
esac
