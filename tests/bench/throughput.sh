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
#     --only LABEL    run one setting: batch1, batchB, replicas2, replicas2-batchB
#
# Needs a build in build/ (ditd, ditworker, ditctl). Settings run one at a
# time and alternate nothing: on a shared machine compare ratios within one
# run, not absolute rates across runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
model=tests/data/demo
n=48
levels=1,4,16
size=256x256
steps=8
threads=$(nproc)
batch=4
only=
while [ $# -gt 0 ]; do
  case "$1" in
    -n) n=$2; shift 2 ;;
    -c) levels=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "throughput.sh: unknown option $1" >&2; exit 2 ;;
    *) model=$1; shift ;;
  esac
done
w=${size%x*}
h=${size#*x}
half=$(( threads / 2 > 0 ? threads / 2 : 1 ))
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$out"' EXIT

run() {
  local label=$1; shift
  [ -n "$only" ] && [ "$only" != "$label" ] && return 0
  build/daemon/ditd --model "$model" --listen 127.0.0.1:0 "$@" >"$out/stdout" 2>"$out/log" &
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
    if build/client/ditctl --target "127.0.0.1:$port" info 2>/dev/null |
        awk '/^mesh / && $0 !~ /ready/ {bad=1} END {exit bad}' &&
        build/client/ditctl --target "127.0.0.1:$port" health >/dev/null 2>&1; then
      break
    fi
    sleep 0.1
  done
  echo "== $label: ditd $*"
  build/client/ditctl --target "127.0.0.1:$port" bench -n "$n" -c "$levels" --quiet \
    --prompt "a lighthouse on a cliff" --width "$w" --height "$h" --steps "$steps" --seed 1 |
    sed -n '/^concurrency requests/,$p'
  kill -TERM "$pid"
  wait "$pid" || true
}

echo "model $model, ${w}x${h}, $steps steps, $n requests per level, $threads threads in all"
run batch1 --world-size 1 --threads "$threads" --max-batch 1
run "batch$batch" --world-size 1 --threads "$threads" --max-batch "$batch"
run replicas2 --world-size 1 --replicas 2 --threads "$half" --max-batch 1
run "replicas2-batch$batch" --world-size 1 --replicas 2 --threads "$half" --max-batch "$batch"
