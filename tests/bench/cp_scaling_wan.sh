#!/usr/bin/env bash
# Context-parallel scaling of WanTransformer3DModel on CPU ranks: one rank with
# one thread against two ranks with one thread each (Ulysses 2 and ring 2 on
# the shm mesh), all through `ditrun forward`, alternating in every round.
#   tests/bench/cp_scaling_wan.sh [ROUNDS]
# Same model as compare_cpu_wan.sh ($DIT_BUILD/bench-wan/mid, made if absent;
# DIT_BUILD defaults to build, DIT_PYTHON to python3). Each run is the best of
# 2 forwards; the speed-up is the one-rank time over the two-rank time of the
# same round. The goal is >= 1.8x; it needs two otherwise idle cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
build=${DIT_BUILD:-build}
py=${DIT_PYTHON:-python3}
dir=$build/bench-wan/mid
"$py" tests/bench/bench_diffusers_wan.py --make "$dir" --threads "$(nproc)"
run() { # run ARGS...: prints the forward time in ms
  "$build/worker/ditrun" forward --model "$dir/transformer" --inputs "$dir/inputs.safetensors" \
    --output "$dir/out-cp.safetensors" --threads 1 --repeat 2 "$@" |
    sed -n 's/^forward:.*backend: \([0-9.]*\) ms.*/\1/p'
}
for r in $(seq "$rounds"); do
  t1=$(run)
  tu=$(run --world-size 2 --ulysses 2)
  tr=$(run --world-size 2 --ring 2)
  awk -v r="$r" -v a="$t1" -v u="$tu" -v g="$tr" 'BEGIN {
    printf "round %d: 1 rank x 1 thread %.0f ms; 2 ranks x 1 thread: ulysses 2 %.0f ms (%.2fx), ring 2 %.0f ms (%.2fx)\n",
           r, a, u, a / u, g, a / g }'
done
