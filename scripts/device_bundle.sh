#!/usr/bin/env bash
# make device-bundle (docs/device.md, "The device bundle"): one self-contained folder with the CLI,
# the device tests and their helpers, and every shared library they need except the C library's
# own (glibc) and the accelerator's (the CUDA driver, CANN: they belong to the machine), for a
# machine that lends a GPU or an NPU but has none of kvferry's libraries and reaches no package
# registry. The programs are linked with an RPATH of $ORIGIN (tests/CMakeLists.txt), so they find
# the libraries beside them; scripts/gpu_check.sh and scripts/npu_check.sh run from the folder
# when given BUNDLE=<folder>, building nothing.
#
#   scripts/device_bundle.sh [--build-dir DIR] [--out DIR] [--no-build] [--check]
#     --build-dir  the build to take the programs from (default build)
#     --out        the folder to make (default <build-dir>/device-bundle); replaced if it exists
#     --no-build   take the programs as they are (default: build them first)
#     --check      then run every program of the folder in a clean environment (env -i, an empty
#                  LD_LIBRARY_PATH): each starts, resolves every library inside the folder or from
#                  glibc, and the device tests SKIP loudly where there is no device
#
# Exit status: 0 made (and checked); 1 a failure (a missing program, a library not found, a folder
# of 64 MiB or more, a program that does not start or a device test that did not skip loudly).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
BUILD=build
OUT=""
DO_BUILD=1
CHECK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) BUILD=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --no-build) DO_BUILD=0; shift ;;
    --check) CHECK=1; shift ;;
    *) sed -n '2,22p' "$0"; exit 2 ;;
  esac
done
OUT=${OUT:-$BUILD/device-bundle}
LIMIT=$((64 * 1024 * 1024))
# The programs and where the build puts them.
PROGRAMS="kvferry:. device_ipc_peer:tests device_test:tests cuda_gpu_test:tests acl_npu_test:tests
  device_transport_test:tests device_transfer_check:tests"
# Libraries that are part of glibc (the machine's own C library must load them) and the
# accelerator's: never copied.
EXCLUDE='^(linux-vdso\.so|ld-linux.*\.so|libc\.so|libm\.so|libpthread\.so|libdl\.so|librt\.so|libresolv\.so|libutil\.so|libanl\.so|libcuda\.so|libnvidia-|libascendcl\.so|libruntime\.so|libascend_)'

fail() {
  echo "device_bundle: FAILED: $*"
  exit 1
}

if [ $DO_BUILD = 1 ]; then
  targets=()
  for p in $PROGRAMS; do
    name=${p%%:*}
    [ "$name" = kvferry ] && name=kvferry_cli  # the CLI's target
    targets+=("$name")
  done
  [ -f "$BUILD/CMakeCache.txt" ] || cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo || exit 1
  cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" --target "${targets[@]}" ||
    fail "building ${targets[*]}"
fi

rm -rf "$OUT"
mkdir -p "$OUT" || exit 1
for p in $PROGRAMS; do
  name=${p%%:*}
  src="$BUILD/${p#*:}/$name"
  [ -x "$src" ] || fail "$src is not built (make device-bundle builds it)"
  # shellcheck disable=SC2016 # a literal $ORIGIN
  readelf -d "$src" | grep -q '(RPATH).*\$ORIGIN' ||
    fail "$src has no RPATH \$ORIGIN (DT_RPATH): reconfigure the build (cmake -S . -B $BUILD)"
  objcopy --strip-debug "$src" "$OUT/$name" || fail "copying $src"
