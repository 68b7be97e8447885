#!/usr/bin/env bash
# The main job on the bundled demo pipeline: builds ditd, ditworker and
# ditctl, starts ditd on the CPU with two worker processes (ring attention
# over 2 ranks), generates an image from a prompt with ditctl into demo.png,
# and stops the daemon with SIGTERM (a clean drain).
#   deploy/demo.sh          the image demo (a tiny FluxPipeline)
#   deploy/demo.sh video    a clip instead: the tiny WanPipeline, Ulysses over 2
#                           ranks, 17 frames into demo.mp4
#   DITD_LISTEN=HOST:PORT   where ditd listens (default 127.0.0.1:0: a free port)
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-image}" in
  image)
    model=tests/data/demo layout=(--ring 2) layout_text="ring_degree 2"
    gen=(--prompt "a lighthouse on a cliff at sunset, oil painting"
         --width 256 --height 256 --steps 8 --seed 42 -o demo.png) ;;
  video)
    model=tests/data/wan_demo layout=(--ulysses 2) layout_text="ulysses_degree 2"
    gen=(--prompt "a paper boat drifting down a rainy street, cinematic"
         --width 128 --height 96 --frames 17 --fps 8 --steps 8 --seed 42 -o demo.mp4) ;;
  *)
    echo "usage: deploy/demo.sh [image|video]" >&2
    exit 2 ;;
esac

if [ ! -f build/build.ninja ]; then
  meson setup build -Dcuda="${DIT_CUDA:-auto}" -De2e=auto
fi
# ninja (not meson compile) so that a build folder made before these targets
# existed regenerates itself first.
ninja -C build daemon/ditd worker/ditworker client/ditctl

log=$(mktemp -t ditd-demo.XXXXXX)
fifo=$(mktemp -u -t ditd-demo-out.XXXXXX)
mkfifo "$fifo"
pid=""
cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  rm -f "$fifo"
}
trap cleanup EXIT

build/daemon/ditd --model "$model" --listen "${DITD_LISTEN:-127.0.0.1:0}" \
  --world-size 2 "${layout[@]}" >"$fifo" 2>"$log" &
pid=$!
# ditd prints "ditd: listening on HOST:PORT" once the port is bound.
if ! read -r -t 60 line <"$fifo" || [[ "$line" != "ditd: listening on "* ]]; then
  echo "demo: ditd did not start; its log:" >&2
  cat "$log" >&2
  exit 1
fi
target=${line#ditd: listening on }
echo "$line (2 CPU workers, $layout_text; log in $log)"

# Wait until the workers are up (health SERVING), then generate.
for _ in $(seq 1 300); do
  if build/client/ditctl --target "$target" health >/dev/null 2>&1; then
    break
  fi
  sleep 0.1
done
build/client/ditctl --target "$target" info
build/client/ditctl --target "$target" generate "${gen[@]}"

kill -TERM "$pid"
wait "$pid"
pid=""
echo "ditd drained and exited cleanly"
