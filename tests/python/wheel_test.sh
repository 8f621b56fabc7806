#!/usr/bin/env bash
# The wheel built from source, offline (issue 21, item 1): `python3 -m build --wheel
# --no-isolation` and `pip install .`, each into a fresh venv made with --system-site-packages;
# the installed package imports, its commands run, the Python tests pass against the installed
# copy (not build/python), and `pip uninstall kvferry` removes every file it installed.
#
# Usage: wheel_test.sh SOURCE_DIR CMAKE_BUILD_DIR WORK_DIR
# The wheel reuses CMAKE_BUILD_DIR (KVFERRY_CMAKE_BUILD_DIR): only _kvferry and kvferry_cli are
# brought up to date there, so this test never rebuilds the C++ tree. setuptools' own build
# directory and egg-info go under WORK_DIR (DIST_EXTRA_CONFIG), not into the source tree.
set -euo pipefail
SRC=$(cd "$1" && pwd)
BUILD=$(cd "$2" && pwd)
WORK=$3
PY=/usr/bin/python3
rm -rf "$WORK"
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
cat > "$WORK/setup-extra.cfg" <<CFG
[build]
build_base = $WORK/setuptools-build
[egg_info]
egg_base = $WORK
CFG
export DIST_EXTRA_CONFIG=$WORK/setup-extra.cfg KVFERRY_CMAKE_BUILD_DIR=$BUILD
unset PYTHONPATH
begin=$(date +%s)
say() { echo "wheel_test ($(( $(date +%s) - begin )) s): $*"; }
fail() { echo "wheel_test: FAILED: $*" >&2; exit 1; }
run_logged() {  # LOG COMMAND...: runs it with a deadline, shows the log's end if it fails
  local log=$1; shift
  if ! timeout 900 "$@" >"$log" 2>&1; then tail -40 "$log" >&2; fail "$* (log: $log)"; fi
}

# Checks an installed venv: imports from it, its commands, its stubs.
check_install() {
  local venv=$1
  (cd "$WORK" && "$venv/bin/python" - "$venv" <<'PYCHECK'
import os, sys
import kvferry, kvferry.vllm, kvferry.vllm_plugin, kvferry.proxy.app, kvferry.sglang
venv = os.path.realpath(sys.argv[1])
for module in (kvferry, kvferry.vllm, kvferry.sglang, kvferry.proxy.app, kvferry._kvferry):
    path = os.path.realpath(module.__file__)
    assert path.startswith(venv + os.sep), f"{module.__name__} imported from {path}, not {venv}"
here = os.path.dirname(kvferry.__file__)
for stub in ("_kvferry.pyi", "py.typed"):
    assert os.path.isfile(os.path.join(here, stub)), f"{stub} is not installed in {here}"
PYCHECK
  ) || fail "the install in $venv"
  "$venv/bin/kvferry" --help | grep -q "^Usage: kvferry " || fail "$venv/bin/kvferry --help"
  "$venv/bin/kvferry-proxy" --help | grep -q "^usage: kvferry-proxy" \
    || fail "$venv/bin/kvferry-proxy --help"
}

# pip uninstall must leave nothing of kvferry behind.
check_uninstall() {
  local venv=$1
  run_logged "$WORK/uninstall.log" "$venv/bin/pip" uninstall -y kvferry
  local left
  left=$(find "$venv" \( -path '*site-packages/kvferry*' -o -path "$venv/bin/kvferry*" \) \
    -not -path '*/__pycache__*' | head -20)
  [ -z "$left" ] || fail "pip uninstall kvferry left: $left"
}

say "python3 -m build --wheel --no-isolation (reusing $BUILD)"
t=$(date +%s)
run_logged "$WORK/build.log" env -C "$SRC" "$PY" -m build --wheel --no-isolation \
  --outdir "$WORK/dist" .
wheel=$(ls "$WORK"/dist/kvferry-*.whl)
say "built $(basename "$wheel") ($(du -k "$wheel" | cut -f1) KiB) in $(( $(date +%s) - t )) s"

say "fresh venv (--system-site-packages), pip install the wheel"
run_logged "$WORK/venv.log" "$PY" -m venv --system-site-packages "$WORK/venv"
run_logged "$WORK/install.log" "$WORK/venv/bin/pip" install --no-index "$wheel"
check_install "$WORK/venv"

say "the Python tests against the installed copy"
# Not the tests that only drive the CLI's own demo and bench, nor the fleet's etcd tests (which
# check etcd's behaviour, not the install, for 45 s of CI's time): python_tests runs them.
if ! (cd "$WORK" && env PYTHONPATH="$SRC/tests/python" KVFERRY_CLI="$WORK/venv/bin/kvferry" \
      KVFERRY_PROXY="$WORK/venv/bin/kvferry-proxy" KVFERRY_EXPECT_INSTALLED=1 \
      timeout 900 "$WORK/venv/bin/python" -m pytest -q -p no:cacheprovider \
      --ignore="$SRC/tests/python/test_xpyd.py" --ignore="$SRC/tests/python/test_bench_e2e.py" \
      --ignore="$SRC/tests/python/test_fleet.py" \
      "$SRC/tests/python"); then
  fail "the Python tests against $WORK/venv"
fi
check_uninstall "$WORK/venv"

say "pip install . in a second fresh venv, with setup.py's own build directories"
run_logged "$WORK/venv2.log" "$PY" -m venv --system-site-packages "$WORK/venv2"
# Issue 28 item 12: pip install . leaves the source tree as it was (its build output goes to
# KVFERRY_WHEEL_BUILD_DIR, by default under ~/.cache): no setup-extra.cfg here, so setup.py's
# defaults are what is tested.
tree_state() { git -C "$SRC" status --porcelain --ignored --untracked-files=all 2>/dev/null \
  | grep -v -e '^!! build/' -e '__pycache__' | sort; }
before=$(tree_state)
t=$(date +%s)
run_logged "$WORK/pip-install.log" env -C "$SRC" -u DIST_EXTRA_CONFIG \
  KVFERRY_WHEEL_BUILD_DIR="$WORK/wheel-build" "$WORK/venv2/bin/pip" install --no-index .
say "pip install . took $(( $(date +%s) - t )) s"
after=$(tree_state)
[ "$before" = "$after" ] || fail "pip install . left in the source tree: $(diff <(echo "$before") \
  <(echo "$after") | grep '^>' | head -10)"
[ -d "$WORK/wheel-build/setuptools" ] || fail "setuptools' build directory is not in KVFERRY_WHEEL_BUILD_DIR"
check_install "$WORK/venv2"
check_uninstall "$WORK/venv2"
say "passed"
