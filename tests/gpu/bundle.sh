#!/usr/bin/env bash
# Builds the GPU check as a self-contained folder, on a machine with the CUDA
# toolkit and ditserve's Debian dependencies (deploy/install-deps.sh), for a
# GPU machine that has only a driver, the CUDA toolkit and Python:
#
#   tests/gpu/bundle.sh DIR        (DIR: a new or empty folder, e.g. gpu-bundle)
#
# then copy DIR to the GPU machine and run `DIR/run.sh OUT` there (see
# tests/gpu/bundle_run.sh, which becomes DIR/run.sh). DIR holds:
#   bin/       release build with CUDA for sm_90 (DIT_GPU_SM overrides) and a
#              portable CPU target (-march=x86-64-v3, DIT_BUNDLE_MARCH
#              overrides): ditrun, ditworker, ditd, ditctl, the gpu tests, the
#              cpu golden and pipeline tests, bench_flux_forward; stripped
#   bin-cpu/   the same programs the CPU stage runs, built without CUDA, so that
#              the CPU stage also runs where cuBLASLt and NCCL are absent
#   lib/       every shared library those programs need except glibc's and the
#              GPU libraries the GPU machine brings (gpu-libs.txt names them);
#              lib-gz/ holds the largest ones gzipped (run.sh unpacks them)
#   lib-fallback/  libstdc++ and libgcc_s, used only where the machine has none
#   tests/data/    the fixtures the tests read
#   run.sh, ditd_smoke.sh, throughput.sh, MANIFEST (commit, options, sizes),
#   gpu-libs.txt
#
# The bundle must stay under 60 MiB (64 MiB is what can be carried to the GPU
# machine); the script fails if it is larger, and fails if any program needs a
# library that is neither in the bundle, nor glibc's, nor an allowed GPU library.
set -euo pipefail
if [ $# -ne 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
out=$1
src=$(cd "$(dirname "$0")/../.." && pwd)
sm=${DIT_GPU_SM:-90}
march=${DIT_BUNDLE_MARCH:-x86-64-v3}
build_gpu=${DIT_BUNDLE_BUILDDIR:-$src/build-bundle}
build_cpu=${build_gpu}-cpu
max_bytes=$((60 * 1024 * 1024))

# Libraries the bundle must not carry: glibc's (the machine's own loader must
# match them) and the GPU libraries (the driver's libcuda, and cuBLAS(Lt) and
# NCCL, which the GPU machine has in its toolkit or its Python packages).
glibc_re='^(ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1|libresolv\.so\.2|libutil\.so\.1|linux-vdso\.so\.1)$'
gpu_re='^(libcuda\.so\.[0-9]+|libcublas\.so\.[0-9]+|libcublasLt\.so\.[0-9]+|libnccl\.so\.[0-9]+)$'
# Gzipped in the bundle (run.sh unpacks them once into a scratch folder): every
# library of a megabyte or more, which keeps the bundle a few MiB under its limit.
gz_re='^(libopenblas\.so\.[0-9]+|libgrpc\.so\.[0-9]+|libcrypto\.so\.[0-9]+|libgfortran\.so\.[0-9]+|libgnutls\.so\.[0-9]+|libunistring\.so\.[0-9]+|libp11-kit\.so\.[0-9]+)$'
# Carried, but used only where the machine has none: a newer system libstdc++
# is what the machine's own cuBLASLt and NCCL were built against.
fallback_re='^(libstdc\+\+\.so\.6|libgcc_s\.so\.1)$'

for tool in meson ninja strip ldd gzip; do
  command -v "$tool" > /dev/null || { echo "bundle.sh: $tool is needed" >&2; exit 1; }
done
if [ -e "$out" ] && [ -n "$(ls -A "$out" 2>/dev/null)" ]; then
  if [ -f "$out/MANIFEST" ]; then
    rm -rf "$out" # an earlier bundle: replaced whole
  else
    echo "bundle.sh: $out exists and is not an earlier bundle; give a new folder" >&2
    exit 1
  fi
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)

