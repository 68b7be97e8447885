#!/usr/bin/env bash
# Installs the Debian packages ditserve builds and tests with, and the venv of
# the HTTP tests' Python clients (build-tools/py-e2e: the official openai
# client from PyPI, over the system's grpcio and selenium). Idempotent: when
# everything is present it does nothing (and needs no network).
#   deploy/install-deps.sh              build and test dependencies
#   deploy/install-deps.sh --build-only what building needs (the container image)
# The CUDA toolkit (nvcc, cuBLASLt, NCCL) is not a Debian package here; the
# build uses it when it is on PATH and skips the GPU code otherwise.
set -euo pipefail

packages=(
  build-essential pkg-config meson ninja-build  # compiler and build system
  libopenblas-openmp-dev                       # GEMMs on the cpu backend (OpenMP build)
  libcjson-dev                                 # config.json and safetensors headers
  libpng-dev                                   # PNG encoding of generated images
  libavcodec-dev libavformat-dev libavutil-dev libswscale-dev  # FFmpeg: H.264 MP4 of generated video
  libutf8proc-dev                              # Unicode classes and normalization (tokenizers)
  protobuf-c-compiler libprotobuf-c-dev        # protoc-c and the protobuf-c runtime (API, IPC)
  protobuf-compiler libprotobuf-dev            # protoc (descriptor set) and the well-known protos
  libgrpc-dev                                  # gRPC C core: ditd's server, ditctl's client
  libuv1-dev                                   # ditd's event loop, worker processes, IPC
  libmicrohttpd-dev                            # ditd's metrics endpoint and HTTP API
  libgnutls28-dev                              # client certificate checks on the HTTP API
  libssl-dev                                   # libcrypto: HMAC of the multi-node join handshake
  check                                        # unit-test framework
  clang-format                                 # the formatting check of the unit suite
  openssl                                      # test certificates for the TLS tests
  python3-grpcio python3-protobuf              # the Python interop client of the e2e tests
  python3-venv                                 # CI's venv for the deployment linters
)
build_only=false
if [ "${1:-}" = "--build-only" ]; then
  build_only=true
else
  packages+=(
    chromium chromium-driver python3-selenium  # a real browser on the playground page
  )
fi
cd "$(dirname "$0")/.."

# The HTTP tests' clients: the official openai package (PyPI) in a venv that
# also sees the system's grpcio, protobuf and selenium.
install_py_e2e() {
  $build_only && return 0
  local py=build-tools/py-e2e/bin/python
  if [ -x "$py" ] && "$py" -c 'import openai, grpc, selenium' 2>/dev/null; then
    return 0
  fi
  rm -rf build-tools/py-e2e
  /usr/bin/python3 -m venv --system-site-packages build-tools/py-e2e
  build-tools/py-e2e/bin/pip install --quiet --disable-pip-version-check 'openai>=1.40'
}

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  install_py_e2e
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  sudo="sudo"
fi
echo "installing: ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
install_py_e2e
