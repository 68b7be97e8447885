#!/usr/bin/env bash
# Serving throughput: ditd with batching off and on, with one and two
# meshes, each under `ditctl bench` at several concurrency levels; prints
# ditctl's table (requests/s, latency percentiles, daemon overhead) per
# daemon setting, one setting after the other on the same machine.
#
#   tests/bench/throughput.sh [MODEL] [options]
#     MODEL           a pipeline folder (default: tests/data/demo)
#     -n N            requests per concurrency level (default 48)
#     -c LIST         concurrency levels (default 1,4,16)
#     --size WxH      (default 256x256)   --steps S (default 8)
#     --threads T     cores the whole daemon may use (default: nproc); one
#                     mesh gets T threads, two meshes T/2 each
#     --batch B       --max-batch of the batching settings (default 4)
#     --only LIST     run only these settings (comma-separated): batch1,
#                     batchB, replicas2, replicas2-batchB, ring2-batch1,
#                     ring2-batchB (the last two: one mesh of two ranks,
#                     --ring 2, T/2 threads each, as deploy/demo.sh serves)
#     --backend B     ditd --backend (default cpu); on cuda, --threads is the
#                     host threads of the worker(s) (results' encoding)
#     --warmup SPEC   ditd --warmup for every setting, e.g. 256x256:8 (on
#                     cuda: picks the GEMM algorithms and captures the
#                     step's graph before measuring)
#     --bin DIR       ditd, ditworker and ditctl in DIR (default: the build
#                     tree, build/daemon, build/worker, build/client)
#     --full          ditctl bench's whole report per setting (the server's
#                     time split per level), not just its table
#
# Settings run one at a time and alternate nothing: on a shared machine
# compare ratios within one run, not absolute rates across runs.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
model=$root/tests/data/demo
n=48
levels=1,4,16
size=256x256
steps=8
threads=$(nproc)
batch=4
only=
backend=cpu
warmup=
bindir=
full=0
while [ $# -gt 0 ]; do
  case "$1" in
    -n) n=$2; shift 2 ;;
    -c) levels=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --bin) bindir=$2; shift 2 ;;
    --full) full=1; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    -*) echo "throughput.sh: unknown option $1" >&2; exit 2 ;;
    *) model=$1; shift ;;
  esac
done
w=${size%x*}
h=${size#*x}
if [ -n "$bindir" ]; then
  ditd=$bindir/ditd
  ditctl=$bindir/ditctl
else
  ditd=$root/build/daemon/ditd
  ditctl=$root/build/client/ditctl
fi
extra=(--backend "$backend")
[ -n "$warmup" ] && extra+=(--warmup "$warmup")
half=$(( threads / 2 > 0 ? threads / 2 : 1 ))
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$out"' EXIT

run() {
  local label=$1; shift
  [ -n "$only" ] && [[ ",$only," != *",$label,"* ]] && return 0
  "$ditd" --model "$model" --listen 127.0.0.1:0 "${extra[@]}" "$@" >"$out/stdout" 2>"$out/log" &
  local pid=$!
  local port=
  for _ in $(seq 100); do
    port=$(sed -n 's/^ditd: listening on .*:\([0-9]*\)$/\1/p' "$out/stdout")
    [ -n "$port" ] && break
    sleep 0.1
  done
  [ -n "$port" ] || { echo "ditd did not start:"; cat "$out/log"; exit 1; }
  # Every mesh ready (and warmed up) before measuring.
  for _ in $(seq 600); do
    if "$ditctl" --target "127.0.0.1:$port" info 2>/dev/null |
        awk '/^mesh / && $0 !~ /ready/ {bad=1} END {exit bad}' &&
        "$ditctl" --target "127.0.0.1:$port" health >/dev/null 2>&1; then
      break
    fi
    sleep 0.1
  done
  echo "== $label: ditd ${extra[*]} $*"
  "$ditctl" --target "127.0.0.1:$port" bench -n "$n" -c "$levels" --quiet \
    --prompt "a lighthouse on a cliff" --width "$w" --height "$h" --steps "$steps" --seed 1 |
    if [ $full -eq 1 ]; then cat; else sed -n '/^concurrency requests/,$p'; fi
  kill -TERM "$pid"
  wait "$pid" || true
}

echo "model $model, ${w}x${h}, $steps steps, $n requests per level, $threads threads in all"
run batch1 --world-size 1 --threads "$threads" --max-batch 1
run "batch$batch" --world-size 1 --threads "$threads" --max-batch "$batch"
run replicas2 --world-size 1 --replicas 2 --threads "$half" --max-batch 1
run "replicas2-batch$batch" --world-size 1 --replicas 2 --threads "$half" --max-batch "$batch"
run ring2-batch1 --world-size 2 --ring 2 --threads "$half" --max-batch 1
run "ring2-batch$batch" --world-size 2 --ring 2 --threads "$half" --max-batch "$batch"