configure() { # configure BUILDDIR OPTIONS...
  local dir=$1
  shift
  if [ -f "$dir/build.ninja" ]; then
    meson setup --reconfigure "$dir" "$@" > /dev/null
  else
    meson setup "$dir" "$@" > /dev/null
  fi
}

echo "== build with CUDA (sm_$sm, -march=$march) in $build_gpu"
# Without MP4 output: FFmpeg's hundred shared libraries would not fit in the
# bundle, and the GPU checks ask for PNG and raw tensors only.
configure "$build_gpu" -Dbuildtype=release -Dcuda=enabled -Dgpu_sm="$sm" -Dmarch="$march" \
  -De2e=disabled -Db_sanitize=none -Dmp4=disabled
# nvcc writes no dependency files under meson 1.0, so a CUDA object would not
# notice a changed header: compile them afresh every time.
find "$build_gpu" -name '*.cu.o' -delete
# The programs the bundle carries, not the whole tree (the unit tests and the
# SIMT-emulator builds are not carried; tests/run.sh builds every target).
gpu_targets=(worker/ditrun worker/ditworker daemon/ditd client/ditctl tests/bench_flux_forward
             tests/test_flux_golden tests/test_pipeline)
while read -r t; do
  gpu_targets+=("$t")
done < <(ninja -C "$build_gpu" -t targets all 2> /dev/null | sed -n 's|^\(tests/gpu/test_[a-z0-9_]*\): .*|\1|p')
ninja -C "$build_gpu" "${gpu_targets[@]}" > "$out/.build-gpu.log" 2>&1 ||
  { tail -n 40 "$out/.build-gpu.log"; exit 1; }
echo "== build without CUDA (-march=$march) in $build_cpu"
configure "$build_cpu" -Dbuildtype=release -Dcuda=disabled -Dmarch="$march" -De2e=disabled \
  -Db_sanitize=none -Dmp4=disabled
ninja -C "$build_cpu" worker/ditrun tests/test_flux_golden tests/test_pipeline \
  > "$out/.build-cpu.log" 2>&1 || { tail -n 40 "$out/.build-cpu.log"; exit 1; }
rm -f "$out/.build-gpu.log" "$out/.build-cpu.log"

mkdir -p "$out/bin" "$out/bin-cpu" "$out/lib" "$out/lib-gz" "$out/lib-fallback" "$out/tests/data"
# Programs of the CUDA build: the daemon smoke test needs ditd, ditworker
# (found next to ditd) and ditctl; the gpu tests call ditrun.
progs=("$build_gpu/worker/ditrun" "$build_gpu/worker/ditworker" "$build_gpu/daemon/ditd"
       "$build_gpu/client/ditctl" "$build_gpu/tests/bench_flux_forward"
       "$build_gpu/tests/test_flux_golden" "$build_gpu/tests/test_pipeline")
for t in "${gpu_targets[@]}"; do
  case "$t" in tests/gpu/*) progs+=("$build_gpu/$t") ;; esac
done
if [ ${#progs[@]} -lt 10 ]; then
  echo "bundle.sh: the CUDA build lists no GPU tests (tests/gpu/test_*)" >&2
  exit 1
fi
for p in "${progs[@]}"; do
  cp "$p" "$out/bin/"
done
for p in worker/ditrun tests/test_flux_golden tests/test_pipeline; do
  cp "$build_cpu/$p" "$out/bin-cpu/"
done
strip --strip-unneeded "$out"/bin/* "$out"/bin-cpu/*

# Shared libraries, found through ldd on this machine, then copied by soname.
gpu_needed=()
declare -A seen=()
for p in "$out"/bin/* "$out"/bin-cpu/*; do
  while read -r name path; do
    [ -n "$name" ] || continue
    [[ $name =~ $glibc_re ]] && continue
    if [[ $name =~ $gpu_re ]]; then
      gpu_needed+=("$name")
      continue
    fi
    [ -n "${seen[$name]:-}" ] && continue
    seen[$name]=1
    if [ "$path" = "not" ] || [ ! -f "$path" ]; then
      echo "bundle.sh: $(basename "$p") needs $name, which this machine does not resolve" >&2
      exit 1
    fi
    if [[ $name =~ $gz_re ]]; then
      strip --strip-unneeded -o "$out/lib-gz/$name" "$path" 2> /dev/null || cp -L "$path" "$out/lib-gz/$name"
      gzip -9 "$out/lib-gz/$name"
    elif [[ $name =~ $fallback_re ]]; then
      cp -L "$path" "$out/lib-fallback/$name"
    else
      strip --strip-unneeded -o "$out/lib/$name" "$path" 2> /dev/null || cp -L "$path" "$out/lib/$name"
    fi
  done < <(ldd "$p" | awk '/=>/ { print $1, $3; next } /^[ \t]*\// { n = $1; sub(".*/", "", n); print n, $1 }')
