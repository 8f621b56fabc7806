#!/usr/bin/env bash
# Two "hosts": network namespaces joined by a veth pair, made and removed by this script. A
# prefill instance runs in one, a decode instance in the other (tcp data plane, a shared secret,
# a rank table with both addresses), and kvferry demo drives them as the proxy, checking every
# byte. Then the same under a slow, lossy link (netem) and with the link taken down mid-run.
# Exits 77 (CTest: skipped) where namespaces cannot be made.
set -u
kvferry=${1:?usage: two_hosts.sh path/to/kvferry}
tag="kvf$$"
ns_p="${tag}p"
ns_d="${tag}d"
ip_p=10.231.$(( $$ % 200 )).1
ip_d=10.231.$(( $$ % 200 )).2
work=$(mktemp -d)
pids=()

cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  ip netns del "$ns_p" 2>/dev/null
  ip netns del "$ns_d" 2>/dev/null
  if [ -n "${KVFERRY_KEEP_LOGS:-}" ]; then echo "logs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

if ! ip netns add "$ns_p" 2>/dev/null; then
  echo "SKIP: cannot create network namespaces here (needs root and ip netns)"
  exit 77
fi
ip netns add "$ns_d"
ip link add "${tag}a" type veth peer name "${tag}b"
ip link set "${tag}a" netns "$ns_p"
ip link set "${tag}b" netns "$ns_d"
ip -n "$ns_p" addr add "$ip_p/24" dev "${tag}a"
ip -n "$ns_d" addr add "$ip_d/24" dev "${tag}b"
for ns in "$ns_p" "$ns_d"; do ip -n "$ns" link set lo up; done
ip -n "$ns_p" link set "${tag}a" up
ip -n "$ns_d" link set "${tag}b" up

"$kvferry" ranktable gen --hosts "$ip_p,$ip_d" --devices-per-host 2 --prefill 2 --decode 2 \
  -o "$work/ranktable.json" 2>/dev/null || exit 1
export KVFERRY_SECRET="netns-test-secret-$$"
model=(--num-blocks 1024 --layers 4)
start() {  # role ns ip
  ip netns exec "$2" "$kvferry" serve --role "$1" --tp 2 --host "$3" \
    --base-port 7100 --control-port 7000 --rank-table "$work/ranktable.json" --transport tcp \
    --hold-lease-ms 4000 "${model[@]}" </dev/null >"$work/$1.log" 2>&1 &
  pids+=($!)
}
start prefill "$ns_p" "$ip_p"
start decode "$ns_d" "$ip_d"
for i in $(seq 100); do
  grep -q READY "$work/prefill.log" && grep -q READY "$work/decode.log" && break
  sleep 0.1
done
grep -q READY "$work/prefill.log" && grep -q READY "$work/decode.log" || {
  echo "FAIL: instances did not start"; cat "$work"/*.log; exit 1; }

run() {  # name, extra demo args...
  local name=$1; shift
  timeout 120 ip netns exec "$ns_d" "$kvferry" demo --prefill-tp 2 --decode-tp 2 \
    --prefill-control "tcp://$ip_p:7000" --decode-control "tcp://$ip_d:7000" \
    --no-progress --json "${model[@]}" "$@" >"$work/$name.json" 2>"$work/$name.err"
  local rc=$?
  python3 - "$work/$name.json" "$name" "$rc" <<'PY'
import json, sys
path, name, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    r = json.load(open(path))
except Exception as e:
    print(f"FAIL {name}: no report (exit {rc}): {e}"); sys.exit(1)
print(f"{name}: {r['done']}/{r['requests']} done, {r['failed']} failed, "
      f"{r['bytes_moved']} bytes moved, {r['bytes_verified']} verified, "
      f"{r['recomputed_blocks']} blocks recomputed, leaked={r['leaked']}, {r['wall_s']:.2f} s")
ok = r["failed"] == 0 and not r["leaked"] and r["done"] == r["requests"]
sys.exit(0 if ok else 1)
PY
}

status=0
run clean --requests 40 --max-prompt 1024 || status=1
# A slow, lossy link: every byte still arrives and verifies.
if ip netns exec "$ns_p" tc qdisc add dev "${tag}a" root netem delay 2ms loss 1% 2>/dev/null; then
  run lossy --requests 20 --max-prompt 1024 || status=1
  ip netns exec "$ns_p" tc qdisc del dev "${tag}a" root
else
  echo "lossy: skipped: this kernel has no netem qdisc"
fi
# The link goes down for 3 s mid-run: loads in flight fail, are reported and recomputed by the
# decode engine; holds end by abort or lease; nothing hangs or leaks.
( sleep 1.0; ip -n "$ns_p" link set "${tag}a" down; sleep 3; ip -n "$ns_p" link set "${tag}a" up ) &
flap=$!
run link_flap --requests 200 --max-prompt 2048 || { status=1; tail -5 "$work/link_flap.err"; }
wait "$flap"
exit $status
