#!/usr/bin/env bash
# Two "hosts": network namespaces joined by a veth pair, made and removed by this script. A
# prefill instance runs in one, a decode instance in the other (tcp data plane, a shared secret,
# a rank table with both addresses), and kvferry demo drives them as the proxy, checking every
# byte. Then the same under faults during transfers: a slow, lossy link (netem), the link taken
# down, the prefill instance frozen (SIGSTOP), and each instance killed and restarted. Every run
# must end in bounded time with failures only for requests the fault hit, and nothing held or
# allocated at the end. Exits 77 (CTest: skipped) where namespaces cannot be made.
set -u
kvferry=${1:?usage: two_hosts.sh path/to/kvferry}
tag="kvf$$"
ns_p="${tag}p"
ns_d="${tag}d"
ip_p=10.231.$(( $$ % 200 )).1
ip_d=10.231.$(( $$ % 200 )).2
work=$(mktemp -d)

cleanup() {
  # Every instance started, also those restarted by a background fault, is in $work/pids.
  local pids=()
  [ -f "$work/pids" ] && while read -r p; do pids+=("$p"); done <"$work/pids"
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && sleep 0.2; kill -KILL "$p" 2>/dev/null; done
  wait 2>/dev/null
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
start() {  # role ns ip: starts the instance (pid in $work/ROLE.pid) and waits until it is ready
  local before
  before=$(grep -c READY "$work/$1.log")  # counted first: the new one may be ready at once
  ip netns exec "$2" "$kvferry" serve --role "$1" --tp 2 --host "$3" --control-host "$3" \
    --base-port 7100 --control-port 7000 --rank-table "$work/ranktable.json" --transport tcp \
    --hold-lease-ms 4000 "${model[@]}" </dev/null >>"$work/$1.log" 2>&1 &
  echo $! >>"$work/pids"
  echo $! >"$work/$1.pid"
  for _ in $(seq 100); do
    [ "$(grep -c READY "$work/$1.log")" -gt "$before" ] && return 0
    sleep 0.1
  done
  echo "FAIL: the $1 instance did not start"; cat "$work/$1.log"; exit 1
}
: >"$work/prefill.log"; : >"$work/decode.log"
start prefill "$ns_p" "$ip_p"
start decode "$ns_d" "$ip_d"

# run NAME MAX_FAILED [demo args...]: a demo run as the proxy, from the decode namespace. At most
# MAX_FAILED requests may fail (those a fault hit: at most the 16 in flight), each with an error
# that names the instance that did not answer; every other request completes, verified; nothing
# is held or allocated at the end.
run() {
  local name=$1 max_failed=$2; shift 2
  timeout 120 ip netns exec "$ns_d" "$kvferry" demo --prefill-tp 2 --decode-tp 2 \
    --prefill-control "tcp://$ip_p:7000" --decode-control "tcp://$ip_d:7000" \
    --hold-lease-ms 4000 --request-timeout-ms 5000 --concurrency 16 \
    --no-progress --json "${model[@]}" "$@" >"$work/$name.json" 2>"$work/$name.err"
  local rc=$?
  python3 - "$work/$name.json" "$name" "$rc" "$max_failed" <<'PY'
import json, sys
path, name, rc, max_failed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
try:
    r = json.load(open(path))
except Exception as e:
    print(f"FAIL {name}: no report (exit {rc}): {e}"); sys.exit(1)
print(f"{name}: {r['done']}/{r['requests']} done, {r['failed']} failed, "
      f"{r['bytes_moved']} bytes moved, {r['bytes_verified']} verified, "
      f"{r['recomputed_blocks']} blocks recomputed, leaked={r['leaked']}, {r['wall_s']:.2f} s")
ok = True
if r["done"] + r["aborted"] + r["failed"] != r["requests"]:
    print(f"  FAIL: requests unaccounted for"); ok = False
if r["failed"] > max_failed:
    print(f"  FAIL: more than {max_failed} failed"); ok = False
for e in r["errors"]:
    if "no answer from the" not in e:
        print(f"  FAIL: unexpected error: {e}"); ok = False
if r["leaked"]:
    print(f"  FAIL: held at end: prefill {r['prefill_end']} decode {r['decode_end']}"); ok = False
sys.exit(0 if ok else 1)
PY
}
# fault_during SECONDS COMMAND...: runs COMMAND in the background SECONDS into the next run.
fault_during() {
  local delay=$1; shift
  ( sleep "$delay"; "$@" ) &
  fault=$!
}

status=0
run clean 0 --seed 1 --requests 40 --max-prompt 1024 || status=1
# A slow, lossy link: every byte still arrives and verifies. netem where the kernel has it;
# otherwise a 400 Mbit/s token bucket on both ends and 1 % of packets dropped at random in each
# namespace (nftables).
lossy=""
drop_1pct() {  # ns: 1 % of incoming packets dropped at random
  ip netns exec "$1" nft add table inet kvferry_loss &&
    ip netns exec "$1" nft add chain inet kvferry_loss in '{ type filter hook input priority 0; }' &&
    ip netns exec "$1" nft add rule inet kvferry_loss in numgen random mod 100 '<' 1 drop
}
if ip netns exec "$ns_p" tc qdisc add dev "${tag}a" root netem delay 2ms loss 1% 2>/dev/null; then
  lossy="netem delay 2ms loss 1%"
elif command -v nft >/dev/null && drop_1pct "$ns_p" 2>/dev/null && drop_1pct "$ns_d" 2>/dev/null &&
  ip netns exec "$ns_p" tc qdisc add dev "${tag}a" root tbf rate 400mbit burst 64kb latency 20ms &&
  ip netns exec "$ns_d" tc qdisc add dev "${tag}b" root tbf rate 400mbit burst 64kb latency 20ms; then
  lossy="tbf 400 Mbit/s and 1 % random drop by nftables (no netem in this kernel)"
fi
if [ -n "$lossy" ]; then
  echo "lossy: $lossy"
  run lossy 0 --seed 2 --requests 20 --max-prompt 1024 || status=1
else
  echo "lossy: skipped: this kernel has no netem qdisc, and nftables with tbf is not available"
fi
ip netns exec "$ns_p" tc qdisc del dev "${tag}a" root 2>/dev/null
ip netns exec "$ns_d" tc qdisc del dev "${tag}b" root 2>/dev/null
for ns in "$ns_p" "$ns_d"; do ip netns exec "$ns" nft delete table inet kvferry_loss 2>/dev/null; done
# The link goes down for 3 s mid-run: TCP carries everything across once it is back (or loads
# fail and the decode engine recomputes them); nothing is lost, hangs or leaks.
fault_during 1.0 bash -c \
  "ip -n $ns_p link set ${tag}a down; sleep 3; ip -n $ns_p link set ${tag}a up"
run link_flap 0 --seed 3 --requests 200 --max-prompt 2048 || status=1
wait "$fault"
# The prefill instance frozen for 2 s (SIGSTOP): its reads and answers wait, then resume.
pid=$(cat "$work/prefill.pid")
fault_during 1.0 bash -c "kill -STOP $pid; sleep 2; kill -CONT $pid"
run sigstop_prefill 0 --seed 4 --requests 200 --max-prompt 2048 || status=1
wait "$fault"
# The decode instance killed mid-run and started again: the requests it had fail (no answer),
# their prefill holds end by lease, and the run goes on with the new instance.
kill_and_restart() {  # role ns ip
  local pid
  pid=$(cat "$work/$1.pid")
  sleep 1.0
  kill -KILL "$pid"
  # Gone (or a zombie of this script, its sockets closed) before the new one binds the ports.
  while [ -e "/proc/$pid" ] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null; do
    sleep 0.05
  done
  start "$@"
}
kill_and_restart decode "$ns_d" "$ip_d" &
fault=$!
run kill_decode 16 --seed 5 --requests 200 --max-prompt 2048 || status=1
wait "$fault"
# The prefill instance killed and started again: requests it had fail; decode loads from it
# fail and are recomputed; loads naming the old engine are refused by the new one's id.
kill_and_restart prefill "$ns_p" "$ip_p" &
fault=$!
run kill_prefill 16 --seed 6 --requests 200 --max-prompt 2048 || status=1
wait "$fault"
[ $status -eq 0 ] || for f in "$work"/*.err; do echo "== $f"; tail -5 "$f"; done
exit $status
