#!/usr/bin/env bash
# The acl header check (docs/device.md, "The acl header check"): compiles
# tests/unit/device/acl_header_check_test.cc against CANN's acl/acl_rt.h, so that its
# static_asserts compare every declaration of src/device/acl/acl_api.h (function types, enum
# values, flags, struct layouts) with the header's. A developer check: neither the build nor CI
# needs it, and the header is fetched into a temporary directory, never into the repository.
#
#   scripts/acl_header_check.sh DIR            DIR/acl/acl_rt.h exists (e.g. a CANN installation's
#                                              include directory, or hicann/runtime's include/external)
#   scripts/acl_header_check.sh --git [REPO [REF]]
#                                              fetches include/external of REPO (a URL or a local
#                                              clone, bare or not; default
#                                              https://github.com/hicann/runtime) at REF (default:
#                                              its default branch) and checks against that
#
# Exit status: 0 every declaration matches; 1 a mismatch (the compiler names it: "static assertion
# failed: <function>: acl_api.h's signature differs from acl_rt.h's") or the header was not found.
# Environment: CXX (default c++).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
CXX=${CXX:-c++}
tmp=""
# shellcheck disable=SC2317 # called by the trap
cleanup() { [ -n "$tmp" ] && rm -rf "$tmp"; }
trap cleanup EXIT

origin=""
if [ "${1:-}" = "--git" ]; then
  repo=${2:-https://github.com/hicann/runtime}
  ref=${3:-}
  tmp=$(mktemp -d)
  if [ -d "$repo" ]; then
    commit=$(git -C "$repo" rev-parse "${ref:-HEAD}^{commit}") || exit 1
    git -C "$repo" archive "$commit" include/external | tar -x -C "$tmp" || exit 1
  else
    git clone --quiet --depth 1 ${ref:+--branch "$ref"} "$repo" "$tmp/clone" || exit 1
    commit=$(git -C "$tmp/clone" rev-parse HEAD)
    mv "$tmp/clone/include" "$tmp/include"
  fi
  dir="$tmp/include/external"
  origin="$repo at $commit${ref:+ ($ref)}"
elif [ $# -eq 1 ]; then
  dir=$1
  origin=$dir
else
  sed -n '2,20p' "$0"
  exit 2
fi
if [ ! -f "$dir/acl/acl_rt.h" ]; then
  echo "acl_header_check: no acl/acl_rt.h under $dir"
  exit 1
fi
version=$(sed -n 's/^#define ACL_\(MAJOR\|MINOR\|PATCH\)_VERSION *\([0-9]*\).*/\2/p' "$dir/acl/acl_rt.h" |
  paste -sd. -)

echo "== acl_header_check: src/device/acl/acl_api.h against $origin (acl_rt.h ACL version ${version:-unknown})"
if "$CXX" -std=c++20 -fsyntax-only -Wall -Wextra -Werror -Wno-deprecated-declarations \
  -DKVFERRY_HAVE_ACL_RT_H=1 -Iinclude -Isrc -I. -isystem "$dir" \
  tests/unit/device/acl_header_check_test.cc; then
  echo "acl_header_check: passed: every declaration matches"
  exit 0
fi
echo "acl_header_check: FAILED: acl_api.h differs from this acl_rt.h (see the static assertions above)"
exit 1
