#!/usr/bin/env bash
# The main job on the bundled demo pipeline: builds ditrun and generates an
# image from a prompt on the CPU, printing the time split, into demo.png.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -f build/build.ninja ]; then
  meson setup build -Dcuda="${DIT_CUDA:-auto}"
fi
meson compile -C build ditrun
build/worker/ditrun generate \
  --model tests/data/demo \
  --prompt "a lighthouse on a cliff at sunset, oil painting" \
  --width 256 --height 256 --steps 8 --seed 42 \
  --output demo.png
