#!/usr/bin/env bash
# Request batching's cost per image: the demo pipeline's denoising step
# (bench_batch: dit_pipeline_generate_batch with 1, 2 and 4 members) and the
# mid-size FLUX forward of bench_flux_forward (8 x 128 heads, 4 + 8 blocks,
# random weights) at batch 1, 2 and 4, each on 1 and 2 threads.
#   tests/bench/batch_scaling.sh [BUILD_DIR] [IMG_TOKENS] [TXT_TOKENS]
# The mid-size forward defaults to 256 image + 64 text tokens (a 256x256
# image) so that the whole run stays within minutes on a small CPU box.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build=${1:-$root/build}
img=${2:-256}
txt=${3:-64}
for t in 1 2; do
  "$build/tests/bench_batch" --model "$root/tests/data/demo" --width 512 --height 512 \
    --steps 5 --warmup 1 --threads "$t"
done
for t in 1 2; do
  echo "mid-size FLUX forward (1024 hidden, 4 + 8 blocks), $img image + $txt text tokens, $t thread(s):"
  for b in 1 2 4; do
    ms=$("$build/tests/bench_flux_forward" --img-tokens "$img" --txt-tokens "$txt" --batch "$b" \
           --threads "$t" --warmup 1 --iters 3 | sed -n 's/^eager forward: median \([0-9.]*\) ms.*/\1/p')
    awk -v b="$b" -v ms="$ms" 'BEGIN { printf "batch %d: %.1f ms per forward, %.1f ms per image\n", b, ms, ms / b }'
  done
done
