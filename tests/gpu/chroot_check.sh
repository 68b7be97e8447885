#!/usr/bin/env bash
# Proves that a GPU check bundle needs nothing of this machine: runs its
# run.sh inside a minimal Debian chroot that has none of ditserve's
# dependencies, and expects the CPU stage to pass and the script to exit 77
# ("gpu: none").
#
#   tests/gpu/chroot_check.sh BUNDLE_DIR [CHROOT_DIR]
#
# Needs root and debootstrap (apt-get install debootstrap). CHROOT_DIR
# (default /var/tmp/ditserve-minbase) is made with
# `debootstrap --variant=minbase bookworm` on first use and reused after.
# The bundle is copied to CHROOT_DIR/opt/gpu-bundle; the run's summary is
# printed and left in CHROOT_DIR/tmp/gpu-out.
set -euo pipefail
if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
bundle=$(cd "$1" && pwd)
root=${2:-/var/tmp/ditserve-minbase}
[ -x "$bundle/run.sh" ] || { echo "chroot_check.sh: $bundle has no run.sh" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || { echo "chroot_check.sh: needs root (chroot, mount)" >&2; exit 2; }

if [ ! -x "$root/bin/bash" ]; then
  command -v debootstrap > /dev/null ||
    { echo "chroot_check.sh: needs debootstrap (apt-get install debootstrap)" >&2; exit 2; }
  echo "== debootstrap --variant=minbase bookworm $root"
  debootstrap --variant=minbase bookworm "$root" > /tmp/ditserve-debootstrap.log 2>&1 ||
    { tail -n 20 /tmp/ditserve-debootstrap.log; exit 1; }
fi

# The chroot must lack what the bundle carries, or the check proves nothing.
present=$(chroot "$root" dpkg-query -W -f='${Package} ${Status}\n' 2> /dev/null |
  awk '$NF == "installed" { print $1 }' |
  grep -E '^(libgrpc|libopenblas|libcjson|libuv1|libpng16|libprotobuf-c|libmicrohttpd|libutf8proc|check$|libsubunit|libgomp|libgfortran|libcares|libre2|libabsl|libssl3|libcudart|libnccl|python3)' || true)
if [ -n "$present" ]; then
  echo "chroot_check.sh: the chroot has packages the bundle should bring itself:" >&2
  echo "$present" >&2
  exit 1
fi
echo "== the chroot has none of ditserve's dependencies (no gRPC, OpenBLAS, libuv, cJSON, libpng, protobuf-c, Check, CUDA, Python)"

rm -rf "$root/opt/gpu-bundle" "$root/tmp/gpu-out"
mkdir -p "$root/opt"
cp -a "$bundle" "$root/opt/gpu-bundle"
mounted=0
if ! mountpoint -q "$root/proc"; then
  mount -t proc proc "$root/proc"
  mounted=1
fi
cleanup() { [ $mounted -eq 1 ] && umount "$root/proc"; true; }
trap cleanup EXIT

set +e
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TMPDIR=/tmp \
  /opt/gpu-bundle/run.sh /tmp/gpu-out
rc=$?
set -e
echo "== run.sh exited $rc inside the chroot"
if [ $rc -ne 77 ]; then
  echo "chroot_check.sh: expected exit 77 (CPU stage passed, no GPU)" >&2
  exit 1
fi
grep -q '^gpu: none$' "$root/tmp/gpu-out/summary.txt"
grep -q '^cpu_golden_status: ok$' "$root/tmp/gpu-out/summary.txt"
grep -q '^cpu_pipeline_status: ok$' "$root/tmp/gpu-out/summary.txt"
grep -q '^cpu_generate_status: ok$' "$root/tmp/gpu-out/summary.txt"
echo "== ok: the bundle ran its CPU stage in a minimal chroot and exited 77"
