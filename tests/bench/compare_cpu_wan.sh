#!/usr/bin/env bash
# Times ditserve's CPU forward of a mid-size WanTransformer3DModel and
# diffusers' on the same weights, inputs and thread count, alternating the two
# so that machine noise hits both alike.
#   tests/bench/compare_cpu_wan.sh [THREADS] [ROUNDS]
# Needs a build in build/ (DIT_BUILD overrides) and a python3 with torch and
# diffusers (DIT_PYTHON overrides). The model (Wan 2.1 1.3B's block shape, 2
# layers, 3200 video + 512 text tokens, random f32 weights, ~400 MB) is made
# once into $DIT_BUILD/bench-wan/mid by bench_diffusers_wan.py --make.
# ditrun runs 4 forwards and reports the best; diffusers runs 1 warm-up and 3
# timed forwards and reports the median and the minimum; ditrun also checks
# its output against diffusers' (relative error, should be ~1e-6).
set -euo pipefail
cd "$(dirname "$0")/../.."
threads=${1:-$(nproc)}
rounds=${2:-3}
build=${DIT_BUILD:-build}
py=${DIT_PYTHON:-python3}
dir=$build/bench-wan/mid
"$py" tests/bench/bench_diffusers_wan.py --make "$dir" --threads "$threads"
for r in $(seq "$rounds"); do
  "$build/worker/ditrun" forward --model "$dir/transformer" --inputs "$dir/inputs.safetensors" \
    --output "$dir/out.safetensors" --threads "$threads" --repeat 4 \
    --compare "$dir/expected.safetensors" | grep -E '^(forward|compared)' | sed 's/^/ditserve /'
  "$py" tests/bench/bench_diffusers_wan.py --model "$dir" --threads "$threads" --iters 3 |
    grep 'diffusers forward'
done
