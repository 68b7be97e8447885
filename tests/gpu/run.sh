#!/usr/bin/env bash
# The GPU check on a machine that has both a GPU and everything the build
# needs (deploy/install-deps.sh, the CUDA toolkit):
#
#   tests/gpu/run.sh OUT_DIR
#
# makes the bundle (tests/gpu/bundle.sh, into build-gpu-bundle/ unless
# DIT_GPU_BUNDLE names another folder) and runs its run.sh, so that this and
# a bare GPU machine run exactly the same programs and stages. Where the GPU
# machine cannot build (no Debian dependencies there), make the bundle on a
# build machine and carry it over instead; the README's CUDA section says how.
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 OUT_DIR" >&2
  exit 2
fi
src=$(cd "$(dirname "$0")/../.." && pwd)
bundle=${DIT_GPU_BUNDLE:-$src/build-gpu-bundle}
"$src/tests/gpu/bundle.sh" "$bundle"
exec "$bundle/run.sh" "$1"
