#!/usr/bin/env bash
# One generation through the daemon, as a user would run it:
#
#   ditd_smoke.sh BIN_DIR PIPELINE_DIR OUT_DIR [BACKEND]
#
# starts BIN_DIR/ditd (one worker, BACKEND cpu or cuda, default cuda) on a free
# loopback port, waits for health SERVING, prints `ditctl info`, generates a
# 512x512, 8-step image into OUT_DIR/ditd_BACKEND.png with ditctl (which
# prints the time split and the end-to-end latency), then SIGTERMs ditd.
# Succeeds when ditctl and ditd both exit 0. The daemon's log goes to
# OUT_DIR/ditd_server.log.
set -uo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
bin=$1 model=$2 out=$3 backend=${4:-cuda}
"$bin/ditd" --model "$model" --listen 127.0.0.1:0 --backend "$backend" --world-size 1 \
  --startup-timeout 120 > "$out/ditd_stdout.log" 2> "$out/ditd_server.log" &
pid=$!
stop() {
  kill -TERM $pid 2> /dev/null
  wait $pid
}
addr=""
for _ in $(seq 1 600); do
  addr=$(sed -n 's/^ditd: listening on \([^ ]*\).*/\1/p' "$out/ditd_stdout.log" | head -n 1)
  [ -n "$addr" ] && break
  kill -0 $pid 2> /dev/null || break
  sleep 0.1
done
if [ -z "$addr" ]; then
  echo "ditd did not start listening:"
  tail -n 20 "$out/ditd_server.log"
  kill -9 $pid 2> /dev/null
  exit 1
fi
echo "ditd at $addr"
serving=0
for _ in $(seq 1 240); do
  if [ "$("$bin/ditctl" --target "$addr" health 2>&1 | head -n 1)" = SERVING ]; then
    serving=1
    break
  fi
  kill -0 $pid 2> /dev/null || break
  # A worker that cannot start is retried with backoff for ever: stop at once.
  grep -q 'failed to start' "$out/ditd_server.log" && break
  sleep 0.5
done
if [ $serving -ne 1 ]; then
  echo "ditd never turned SERVING:"
  tail -n 20 "$out/ditd_server.log"
  stop
  exit 1
fi
"$bin/ditctl" --target "$addr" info
"$bin/ditctl" --target "$addr" generate --prompt "a red fox in the snow" \
  -o "$out/ditd_$backend.png" --width 512 --height 512 --steps 8 --seed 7
grc=$?
stop
drc=$?
echo "ditctl generate exit $grc; ditd exit $drc after SIGTERM"
[ $grc -eq 0 ] && [ $drc -eq 0 ]
