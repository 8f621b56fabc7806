#!/usr/bin/env bash
# The NPU check (docs/device.md, "Running the NPU check"): the acl device's tests on a real Ascend
# NPU (make test-npu, or the bundle's acl_npu_test: copies in every direction, scattered blocks through pinned staging, Query,
# an event on a native stream, a two-process same-NPU IPC read and write), then
# device_transfer_check: a second process serves 256 MiB of NPU memory and this one reads all of it
# over shm (same-host IPC, NPU to NPU) and over tcp (staged through pinned host memory at both
# ends), every byte checked, each read's rate printed against a copy within the NPU in this
# process. Meant for a machine with an NPU, CANN (8.2.RC1 or newer for IPC) and its set_env.sh
# sourced; well under 5 minutes there.
#
# Exit status: 0 all passed; 77 "no NPU runtime/device" (nothing was tested); 1 a failure, or no
# NPU while KVFERRY_REQUIRE_NPU=1.
#
# Environment: BUILD (build directory, default build), JOBS (parallel jobs, default nproc),
# BUNDLE (a folder made by make device-bundle: run its programs, build nothing),
# KVFERRY_REQUIRE_NPU=1 (a missing NPU is a failure, not a skip), NPU_CHECK_MIB (default 256).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
BUILD=${BUILD:-build}
JOBS=${JOBS:-$(nproc)}
MIB=${NPU_CHECK_MIB:-256}
start=$(date +%s)

if [ -n "${BUNDLE:-}" ]; then
  BIN=$BUNDLE
  echo "== npu_check: the programs of the bundle $BUNDLE (nothing is built)"
  for p in device_ipc_peer acl_npu_test device_transfer_check; do
    [ -x "$BIN/$p" ] || { echo "npu_check: FAILED: $BIN/$p is missing (make device-bundle)"; exit 1; }
  done
else
  BIN=$BUILD/tests
  echo "== npu_check: configure and build the device targets ($BUILD, -j$JOBS)"
  if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo || exit 1
  fi
  cmake --build "$BUILD" -j "$JOBS" --target device_ipc_peer acl_npu_test device_transfer_check ||
    exit 1
fi

echo "== npu_check: probe"
timeout 60 "$BIN/device_ipc_peer" probe npu:0
rc=$?
if [ $rc -eq 77 ]; then
  if [ "${KVFERRY_REQUIRE_NPU:-0}" = 1 ]; then
    echo "npu_check: FAILED: KVFERRY_REQUIRE_NPU=1 but no NPU runtime/device was found"
    exit 1
  fi
  echo "npu_check: no NPU runtime/device: the npu path was NOT tested (exit 77)"
  exit 77
fi
[ $rc -eq 0 ] || { echo "npu_check: the probe failed with status $rc"; exit 1; }

echo "== npu_check: the NPU tests (KVFERRY_REQUIRE_NPU=1: none may skip)"
if [ -n "${BUNDLE:-}" ]; then
  KVFERRY_REQUIRE_NPU=1 timeout 180 "$BIN/acl_npu_test" || { echo "npu_check: FAILED (acl_npu_test)"; exit 1; }
else
  timeout 180 make --no-print-directory test-npu BUILD="$BUILD" JOBS="$JOBS" ||
    { echo "npu_check: FAILED (make test-npu)"; exit 1; }
fi
echo "== npu_check: same-host IPC and staged tcp reads of $MIB MiB, every byte checked"
timeout 180 "$BIN/device_transfer_check" --device npu:0 --mib "$MIB" ||
  { echo "npu_check: FAILED (device_transfer_check)"; exit 1; }
echo "npu_check: passed in $(($(date +%s) - start)) s"
