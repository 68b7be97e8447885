#!/usr/bin/env bash
# The GPU check of the cuda backend, for a machine with one NVIDIA GPU
# (written for an H200, sm_90; about 3-5 minutes on 16 cores):
#
#   tests/gpu/run.sh OUT_DIR
#
#  1. configures and builds a release build with -Dcuda=enabled -Dgpu_sm=90
#     in build-gpu/ (DIT_GPU_BUILDDIR and DIT_GPU_SM override);
#  2. runs the meson suite 'gpu': op-by-op parity with the cpu backend, the
#     golden forward cases and a demo generation on cuda against diffusers,
#     CUDA-graph replay against eager passes;
#  3. one whole `ditrun generate --backend cuda` of the demo pipeline
#     (512x512, 8 steps), timed;
#  4. the FLUX.1-dev-sized benchmark with random weights made on the device
#     (19 double + 38 single blocks, 24 x 128 heads, 4096 image + 512 text
#     tokens, batch 1): median ms per forward step, TFLOP/s at 74.4 TFLOP per
#     step, peak GPU memory, eager and with the CUDA graph.
#
# OUT_DIR gets summary.txt ("key: value" lines) and one log per stage. The
# script keeps going after a failing stage and exits non-zero if any failed.
set -uo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 OUT_DIR" >&2
  exit 2
fi
mkdir -p "$1"
out=$(cd "$1" && pwd)
cd "$(dirname "$0")/../.."
src=$(pwd)
builddir=${DIT_GPU_BUILDDIR:-build-gpu}
sm=${DIT_GPU_SM:-90}
summary="$out/summary.txt"
: > "$summary"
failed=0
t_start=$(date +%s)

note() { echo "$1: $2" >> "$summary"; }
stage() { # stage NAME LOG CMD...: runs, times, records status
  local name=$1 log=$2
  shift 2
  local t0 t1 rc
  t0=$(date +%s.%N)
  echo "== $name: $*" | tee -a "$out/run.log"
  "$@" > "$out/$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  note "${name}_status" "$([ $rc -eq 0 ] && echo ok || echo "failed (exit $rc)")"
  note "${name}_seconds" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')"
  if [ $rc -ne 0 ]; then
    failed=1
    echo "   failed (exit $rc), see $out/$log" | tee -a "$out/run.log"
    tail -n 30 "$out/$log" | tee -a "$out/run.log"
  fi
  return $rc
}

note date "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
note host "$(hostname)"
note gpu "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1 || echo unknown)"
note commit "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
note gpu_sm "$sm"

# 1. Build.
if [ -f "$builddir/build.ninja" ]; then
  setup=(meson setup --reconfigure "$builddir")
else
  setup=(meson setup "$builddir")
fi
stage configure configure.log "${setup[@]}" -Dcuda=enabled -Dgpu_sm="$sm" -De2e=disabled \
  -Dbuildtype=release || { note overall failed; exit 1; }
stage build build.log ninja -C "$builddir" || { note overall failed; exit 1; }

# 2. The gpu suite (parity, golden forward on cuda, demo generate, graphs).
stage gpu_suite gpu_suite.log meson test -C "$builddir" --suite gpu --print-errorlogs \
  --num-processes 1
grep -E "^ *[0-9]+/[0-9]+ " "$out/gpu_suite.log" | sed 's/^/   /' | tee -a "$out/run.log"
for t in cuda_ops cuda_forward cuda_golden; do
  st=$(grep -E "gpu / $t " "$out/gpu_suite.log" | awk '{print $5}' | head -n 1)
  note "gpu_test_$t" "${st:-missing}"
done
# The per-case numbers the tests print (golden rel errors, graph checks).
cp "$builddir/meson-logs/testlog.txt" "$out/gpu_testlog.txt" 2>/dev/null
grep -hE "cuda vs diffusers|cuda vs cpu|generate --backend cuda" "$out/gpu_testlog.txt" \
  > "$out/gpu_numbers.txt" 2>/dev/null
worst=$(grep -oE "rel [0-9.e+-]+" "$out/gpu_numbers.txt" 2>/dev/null | awk '{print $2}' |
        sort -g | tail -n 1)
note golden_worst_rel "${worst:-n/a}"

# 3. One whole generation of the demo pipeline on cuda.
stage generate generate.log "$builddir/worker/ditrun" generate --model "$src/tests/data/demo" \
  --prompt "a lighthouse on a cliff at sunset, oil painting" --width 512 --height 512 \
  --steps 8 --seed 42 --backend cuda --output "$out/demo_cuda.png"
grep -E "time:" "$out/generate.log" | head -n 3 | sed 's/^/   /' | tee -a "$out/run.log"
note generate_timing "$(grep -E 'time:' "$out/generate.log" | head -n 1)"

# 4. FLUX.1-dev-sized forward benchmark, eager and CUDA graph.
stage bench_flux_dev bench_flux_dev.log "$builddir/tests/bench_flux_forward" --backend cuda \
  --flux-dev --graph both --warmup 2 --iters 10 --flop-per-step 74.4e12 \
  --summary "$summary"
cat "$out/bench_flux_dev.log" | sed 's/^/   /' | tee -a "$out/run.log"

note total_seconds "$(( $(date +%s) - t_start ))"
note overall "$([ $failed -eq 0 ] && echo ok || echo failed)"
echo "== summary ($summary)"
cat "$summary"
exit $failed