done
printf '%s\n' "${gpu_needed[@]}" | sort -u > "$out/gpu-libs.txt"
# libcuda is the driver's; it is loaded by the CUDA runtime, not linked.
grep -q '^libcuda\.so' "$out/gpu-libs.txt" || echo "libcuda.so.1" >> "$out/gpu-libs.txt"
chmod 0644 "$out"/lib/* "$out"/lib-gz/* "$out"/lib-fallback/*

# The fixtures the tests read, under the same relative paths as in the tree.
for d in golden demo pipeline_golden pipeline_golden_n2 pipeline_golden_n4 wan_golden wan_vae umt5 wan_demo; do
  cp -r "$src/tests/data/$d" "$out/tests/data/"
done
# umt5's cases name the T5 tokenizer fixture.
mkdir -p "$out/tests/data/tokenizers"
cp -r "$src/tests/data/tokenizers/t5" "$out/tests/data/tokenizers/"
cp "$src/tests/gpu/bundle_run.sh" "$out/run.sh"
cp "$src/tests/gpu/ditd_smoke.sh" "$out/ditd_smoke.sh"
cp "$src/tests/bench/throughput.sh" "$out/throughput.sh"
chmod 0755 "$out/run.sh" "$out/ditd_smoke.sh" "$out/throughput.sh"

# Proof, on this machine, that everything resolves inside the bundle: every
# library a program needs is glibc's, an allowed GPU library, or one the
# bundle carries (lib/, the unpacked lib-gz/, lib-fallback/).
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for z in "$out"/lib-gz/*.gz; do
  gzip -dc "$z" > "$scratch/$(basename "$z" .gz)"
done
bad=0
for p in "$out"/bin/* "$out"/bin-cpu/* "$out"/lib/* "$scratch"/*; do
  while read -r name path; do
    [[ $name =~ $glibc_re ]] && continue
    [[ $name =~ $gpu_re ]] && continue
    case "$path" in
      "$out"/lib/* | "$out"/lib-fallback/* | "$scratch"/*) ;;
      *) echo "bundle.sh: $(basename "$p") resolves $name outside the bundle ($path)" >&2
         bad=1 ;;
    esac
  done < <(LD_LIBRARY_PATH="$out/lib:$scratch:$out/lib-fallback" ldd "$p" 2> /dev/null |
           awk '/=>/ { print $1, $3 }')
done
[ $bad -eq 0 ] || exit 1

bytes=$(du -sb "$out" | awk '{print $1}')
{
  echo "ditserve GPU check bundle"
  echo "commit: $(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$src" diff --quiet 2>/dev/null || echo ' (dirty)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "build_options: buildtype=release cuda=enabled gpu_sm=$sm march=$march"
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -n 1)"
  echo "gpu_libs_expected_on_the_machine: $(tr '\n' ' ' < "$out/gpu-libs.txt")"
  echo "bytes: $bytes"
  echo "files:"
  (cd "$out" && find . -type f ! -path './tests/*' -printf '  %p %s\n' | sort)
} > "$out/MANIFEST"
if [ "$bytes" -gt "$max_bytes" ]; then
  echo "bundle.sh: the bundle is $((bytes / 1048576)) MiB, over the 60 MiB limit" >&2
  exit 1
fi
echo "== bundle in $out: $(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }') MiB"
echo "   GPU libraries it expects on the GPU machine: $(tr '\n' ' ' < "$out/gpu-libs.txt")"
echo "   run there: $out/run.sh OUT_DIR   (then read OUT_DIR/summary.txt)"
