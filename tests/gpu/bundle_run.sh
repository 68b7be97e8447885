#!/usr/bin/env bash
# The GPU check, run from a bundle that tests/gpu/bundle.sh made (this file is
# the bundle's run.sh). No build and no install: only what the bundle carries,
# glibc, and the GPU libraries of the machine (the driver's libcuda, cuBLASLt
# and NCCL from the CUDA toolkit or from Python's nvidia-* packages).
#
#   run.sh OUT_DIR
#
# Stages (each logged to OUT_DIR/<stage>.log; the script keeps going after a
# failed stage):
#   cpu:  the golden forward cases and the whole-pipeline cases against
#         diffusers, and a 64x64 demo generation, on the cpu backend;
#   gpu:  the gpu test binaries (cuda vs cpu op by op, random models, diffusers
#         golden cases, NCCL, Wan 2.1's transformer, VAE decoder and UMT5
#         encoder against their references), where a GPU that fails to
#         initialise fails; the golden and forward tests once more on the
#         pipelined attention kernel (DIT_CUDA_ATTN=v2) and on cuDNN's SDPA
#         (DIT_CUDA_ATTN=cudnn, libcudnn.so.9 from the machine);
#         a 512x512 demo generation on cuda, timed (both kernel paths); ditd --backend cuda serving
#         one generation to ditctl, and under load with batching off and on
#         (throughput.sh); the FLUX.1-dev-sized forward benchmark,
#         eager and with CUDA graphs, legacy and fast kernel paths
#         (DIT_CUDA_PATH) and the fast path on attention v2 and on cudnn; the
#         smallest cuda test under compute-sanitizer, and attention v2's cases
#         under memcheck, racecheck and synccheck.
# OUT_DIR/summary.txt gets "key: value" lines. Exit status: 0 when every stage
# passed, 77 when the CPU stage passed and there is no GPU ("gpu: none"),
# 1 when any stage failed, 2 on bad usage.
set -uo pipefail
if [ $# -ne 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
mkdir -p "$1" || exit 2
out=$(cd "$1" && pwd)
B=$(cd "$(dirname "$0")" && pwd)
summary="$out/summary.txt"
: > "$summary"
: > "$out/run.log"
failed=0
t_start=$(date +%s)
budget_s=${DIT_GPU_BUDGET_S:-330} # optional stages are skipped past this

note() { echo "$1: $2" >> "$summary"; }
say() { echo "$*" | tee -a "$out/run.log"; }
elapsed() { echo $(($(date +%s) - t_start)); }
stage() { # stage NAME TIMEOUT_S CMD...: runs with a time limit, logs, records
  local name=$1 limit=$2
  shift 2
  # DIT_GPU_ONLY="stage ..." runs those stages alone (a rerun of a few).
  if [ -n "${DIT_GPU_ONLY:-}" ] && [[ " $DIT_GPU_ONLY " != *" $name "* ]]; then
    note "${name}_status" "skipped (DIT_GPU_ONLY)"
    return 0
  fi
  # DIT_GPU_STAGE_MAX caps every stage's limit (a short lease).
  if [ -n "${DIT_GPU_STAGE_MAX:-}" ] && [ "$limit" -gt "$DIT_GPU_STAGE_MAX" ]; then
    limit=$DIT_GPU_STAGE_MAX
  fi
  local t0 t1 rc
  t0=$(date +%s.%N)
  say "== $name: $*"
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  local st=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    st="failed (timed out after ${limit} s)"
  elif [ $rc -ne 0 ]; then
    st="failed (exit $rc)"
  fi
  note "${name}_status" "$st"
  note "${name}_seconds" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')"
  if [ $rc -ne 0 ]; then
    failed=1
    say "   $st, see $name.log"
    tail -n 25 "$out/$name.log" | sed 's/^/   | /' | tee -a "$out/run.log"
  fi
  return $rc
}

note date "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
note host "$(hostname 2>/dev/null || cat /etc/hostname 2>/dev/null || echo unknown)"
note bundle "$(sed -n 's/^commit: //p' "$B/MANIFEST" 2>/dev/null) built $(sed -n 's/^built: //p' "$B/MANIFEST" 2>/dev/null)"

# -- Libraries ---------------------------------------------------------------
# The large libraries travel gzipped: unpack them once into a scratch folder.
scratch=$(mktemp -d "${TMPDIR:-/tmp}/ditserve-bundle.XXXXXX") || exit 1
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/lib"
for z in "$B"/lib-gz/*.gz; do
  [ -f "$z" ] || continue
  gzip -dc "$z" > "$scratch/lib/$(basename "$z" .gz)" || { say "cannot unpack $z"; exit 1; }
done
libpath="$B/lib:$scratch/lib"
# libstdc++/libgcc_s: the machine's own when it has them (a newer one is what
# its cuBLASLt and NCCL expect), the bundle's otherwise.
if ! { ldconfig -p 2>/dev/null || true; } | grep -q 'libstdc++\.so\.6 '; then
  libpath="$libpath:$B/lib-fallback"
  note libstdcxx "bundled (the machine has none)"
else
  note libstdcxx "the machine's"
fi

# Where a GPU library may be: the CUDA toolkit, the driver's folders, the
# system's, and the lib folders of Python's nvidia-* packages (cuBLAS ships
# as nvidia-cublas, NCCL as nvidia-nccl-cu13).
candidate_dirs() {
  local d
  for d in ${CUDA_HOME:+"$CUDA_HOME/lib64"} ${CUDA_HOME:+"$CUDA_HOME/lib"} \
           /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib \
           /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64 \
           /usr/lib; do
    [ -d "$d" ] && echo "$d"
  done
  local py
  for py in python3 /usr/bin/python3; do
    command -v "$py" > /dev/null 2>&1 || continue
    "$py" - 2> /dev/null << 'EOF'
import glob, os, site, sys
roots = list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path
seen = set()
for r in roots:
    for d in glob.glob(os.path.join(r, "nvidia", "*", "lib")) + glob.glob(os.path.join(r, "nvidia", "*", "*", "lib")):
        d = os.path.realpath(d)
        if d not in seen and os.path.isdir(d):
            seen.add(d)
            print(d)
EOF
    break
  done
}
mapfile -t dirs < <(candidate_dirs)
find_lib() { # find_lib SONAME: prints the first folder that holds it
  local d
  for d in "${dirs[@]}"; do
    if [ -e "$d/$1" ]; then
      echo "$d"
      return 0
    fi
  done
  local hit
  hit=$({ ldconfig -p 2>/dev/null || true; } | awk -v n="$1" '$1 == n { print $NF; exit }')
  [ -n "$hit" ] && dirname "$hit" && return 0
  return 1
}
missing_gpu_libs=()
gpu_dirs=""
while read -r so; do
  [ -n "$so" ] || continue
  key=$(echo "$so" | sed 's/\.so.*//; s/^lib//' | tr 'A-Z' 'a-z')
  if d=$(find_lib "$so"); then
    note "lib_$key" "$d/$so"
    case ":$gpu_dirs:" in *":$d:"*) ;; *) gpu_dirs="$gpu_dirs:$d" ;; esac
  else
    note "lib_$key" "not found"
    missing_gpu_libs+=("$so")
  fi
