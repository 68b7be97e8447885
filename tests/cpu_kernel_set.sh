#!/usr/bin/env bash
# Runs a test program on one of the cpu backend's kernel sets
# (DIT_CPU_KERNELS, worker/backend/cpu/cpu_backend.h):
#   tests/cpu_kernel_set.sh SET PROGRAM [ARGS...]
# and exits 77 (a skip, for meson) where this build or this CPU cannot run
# the set, as `ditrun --version` says ($DITRUN, from the test environment).
set -euo pipefail
set_name=$1
shift
line=$(DIT_CPU_KERNELS=$set_name "$DITRUN" --version | sed -n 's/^cpu kernels: //p')
case $line in
  "$set_name "*) ;;
  *)
    echo "skipped: $line"
    exit 77
    ;;
esac
DIT_CPU_KERNELS=$set_name exec "$@"