done
# Every library the programs need, found as the loader finds it here, copied beside them.
for f in "$OUT"/*; do
  while read -r lib arrow path rest; do
    [ "$arrow" = "=>" ] || continue
    [[ "$lib" =~ $EXCLUDE ]] && continue
    [ "$path" = "not" ] && fail "$(basename "$f") needs $lib, which the loader does not find here"
    [ -e "$OUT/$lib" ] || objcopy --strip-debug "$(readlink -f "$path")" "$OUT/$lib" ||
      fail "copying $path"
  done < <(env -i LD_LIBRARY_PATH= ldd "$f" 2>/dev/null)
done
{
  echo "kvferry device bundle, made $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "run: BUNDLE=<this folder> scripts/gpu_check.sh   or   BUNDLE=<this folder> scripts/npu_check.sh"
  echo "needs on the machine: glibc $(ldd --version | head -1 | grep -o '[0-9.]*$') or newer; the NVIDIA driver or CANN"
  echo
  find "$OUT" -maxdepth 1 -type f ! -name MANIFEST -printf '%10s  %f\n' | sort -k2
} >"$OUT/MANIFEST"
size=$(du -sb "$OUT" | cut -f1)
echo "device_bundle: $OUT: $(find "$OUT" -maxdepth 1 -type f | wc -l) files, $((size / 1024 / 1024)) MiB"
[ "$size" -lt $LIMIT ] || fail "the folder has $size bytes; the limit is 64 MiB"
[ $CHECK = 1 ] || exit 0

# ---- --check: each program in a clean environment ----
clean() { env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH= "$@"; }
for p in $PROGRAMS; do
  name=${p%%:*}
  while read -r lib arrow path rest; do
    [ "$arrow" = "=>" ] || continue
    case "$path" in
      "$(cd "$OUT" && pwd)"/*) ;;
      *) [[ "$lib" =~ $EXCLUDE ]] || fail "$name resolves $lib to $path, outside the bundle" ;;
    esac
  done < <(clean ldd "$OUT/$name")
done
echo "device_bundle: every program resolves its libraries inside the bundle or from glibc"
expect() {  # expect <exit status> <texts the output holds, separated by ";"> <command...>
  local want=$1 texts=$2
  shift 2
  local out rc text
  out=$(clean "$@" 2>&1)
  rc=$?
  [ $rc -eq "$want" ] || fail "$(basename "$1") ${*:2}: exit status $rc, expected $want: $(echo "$out" | tail -5)"
  IFS=';' read -ra wanted <<<"$texts"
  for text in "${wanted[@]}"; do
    grep -qF -- "$text" <<<"$out" || fail "$(basename "$1") ${*:2}: no \"$text\" in: $(echo "$out" | tail -5)"
  done
  echo "device_bundle: ok: $(basename "$1") ${*:2}"
}
expect 0 "demo" "$OUT/kvferry" --help
expect 2 "usage" "$OUT/device_ipc_peer"
expect 0 "PASSED" "$OUT/device_test" --gtest_filter='SimDeviceTest.Copies*:IpcHandleTest.*:OpenDeviceTest.*'
expect 0 "AclNpuTest" "$OUT/acl_npu_test" --gtest_list_tests
expect 0 "CudaKinds" "$OUT/device_transport_test" --gtest_list_tests
if clean "$OUT/device_ipc_peer" probe cuda:0 >/dev/null 2>&1; then
  echo "device_bundle: this machine has a GPU: the skip checks of the cuda tests do not apply"
else
  expect 77 "no CUDA driver/device" "$OUT/device_ipc_peer" probe cuda:0
  expect 0 "[  SKIPPED ];no CUDA driver/device" "$OUT/cuda_gpu_test"
  expect 0 "[  SKIPPED ];no CUDA driver/device" "$OUT/device_transport_test" --gtest_filter='CudaKinds/*'
  expect 77 "nothing was tested" "$OUT/device_transfer_check" --device cuda:0 --mib 1
fi
if clean "$OUT/device_ipc_peer" probe npu:0 >/dev/null 2>&1; then
  echo "device_bundle: this machine has an NPU: the skip checks of the npu tests do not apply"
else
  expect 77 "no NPU runtime/device" "$OUT/device_ipc_peer" probe npu:0
  expect 0 "[  SKIPPED ];no NPU runtime/device" "$OUT/acl_npu_test"
  expect 77 "nothing was tested" "$OUT/device_transfer_check" --device npu:0 --mib 1
fi
echo "device_bundle: checked"
