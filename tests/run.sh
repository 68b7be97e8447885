#!/usr/bin/env bash
# Configures, builds and runs every test suite (unit and end-to-end).
#   tests/run.sh              release build in build/
#   tests/run.sh --sanitize   AddressSanitizer + UBSan build in build-asan/
# Further arguments go to meson test (e.g. --suite e2e, --no-suite golden).
# DIT_CUDA=enabled|auto|disabled chooses whether the release build compiles
# the CUDA backend with nvcc (default auto: when nvcc is found). CI runs it
# with disabled (its CUDA build is the GPU check bundle's). The sanitized
# build never does (see below).
set -euo pipefail
cd "$(dirname "$0")/.."

cuda=${DIT_CUDA:-auto}
builddir=build
# The daemon's end-to-end tests need a python3 with grpcio and protobuf
# (deploy/install-deps.sh installs them); DIT_E2E=auto skips them without.
opts=(-Dcuda="$cuda" -De2e="${DIT_E2E:-enabled}")
if [ "${1:-}" = "--sanitize" ]; then
  shift
  builddir=build-asan
  # Without nvcc: the cuda backend's sources run under the sanitizers as
  # host code on the SIMT emulator (tests/gpu/emu, in every build), and the
  # GPU suite's binaries need a GPU anyway. The release build compiles and
  # links the real CUDA backend.
  opts=(-Dcuda=disabled -De2e="${DIT_E2E:-enabled}")
  opts+=(-Db_sanitize=address,undefined -Dbuildtype=debugoptimized)
fi

if [ -f "$builddir/build.ninja" ]; then
  # --reconfigure also picks up options added since the folder was made.
  meson setup --reconfigure "$builddir" "${opts[@]}" >/dev/null
else
  meson setup "$builddir" "${opts[@]}"
fi
meson compile -C "$builddir"
meson test -C "$builddir" --print-errorlogs "$@"
