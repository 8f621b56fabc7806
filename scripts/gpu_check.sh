#!/usr/bin/env bash
# The GPU check (docs/device.md, "Running the GPU check"): build the device targets, then
# `make test-gpu` (the device tests with the cuda device, including the two-process same-GPU IPC
# test and tcp reads into and out of GPU memory), device_transfer_check (a second process serves
# 256 MiB of GPU memory, read all over shm's IPC path and over staged tcp, every byte checked, each
# rate against a copy within the GPU), `kvferry demo --memory cuda` (the whole pipeline on GPU
# memory, every byte verified) and `kvferry bench transport --memory cuda --json` (staged tcp on
# GPU memory against host-memory tcp). Meant for a machine with one NVIDIA GPU and the driver;
# takes well under 5 minutes there.
#
# With BUNDLE=<folder made by make device-bundle>, nothing is built: the folder's programs run
# (the device test binaries directly, with KVFERRY_REQUIRE_GPU=1), for a machine that has the
# driver but none of kvferry's libraries.
#
# Exit status: 0 all passed; 77 "no CUDA driver/device" (nothing was tested); 1 a failure, or no
# GPU while KVFERRY_REQUIRE_GPU=1.
#
# Environment: BUILD (build directory, default build), JOBS (parallel jobs, default nproc),
# BUNDLE (see above), KVFERRY_REQUIRE_GPU=1 (a missing GPU is a failure, not a skip).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
BUILD=${BUILD:-build}
JOBS=${JOBS:-$(nproc)}
start=$(date +%s)

if [ -n "${BUNDLE:-}" ]; then
  TESTS=$BUNDLE
  CLI=$BUNDLE/kvferry
  echo "== gpu_check: the programs of the bundle $BUNDLE (nothing is built)"
  for p in kvferry device_ipc_peer device_test cuda_gpu_test device_transport_test \
    device_transfer_check; do
    [ -x "$BUNDLE/$p" ] || { echo "gpu_check: FAILED: $BUNDLE/$p is missing (make device-bundle)"; exit 1; }
  done
else
  TESTS=$BUILD/tests
  CLI=$BUILD/kvferry
  echo "== gpu_check: configure and build the device targets ($BUILD, -j$JOBS)"
  if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo || exit 1
  fi
  cmake --build "$BUILD" -j "$JOBS" --target device_ipc_peer device_test cuda_header_check_test \
    cuda_gpu_test device_transport_test device_transfer_check kvferry_cli || exit 1
fi

echo "== gpu_check: probe"
"$TESTS/device_ipc_peer" probe
rc=$?
if [ $rc -eq 77 ]; then
  if [ "${KVFERRY_REQUIRE_GPU:-0}" = 1 ]; then
    echo "gpu_check: FAILED: KVFERRY_REQUIRE_GPU=1 but no CUDA driver/device was found"
    exit 1
  fi
  echo "gpu_check: no CUDA driver/device: the cuda path was NOT tested (exit 77)"
  exit 77
fi
[ $rc -eq 0 ] || { echo "gpu_check: the probe failed with status $rc"; exit 1; }

if [ -n "${BUNDLE:-}" ]; then
  echo "== gpu_check: the device tests of the bundle (KVFERRY_REQUIRE_GPU=1: none may skip)"
  for t in device_test cuda_gpu_test "device_transport_test --gtest_filter=CudaKinds/*"; do
    # shellcheck disable=SC2086 # the filter is a separate word
    KVFERRY_REQUIRE_GPU=1 "$BUNDLE"/$t || { echo "gpu_check: FAILED ($t)"; exit 1; }
  done
else
  echo "== gpu_check: make test-gpu"
  make --no-print-directory test-gpu BUILD="$BUILD" JOBS="$JOBS" || {
    echo "gpu_check: FAILED (make test-gpu)"
    exit 1
  }
fi
echo "== gpu_check: same-host IPC and staged tcp reads of 256 MiB, every byte checked"
"$TESTS/device_transfer_check" --device cuda:0 --mib 256 || {
  echo "gpu_check: FAILED (device_transfer_check)"
  exit 1
}
echo "== gpu_check: kvferry demo --memory cuda"
"$CLI" demo --memory cuda --requests 60 --max-prompt 1024 --num-blocks 1024 --layers 4 \
  --no-progress || { echo "gpu_check: FAILED (demo --memory cuda)"; exit 1; }
echo "== gpu_check: kvferry bench transport --memory cuda --json"
"$CLI" bench transport --memory cuda --sizes 65536,1048576 --pool-mib 256 --json || {
  echo "gpu_check: FAILED (bench transport --memory cuda)"
  exit 1
}
echo "gpu_check: passed in $(($(date +%s) - start)) s"
