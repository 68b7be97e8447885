#!/usr/bin/env bash
# Bytes each rank sends per WanTransformer3DModel forward under ring 8,
# Ulysses 8 and ring 2 x Ulysses 4: measured on a small model (8 heads x 16,
# 2 layers, 128 video tokens, 8 CPU ranks) against the formula, then the
# formula for Wan 2.1 14B at 480x832, 81 frames (bench_wan_parallel.c).
#   tests/bench/wan_cp_bytes.sh [LAYOUTS]     (default ring8,ulysses8,ring2xulysses4)
# DIT_BUILD (build) and DIT_PYTHON (python3) as in compare_cpu_wan.sh; the
# model is made once into $DIT_BUILD/bench-wan/tiny8.
set -euo pipefail
cd "$(dirname "$0")/../.."
layouts=${1:-ring8,ulysses8,ring2xulysses4}
build=${DIT_BUILD:-build}
py=${DIT_PYTHON:-python3}
dir=$build/bench-wan/tiny8
"$py" tests/bench/bench_diffusers_wan.py --make "$dir" --threads 1 --heads 8 --head-dim 16 \
  --ffn 64 --layers 2 --in-channels 4 --text-dim 32 --freq-dim 32 --frames 4 --height 8 \
  --width 16 --text-tokens 16
"$build/tests/bench_wan_parallel" --model "$dir/transformer" --inputs "$dir/inputs.safetensors" \
  --layouts "$layouts"
