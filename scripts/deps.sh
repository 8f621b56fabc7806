#!/usr/bin/env bash
# Installs the Debian packages kvferry needs to build, test and fuzz. Idempotent: when everything
# is present it only checks (well under a second) and prints nothing.
set -euo pipefail

PACKAGES=(
  g++ make cmake pkg-config lld        # toolchain (lld: faster links)
  clang libclang-rt-14-dev             # libFuzzer targets (make fuzz), make tsa
  clang-format clang-tidy              # make format-check, make tidy
  libssl-dev                           # SHA-256, HMAC
  libspdlog-dev libfmt-dev             # logging
  nlohmann-json3-dev                   # rank table
  libmsgpack-cxx-dev                   # wire format
  libzmq3-dev cppzmq-dev               # side channel
  libcli11-dev                         # CLI
  libcpp-httplib-dev                   # GET /metrics, kvferry top
  libucx-dev ucx-utils                 # the ucx backend (ucp, ucs; ucx_info)
  libgtest-dev libgmock-dev            # tests
  libbenchmark-dev                     # micro-benchmarks
  gnuplot-nox                          # bench e2e --chart
  pybind11-dev python3-dev             # the Python module
  python3-pytest python3-numpy         # its tests
  python3-prometheus-client            # /metrics checked by Prometheus's own text parser
  python3-torch                        # vLLM adapter tests with real (CPU) torch tensors
  iproute2 nftables                    # two-host tests: namespaces, tbf, packet loss
  python3-venv python3-setuptools python3-wheel python3-build  # the wheel, offline (setup.py)
  python3-aiohttp python3-zmq          # kvferry-proxy; its tests' control client (docs/control.md)
  etcd-server                          # the fleet tests' real etcd (docs/fleet.md)
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "make deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "make deps: done"
