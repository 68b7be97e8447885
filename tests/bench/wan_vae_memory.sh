#!/usr/bin/env bash
# Peak host memory and time of the AutoencoderKLWan decode (Wan 2.1's VAE,
# random weights) at 480x832 (latent 60x104), one child process per latent
# frame count (bench_wan_vae.c).
#   tests/bench/wan_vae_memory.sh [LATENT_FRAMES] [THREADS] [HEIGHT WIDTH]
# LATENT_FRAMES is a comma list (default 1,2,3; 81 video frames are 21 latent
# frames); HEIGHT and WIDTH are latent sizes (default 60 104). DIT_BUILD
# (build) and DIT_PYTHON (python3) as in compare_cpu_wan.sh; the VAE (~500 MB)
# is made once into $DIT_BUILD/bench-wan/vae.
set -euo pipefail
cd "$(dirname "$0")/../.."
frames=${1:-1,2,3}
threads=${2:-$(nproc)}
height=${3:-60}
width=${4:-104}
build=${DIT_BUILD:-build}
py=${DIT_PYTHON:-python3}
dir=$build/bench-wan/vae
"$py" tests/bench/make_wan_vae.py "$dir"
"$build/tests/bench_wan_vae" --vae "$dir" --latent-frames "$frames" --height "$height" \
  --width "$width" --threads "$threads"
