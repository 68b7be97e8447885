#!/usr/bin/env bash
# The main job, on the bundled demo model: builds ditrun and runs one
# FluxTransformer2DModel forward pass on the CPU, printing what it computed.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -f build/build.ninja ]; then
  meson setup build -Dcuda="${DIT_CUDA:-auto}"
fi
meson compile -C build ditrun
build/worker/ditrun forward \
  --model tests/data/demo/transformer \
  --inputs tests/data/demo/inputs.safetensors \
  --output demo-out.safetensors \
  --compare tests/data/demo/expected.safetensors