done < "$B/gpu-libs.txt"
# Optional: cuDNN (DIT_CUDA_ATTN=cudnn dlopen's libcudnn.so.9; torch ships
# it as nvidia-cudnn-cu13) and NVRTC, which cuDNN's runtime-compiled
# attention engine loads. Nothing links them: without them only the cudnn
# stages fail, each saying why.
for so in libcudnn.so.9 libnvrtc.so.13; do
  key=$(echo "$so" | sed 's/\.so.*//; s/^lib//')
  if d=$(find_lib "$so"); then
    note "lib_$key" "$d/$so"
    case ":$gpu_dirs:" in *":$d:"*) ;; *) gpu_dirs="$gpu_dirs:$d" ;; esac
  else
    note "lib_$key" "not found (optional)"
  fi
done
export LD_LIBRARY_PATH="$libpath$gpu_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
say "libraries: bundle ($B/lib, unpacked $scratch/lib); GPU:${gpu_dirs:- none found}"
[ ${#missing_gpu_libs[@]} -eq 0 ] || say "GPU libraries not found: ${missing_gpu_libs[*]}"

# -- Is there a GPU? ---------------------------------------------------------
gpu="none"
if command -v nvidia-smi > /dev/null 2>&1; then
  g=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
      head -n 1)
  [ -n "$g" ] && gpu="$g"
fi
if [ "$gpu" = "none" ] && ls /dev/nvidia[0-9]* > /dev/null 2>&1; then
  gpu="unknown (a /dev/nvidia device exists but nvidia-smi does not list it)"
fi
note gpu "$gpu"
say "gpu: $gpu"

# -- CPU stage ---------------------------------------------------------------
# The CUDA build's programs where the GPU libraries resolve (they are the
# ones the GPU stages run), the bundle's CPU-only build otherwise.
cpubin="$B/bin"
if [ ${#missing_gpu_libs[@]} -gt 0 ] && ! { [ ${#missing_gpu_libs[@]} -eq 1 ] &&
                                           [ "${missing_gpu_libs[0]}" = libcuda.so.1 ]; }; then
  cpubin="$B/bin-cpu"
fi
note cpu_stage_programs "$(basename "$cpubin")"
export DIT_SOURCE_ROOT="$B"
export CK_DEFAULT_TIMEOUT=300
export DITRUN="$cpubin/ditrun"
stage cpu_golden 120 "$cpubin/test_flux_golden"
note cpu_golden_worst_rel "$(grep -oE 'rel(ative)?( error)? [0-9.e+-]+' "$out/cpu_golden.log" |
  awk '{print $NF}' | sort -g | tail -n 1)"
stage cpu_pipeline 180 "$cpubin/test_pipeline"
stage cpu_generate 120 "$cpubin/ditrun" generate --model "$B/tests/data/demo" \
  --prompt "a lighthouse on a cliff at sunset, oil painting" --width 64 --height 64 --steps 2 \
  --seed 42 --backend cpu --output "$out/demo_cpu.png"
note cpu_generate_timing "$(grep -m 1 'time:' "$out/cpu_generate.log")"
cpu_failed=$failed

if [ "$gpu" = "none" ]; then
  note total_seconds "$(elapsed)"
  if [ $cpu_failed -ne 0 ]; then
    note overall "failed (cpu stage)"
    say "== no GPU, and the CPU stage failed"
    exit 1
  fi
  note overall "cpu stage ok; no GPU"
  say "== no GPU here: the CPU stage passed; exit 77"
  cat "$summary"
  exit 77
fi

# -- GPU stages --------------------------------------------------------------
# From here a GPU that cannot be used is a failure, never a skip.
export DIT_GPU_REQUIRED=1
export DITRUN="$B/bin/ditrun"
for t in "$B"/bin/test_cuda_*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  name=${name#test_}
  stage "gpu_$name" 240 "$t"
  # The figures each test prints: errors against the cpu backend or diffusers.
  grep -E "cuda vs|rel |max abs|max err|NaN|fallback|graph" "$out/gpu_$name.log" |
    sed "s/^/$name: /" | head -n 80 >> "$out/gpu_numbers.txt"
done
# cuda_golden runs the backend's default kernel path (fast: bf16 q/k/v and
# GEMM outputs); once more on the legacy one (f32 activations), which the
# other tests cover op by op.
if [ -x "$B/bin/test_cuda_golden" ]; then
  DIT_CUDA_PATH=legacy stage gpu_cuda_golden_legacy 240 "$B/bin/test_cuda_golden"
  grep -E "cuda vs|rel " "$out/gpu_cuda_golden_legacy.log" | sed "s/^/cuda_golden_legacy: /" |
    head -n 40 >> "$out/gpu_numbers.txt"
fi
# The attention kernel of bf16 q/k/v: DIT_CUDA_ATTN=v2 (pipelined) is not
# the default yet. test_cuda_ops checks it op by op (bit-identical to v1);
# here the golden and whole-forward tests run on it as well.
for t in cuda_golden cuda_forward; do
  [ -x "$B/bin/test_$t" ] || continue
  DIT_CUDA_ATTN=v2 stage "gpu_${t}_attn_v2" 240 "$B/bin/test_$t"
  grep -E "cuda vs|rel |max abs|graph" "$out/gpu_${t}_attn_v2.log" | sed "s/^/${t}_attn_v2: /" |
    head -n 40 >> "$out/gpu_numbers.txt"
done
# cuDNN's SDPA (DIT_CUDA_ATTN=cudnn): its operation as the library checks
# it (no device needed), then the golden and whole-forward tests on it
# (test_cuda_ops' attn_cudnn case checks it op by op against the cpu).
if [ -x "$B/bin/test_cudnn_sdpa" ]; then
  stage gpu_cudnn_sdpa 60 "$B/bin/test_cudnn_sdpa"
  note cudnn_version "$(grep -m 1 '^cudnn_sdpa:' "$out/gpu_cudnn_sdpa.log" 2>/dev/null)"
fi
for t in cuda_golden cuda_forward; do
  [ -x "$B/bin/test_$t" ] || continue
  DIT_CUDA_ATTN=cudnn stage "gpu_${t}_attn_cudnn" 240 "$B/bin/test_$t"
  grep -E "cuda vs|rel |max abs|graph|cudnn" "$out/gpu_${t}_attn_cudnn.log" |
    sed "s/^/${t}_attn_cudnn: /" | head -n 40 >> "$out/gpu_numbers.txt"
done
note attn_v2_flux_size "$(grep -m 1 'v2 vs v1' "$out/gpu_cuda_ops.log" 2>/dev/null)"
note attn_cudnn_flux_size "$(grep -m 1 'cudnn vs v1' "$out/gpu_cuda_ops.log" 2>/dev/null)"
note attn_cudnn_shapes_refused "$(grep -c 'cuDNN has no SDPA plan' "$out"/*.log 2>/dev/null | awk -F: '{s += $2} END {print s + 0}')"
note vae_attention_qpw "$(grep -m 1 'vae-size attention' "$out/gpu_cuda_ops.log" 2>/dev/null)"
worst=$(grep -oE "rel [0-9.e+-]+" "$out/gpu_numbers.txt" 2>/dev/null | awk '{print $2}' |
        sort -g | tail -n 1)
note gpu_golden_worst_rel "${worst:-n/a}"

stage generate_cuda 180 "$B/bin/ditrun" generate --model "$B/tests/data/demo" \
  --prompt "a lighthouse on a cliff at sunset, oil painting" --width 512 --height 512 \
  --steps 8 --seed 42 --backend cuda --output "$out/demo_cuda.png"
note generate_cuda_timing "$(grep -m 1 'time:' "$out/generate_cuda.log")"
DIT_CUDA_PATH=legacy stage generate_cuda_legacy 180 "$B/bin/ditrun" generate \
  --model "$B/tests/data/demo" --prompt "a lighthouse on a cliff at sunset, oil painting" \
  --width 512 --height 512 --steps 8 --seed 42 --backend cuda \
  --output "$out/demo_cuda_legacy.png"
note generate_cuda_legacy_timing "$(grep -m 1 'time:' "$out/generate_cuda_legacy.log")"

# A clip from the tiny Wan pipeline on cuda (its parity is test_cuda_wan's).
stage generate_wan_cuda 180 "$B/bin/ditrun" generate --model "$B/tests/data/wan_demo" \
  --prompt "a paper boat drifting down a rainy street" --width 128 --height 96 --frames 17 \
  --steps 8 --seed 42 --backend cuda --output "$out/wan_cuda.safetensors"
note generate_wan_cuda_timing "$(grep -m 1 'time:' "$out/generate_wan_cuda.log")"

# ditd on the cuda backend, one worker, serving one generation to ditctl.
stage ditd_cuda 240 "$B/ditd_smoke.sh" "$B/bin" "$B/tests/data/demo" "$out" cuda
note ditd_cuda_latency "$(grep -m 1 '^latency:' "$out/ditd_cuda.log")"
note ditd_cuda_server_time "$(grep -m 1 '^time:' "$out/ditd_cuda.log")"

# Serving throughput on the GPU: ditd on the demo pipeline with batching off
# and on (--max-batch 1 and 4), each under ditctl bench at concurrency 1, 4
# and 16 (256x256, 8 steps, after a warm-up of that shape); the summary gets
# each setting's row at concurrency 16 (req/s, latency percentiles, overhead).
stage ditd_throughput 300 "$B/throughput.sh" "$B/tests/data/demo" --bin "$B/bin" \
  --backend cuda --warmup 256x256:8 --only batch1,batch4 -n 48 --threads 8 --full
for l in batch1 batch4; do
  note "ditd_throughput_${l}_c16" "$(awk -v l="$l" '/^== [^ ]+: ditd / { lab = $2; sub(":", "", lab) }
    lab == l && $1 == "16" && NF >= 11 { $1 = $1; print "req/s " $5 ", p50 " $6 ", p99 " $8 \
    " ms, overhead " $10 " ms"; exit }' "$out/ditd_throughput.log")"
done

# The FLUX.1-dev-sized benchmark: random bf16 weights made on the device,
# eager passes and CUDA-graph replays, both kernel paths, and the fast path
# once more on the pipelined attention kernel (keys fast_attn_v2_*) and on
# cuDNN's SDPA (fast_attn_cudnn_*).
bench_args=(--backend cuda --flux-dev --graph both --cuda-path both --cuda-attn all --warmup 2
            --iters 10 --flop-per-step 74.4e12 --summary "$summary")
stage bench_flux_dev 300 "$B/bin/bench_flux_forward" "${bench_args[@]}"
sed 's/^/   /' "$out/bench_flux_dev.log" | tail -n 40 | tee -a "$out/run.log" > /dev/null

# Request batching (ditd --max-batch) on the GPU: the same FLUX.1-dev-sized
# forward at batch 2 and 4 (graph replays), to set against batch 1 above:
# per-image cost = ms per forward / batch.
for b in 2 4; do
  stage "bench_batch$b" 240 "$B/bin/bench_flux_forward" --backend cuda --flux-dev --graph on \
    --warmup 2 --iters 5 --batch "$b" --flop-per-step "$(awk -v b="$b" 'BEGIN {print 74.4e12 * b}')"
  note "bench_batch${b}_forward" "$(grep -m 1 'forward' "$out/bench_batch$b.log")"
done

# compute-sanitizer (memcheck) over the smallest cuda test, when time allows.
san=""
for c in compute-sanitizer /usr/local/cuda/bin/compute-sanitizer \
         /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  if command -v "$c" > /dev/null 2>&1; then
    san=$(command -v "$c")
    break
  fi
done
# test_cuda_ops without its FLUX-size case (CK_RUN_CASE=parity): every op
# once, small shapes, both kernel paths.
small=test_cuda_ops
if [ -z "$san" ]; then
  note sanitizer_status "skipped (no compute-sanitizer found)"
elif [ "$(elapsed)" -gt "$budget_s" ]; then
  note sanitizer_status "skipped (past the ${budget_s} s budget)"
else
  CK_RUN_CASE=parity stage sanitizer 150 "$san" --tool memcheck --error-exitcode 9 \
    --leak-check no "$B/bin/$small"
  note sanitizer_errors "$(grep -m 1 -oE 'ERROR SUMMARY: [0-9]+ errors?' "$out/sanitizer.log")"
  # The pipelined attention kernel (cp.async, ldmatrix, barriers) under
  # memcheck, racecheck (shared-memory hazards between its warps) and
  # synccheck (barrier use), each while the run is inside its budget.
  for tool in memcheck racecheck synccheck; do
    if [ "$(elapsed)" -gt "$budget_s" ]; then
      note "sanitizer_attn_v2_${tool}_status" "skipped (past the ${budget_s} s budget)"
      continue
    fi
    CK_RUN_CASE=attn_v2 stage "sanitizer_attn_v2_$tool" 120 "$san" --tool "$tool" \
      --error-exitcode 9 "$B/bin/$small"
    note "sanitizer_attn_v2_${tool}_errors" \
      "$(grep -m 1 -oE '(ERROR|RACECHECK) SUMMARY: [0-9]+ (errors?|hazards?)' \
        "$out/sanitizer_attn_v2_$tool.log")"
  done
fi

note total_seconds "$(elapsed)"
note overall "$([ $failed -eq 0 ] && echo ok || echo failed)"
say "== summary ($summary)"
cat "$summary"
exit $failed
