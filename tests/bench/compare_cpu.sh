#!/usr/bin/env bash
# Times ditserve's CPU forward and diffusers' on the same config and thread
# count, alternating the two so that machine noise hits both alike.
#   tests/bench/compare_cpu.sh [THREADS] [ROUNDS]
# Needs a build in build/ and `pip install torch diffusers`.
set -euo pipefail
cd "$(dirname "$0")/../.."
threads=${1:-$(nproc)}
rounds=${2:-3}
for r in $(seq "$rounds"); do
  build/tests/bench_flux_forward --threads "$threads" --iters 3 | grep 'eager forward' | sed 's/^/ditserve /'
  python3 tests/bench/bench_diffusers_forward.py --threads "$threads" --iters 3 | grep 'diffusers forward'
done
