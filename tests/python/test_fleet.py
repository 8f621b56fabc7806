"""An elastic fleet (issue 31): instances join, drain and leave kvferry-proxy at run time, through
a real etcd (Debian's etcd-server, started here on the loopback) or the proxy's admin API.

The instances are fake_vllm.py servers over `kvferry serve` (proxy_cluster.py), which the proxy
is not told about: they register with kvferry.fleet.Registration (what the vLLM adapter's
kv_connector_extra_config "register" does), and every answered request's KV is checked byte for
byte by the decode engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

pytest.importorskip("aiohttp", reason="python3-aiohttp is not installed (make deps)")
pytest.importorskip("zmq", reason="python3-zmq is not installed (make deps)")
pytest.importorskip("prometheus_client", reason="python3-prometheus-client (make deps)")

import aiohttp  # noqa: E402

import etcd_server  # noqa: E402
from kvferry.fleet import Registration  # noqa: E402
from proxy_cluster import (CLI, Cluster, answer_info, bodies, check_verified,  # noqa: E402
                           metric, post)

if not CLI:
    pytest.skip("KVFERRY_CLI (the kvferry binary) is not set; ctest sets it",
                allow_module_level=True)
if not etcd_server.available():
    pytest.skip("SKIPPED LOUDLY: etcd is not installed (Debian's etcd-server; make deps installs "
                "it): the fleet tests need a real etcd", allow_module_level=True)

TOKEN = "fleet-admin-token"
PREFIX = "/fleet"


def run(coro):
    return asyncio.run(coro)


def cluster(etcd, **kwargs) -> Cluster:
    args = ["--discovery", etcd.url(PREFIX)] + kwargs.pop("proxy_args", [])
    return Cluster(static=False, proxy_args=args, proxy_env={"KVFERRY_PROXY_ADMIN_TOKEN": TOKEN},
                   serve_args=["--hold-lease-ms", "60000"], **kwargs)


def register(etcd, inst, ttl_s: int = 6) -> Registration:
    connector = dict(inst.connector, pp_size=1) if inst.role == "prefill" else None
    return Registration(etcd.url(PREFIX), inst.role, inst.name, inst.url, connector,
                        ttl_s=ttl_s).start()


@contextlib.contextmanager
def registered(etcd, instances, ttl_s: int = 6):
    """Each instance registered (a dict by name, which the test may change); whatever is in it
    at the end leaves."""
    regs = {i.name: register(etcd, i, ttl_s) for i in instances}
    try:
        yield regs
    finally:
        for r in regs.values():
            r.close()


async def members(s: aiohttp.ClientSession, c: Cluster) -> dict:
    async with s.get(c.url + "/admin/instances", headers={"Authorization": f"Bearer {TOKEN}"},
                     timeout=aiohttp.ClientTimeout(10)) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def names(m: dict, role: str, state: str = "") -> set[str]:
    return {i["name"] for i in m[role] if not state or i["state"] == state}


async def wait_for(s, c, check, what: str, timeout: float = 20.0) -> float:
    """Seconds until check(members) holds; fails naming `what` after `timeout`."""
    start = time.monotonic()
    while True:
        m = await members(s, c)
        if check(m):
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout} s: {m}"
        await asyncio.sleep(0.02)


async def answer_all(s, c, reqs: list[dict]) -> None:
    answers = await asyncio.gather(*(post(s, c.url, b) for b in reqs))
    for status, answer in answers:
        assert status == 200, answer
        check_verified(answer_info(answer))


async def answer_with_midway(s, c, reqs: list[dict], workers: int, at: int, midway) -> int:
    """Sends `reqs`, `workers` at a time, each answered 200 and verified; once `at` have been
    answered, awaits midway() (while the others are in flight). Returns how many answered."""
    queue = iter(reqs)
    answered = 0

    async def worker():
        nonlocal answered
        for body in queue:
            status, answer = await post(s, c.url, body)
            assert status == 200, answer
            check_verified(answer_info(answer))
            answered += 1
            if answered == at:
                await midway()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return answered


async def legs(s, c, name: str) -> float:
    return metric(await c.metrics(s), "kvferry_proxy_legs_total", instance=name)


def test_instances_that_register_are_routed_and_those_that_leave_are_not():
    with etcd_server.EtcdServer() as etcd, cluster(etcd, prefill=1, decode=2) as c:
        p0, d0, d1 = c.of("prefill")[0], *c.of("decode")
        with registered(etcd, (p0, d0, d1)) as regs:
            async def go():
                async with aiohttp.ClientSession() as s:
                    # Routed within two keepalive intervals (ttl / 3 each) of registering.
                    took = await wait_for(s, c, lambda m: names(m, "prefill") == {"p0"} and
                                          names(m, "decode") == {"d0", "d1"}, "registered")
                    assert took <= 2 * regs["d0"].ttl_s / 3, took
                    await answer_all(s, c, bodies(8, 3))
                    assert await legs(s, c, "d0") > 0 and await legs(s, c, "d1") > 0
                    # d1 leaves (its lease revoked): nothing is routed to it afterwards.
                    regs.pop("d1").close()
                    await wait_for(s, c, lambda m: names(m, "decode") == {"d0"}, "d1 left")
                    before = await legs(s, c, "d1")
                    await answer_all(s, c, bodies(8, 4))
                    assert await legs(s, c, "d1") == before
                    # d1 is back; d0 stops renewing its lease (it died): it is removed once the
                    # lease ends, and then routed nothing.
                    regs["d1"] = register(etcd, d1)
                    regs.pop("d0").close(revoke=False)
                    await wait_for(s, c, lambda m: names(m, "decode") == {"d1"},
                                   "d0's lease ended", timeout=30)
                    before = await legs(s, c, "d0")
                    await answer_all(s, c, bodies(8, 5))
                    assert await legs(s, c, "d0") == before
                    m = await c.metrics(s)
                    assert metric(m, "kvferry_proxy_instances", role="decode") == 1
                    await c.wait_nothing_held(5)
            run(go())


def test_etcd_down_and_back_keeps_the_last_membership_and_reconciles():
    with etcd_server.EtcdServer() as etcd, cluster(etcd, prefill=1, decode=2) as c:
        p0, d0, d1 = c.of("prefill")[0], *c.of("decode")
        with registered(etcd, (p0, d0), ttl_s=4) as regs:
            async def go():
                async with aiohttp.ClientSession() as s:
                    await wait_for(s, c, lambda m: names(m, "decode") == {"d0"}, "registered")
                    etcd.stop()
                    await wait_for(s, c, lambda m: not m["discovery"]["connected"],
                                   "the proxy saw etcd go")
                    # Routed to the last membership known while etcd is away.
                    await answer_all(s, c, bodies(6, 6))
                    assert names(await members(s, c), "decode") == {"d0"}
                    # d0 leaves while etcd is away (its revoke fails; its lease ends later).
                    regs.pop("d0").close()
                    etcd.start()
                    regs["d1"] = register(etcd, d1, ttl_s=4)
                    # Back: d1 joins, and d0's key goes with its lease (etcd renews a lease's
                    # TTL when it restarts), which the watch or the next listing removes.
                    await wait_for(s, c, lambda m: m["discovery"]["connected"] and
                                   names(m, "decode") == {"d1"}, "reconciled", timeout=30)
                    before = await legs(s, c, "d0")
                    await answer_all(s, c, bodies(6, 7))
                    assert await legs(s, c, "d0") == before
                    await c.wait_nothing_held(5)
            run(go())


def test_five_hundred_requests_with_a_prefill_instance_drained_and_another_added_midway():
    """Layer-wise and whole-request requests (prompts of 20 to 600 tokens, the layer-wise path
    from 256), 16 at a time. After 150 answers a second prefill instance registers and the first
    is set draining: every request is answered and verified, the drained instance takes no leg
    after that, and nothing is held at the end."""
    with etcd_server.EtcdServer() as etcd, cluster(
            etcd, prefill=2, decode=2,
            proxy_args=["--mode", "layerwise", "--layerwise-min-tokens", "256"]) as c:
        p0, p1 = c.of("prefill")
        with registered(etcd, (p0, *c.of("decode"))) as regs:
            async def go():
                async with aiohttp.ClientSession() as s:
                    await wait_for(s, c, lambda m: names(m, "prefill") == {"p0"} and
                                   len(m["decode"]) == 2, "registered")
                    drained_at = None

                    async def midway():
                        nonlocal drained_at
                        regs["p1"] = register(etcd, p1)
                        regs["p0"].set_state("draining")
                        await wait_for(s, c, lambda m: names(m, "prefill", "serving") == {"p1"},
                                       "p0 draining, p1 serving")
                        drained_at = await legs(s, c, "p0")
                    assert await answer_with_midway(s, c, bodies(500, 31), 16, 150, midway) == 500
                    assert drained_at is not None
                    assert await legs(s, c, "p0") == drained_at, "a leg went to the drained p0"
                    assert await legs(s, c, "p1") > 0
                    m = await c.metrics(s)
                    for path in ("whole", "layerwise"):
                        assert metric(m, "kvferry_proxy_requests_total", path=path) > 50, path
                    await c.wait_nothing_held(10)
            run(go())


def test_the_admin_api_adds_drains_lists_and_removes_instances_and_checks_its_token():
    with etcd_server.EtcdServer() as etcd, cluster(etcd, prefill=1, decode=1) as c:
        p0, d0 = c.of("prefill")[0], c.of("decode")[0]
        with registered(etcd, (d0,)):
            async def go():
                async with aiohttp.ClientSession() as s:
                    auth = {"Authorization": f"Bearer {TOKEN}"}
                    for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401)):
                        async with s.get(c.url + "/admin/instances", headers=headers) as r:
                            assert r.status == status
                            assert (await r.json())["error"]["code"] == status
                    spec = {"role": "prefill", "name": "p0", "url": p0.url,
                            "connector": {k: p0.connector[k]
                                          for k in ("engine_id", "host", "port", "tp_size")}}
                    async with s.post(c.url + "/admin/instances", json=spec, headers=auth) as r:
                        assert r.status == 201, await r.text()
                        assert (await r.json())["source"] == "admin"
                    await wait_for(s, c, lambda m: names(m, "decode") == {"d0"}, "d0 registered")
                    await answer_all(s, c, bodies(4, 8))
                    # An etcd-owned instance is changed in etcd, not here.
                    async with s.post(c.url + "/admin/instances", headers=auth,
                                      json={"role": "decode", "name": "d0",
                                            "url": d0.url}) as r:
                        assert r.status == 409
                    async with s.post(c.url + "/admin/instances/prefill/p0/drain",
                                      headers=auth) as r:
                        assert r.status == 200 and (await r.json())["state"] == "draining"
                    async with s.post(c.url + "/v1/completions", json=bodies(1, 9)[0]) as r:
                        assert r.status == 503, await r.text()  # no prefill instance serving
                    async with s.delete(c.url + "/admin/instances/prefill/p0",
                                        headers=auth) as r:
                        assert r.status == 200
                    async with s.delete(c.url + "/admin/instances/prefill/p0",
                                        headers=auth) as r:
                        assert r.status == 404
                    assert names(await members(s, c), "prefill") == set()
                    await c.wait_nothing_held(5)
            run(go())


def test_the_admin_api_is_off_without_a_token():
    with etcd_server.EtcdServer() as etcd:
        with Cluster(prefill=1, decode=1, proxy_args=["--discovery", etcd.url(PREFIX)]) as c:
            async def go():
                async with aiohttp.ClientSession() as s:
                    async with s.get(c.url + "/admin/instances",
                                     headers={"Authorization": "Bearer x"}) as r:
                        assert r.status == 403
                        assert "KVFERRY_PROXY_ADMIN_TOKEN" in (await r.json())["error"]["message"]
                    # The static instances still serve beside an empty etcd prefix.
                    await answer_all(s, c, bodies(2, 10))
            run(go())


def state_of(base: str, key: str) -> str:
    import base64
    import json

    from kvferry.fleet import b64, call
    kvs = call(base, "/v3/kv/range", {"key": b64(key)}, 2).get("kvs", [])
    return json.loads(base64.b64decode(kvs[0]["value"]))["state"] if kvs else ""


def test_the_vllm_adapter_registers_the_instance_drains_and_leaves_at_shutdown():
    """kv_connector_extra_config "register": the scheduler-side connector (DP rank 0) writes the
    instance's key with its connector endpoint, and vLLM's shutdown() of the connector revokes
    it; a proxy watching the prefix adds and removes it."""
    import subprocess
    from types import SimpleNamespace

    import kvferry.vllm
    from common import free_port
    from kvferry.fleet import b64, call, parse_etcd_url

    with etcd_server.EtcdServer() as etcd, cluster(etcd, prefill=1, decode=1) as c:
        port = free_port()
        extra = {"base_port": port, "register": {"etcd": etcd.url(PREFIX), "name": "vllm-p0",
                                                 "url": "http://127.0.0.1:8100", "ttl_s": 3}}
        vllm_config = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(
                kv_role="kv_producer", engine_id="prefill-vllm", kv_load_failure_policy=None,
                kv_buffer_device=None, kv_connector_extra_config=extra),
            parallel_config=SimpleNamespace(tensor_parallel_size=2, data_parallel_rank=0),
            cache_config=SimpleNamespace(block_size=16),
            model_config=SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 8))
        sched = kvferry.vllm.KvferryConnector(vllm_config, "SCHEDULER")
        base, _ = parse_etcd_url(etcd.url(PREFIX))
        key = f"{PREFIX}/instances/prefill/vllm-p0"
        got = call(base, "/v3/kv/range", {"key": b64(key)}, 2).get("kvs", [])
        assert len(got) == 1, got
        import base64
        import json
        value = json.loads(base64.b64decode(got[0]["value"]))
        assert value["connector"] == {"engine_id": "prefill-vllm", "host": "127.0.0.1",
                                      "port": port, "tp_size": 2, "pp_size": 1}, value
        assert value["state"] == "serving" and value["url"] == "http://127.0.0.1:8100"

        async def go(present: bool):
            async with aiohttp.ClientSession() as s:
                await wait_for(s, c, lambda m: ("vllm-p0" in names(m, "prefill")) == present,
                               "the adapter's registration" + ("" if present else " revoked"))
        run(go(True))

        # A drain through etcd (`kvferry drain etcd://.../instances/prefill/vllm-p0`): the proxy
        # stops sending legs at once; the adapter adopts the state on its next keepalive and,
        # once vLLM reports its last held request in finished_sending, reports itself drained.
        held = SimpleNamespace(request_id="held-1", kv_transfer_params={"do_remote_decode": True},
                               prompt_token_ids=list(range(32)), num_prompt_tokens=32,
                               status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
        delay, _ = sched.request_finished(held, [1, 2])
        assert delay  # held for its readers
        env = {"KVFERRY_SECRET": ""}
        drained = subprocess.run([CLI, "drain", etcd.url(key)], capture_output=True, text=True,
                                 timeout=30, env=env)
        assert drained.returncode == 0, drained.stderr
        waiter = subprocess.Popen([CLI, "drain", etcd.url(key), "--wait", "--timeout-ms",
                                   "30000"], stdout=subprocess.PIPE, text=True, env=env)

        async def draining():
            async with aiohttp.ClientSession() as s:
                await wait_for(s, c, lambda m: "vllm-p0" in names(m, "prefill", "draining"),
                               "the proxy saw the drain")
        run(draining())
        deadline = time.monotonic() + 20
        while not sched._draining.is_set():
            assert time.monotonic() < deadline, "the adapter never saw its drain"
            time.sleep(0.01)
        sched.update_connector_output(SimpleNamespace(finished_sending=set(),
                                                      finished_recving=set()))
        assert state_of(base, key) == "draining"  # held-1 is still held
        sched.update_connector_output(SimpleNamespace(finished_sending={"held-1"},
                                                      finished_recving=set()))
        assert state_of(base, key) == "drained"
        out, _ = waiter.communicate(timeout=30)
        assert waiter.returncode == 0 and "drained: the instance reports it" in out, out
        sched.shutdown()
        assert call(base, "/v3/kv/range", {"key": b64(key)}, 2).get("kvs", []) == []
        run(go(False))


def test_a_serve_instance_registers_itself_and_drains_out_of_the_fleet():
    """Every kvferry serve registers itself (--register, with its fake vLLM server's URL). After
    100 of 300 requests, `kvferry drain` tells prefill p0's engine to drain: its key says
    draining (the proxy stops sending it legs), it finishes what it holds, exits, and its key is
    revoked (the proxy removes it). Every request is answered and verified."""
    import subprocess

    from proxy_cluster import SECRET

    with etcd_server.EtcdServer() as etcd, cluster(etcd, prefill=2, decode=1,
                                                   register=etcd.url(PREFIX)) as c:
        p0 = c.of("prefill")[0]

        async def go():
            async with aiohttp.ClientSession() as s:
                await wait_for(s, c, lambda m: names(m, "prefill") == {"p0", "p1"} and
                               names(m, "decode") == {"d0"}, "the engines registered")
                drained = None

                async def midway():
                    nonlocal drained
                    drained = await asyncio.to_thread(
                        subprocess.run, [CLI, "drain", p0.control], capture_output=True,
                        text=True, timeout=30, env={"KVFERRY_SECRET": SECRET})
                assert await answer_with_midway(s, c, bodies(300, 41), 8, 100, midway) == 300
                assert drained is not None and drained.returncode == 0, drained
                assert drained.stdout.startswith("draining: "), drained.stdout
                # The drained engine exits once nothing is held, and its key goes with it.
                await wait_for(s, c, lambda m: names(m, "prefill") == {"p1"}, "p0 left",
                               timeout=30)
                p0.kill()  # its fake server, whose engine is gone
                await c.wait_nothing_held(10)
        run(go())


class _Namespace:
    """A network namespace joined to this one by a veth pair (made and removed here): this side
    10.232.N.1, the namespace's side 10.232.N.2."""

    def __init__(self) -> None:
        import os
        import subprocess
        tag = f"kvfe{os.getpid() % 100000}"
        self.ns, self.outer, self.inner = tag, tag + "a", tag + "b"
        n = os.getpid() % 200 + 20
        self.host, self.peer = f"10.232.{n}.1", f"10.232.{n}.2"
        made = subprocess.run(["ip", "netns", "add", self.ns], capture_output=True, text=True)
        if made.returncode != 0:
            why = (f"cannot create network namespaces here (uid {os.getuid()}; 'ip netns add' "
                   f"said: {made.stderr.strip() or 'nothing'})")
            if os.environ.get("CI", "") in ("true", "1", "yes"):
                pytest.fail(f"{why}; under CI=true this test must run (as root), not skip")
            pytest.skip(f"SKIPPED LOUDLY: {why}; the partition test needs root and iproute2")
        self.ok = False
        for cmd in (["ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner],
                    ["ip", "link", "set", self.inner, "netns", self.ns],
                    ["ip", "addr", "add", f"{self.host}/30", "dev", self.outer],
                    ["ip", "-n", self.ns, "addr", "add", f"{self.peer}/30", "dev", self.inner],
                    ["ip", "-n", self.ns, "link", "set", "lo", "up"],
                    ["ip", "-n", self.ns, "link", "set", self.inner, "up"],
                    ["ip", "link", "set", self.outer, "up"]):
            subprocess.run(cmd, check=True, capture_output=True)
        self.ok = True

    def link(self, up: bool) -> None:
        import subprocess
        subprocess.run(["ip", "link", "set", self.outer, "up" if up else "down"], check=True)

    def close(self) -> None:
        import subprocess
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


# Registers one instance from inside the namespace and keeps it registered until stdin closes.
_REGISTER_IN_NS = """
import logging, sys
logging.basicConfig(level="INFO")
from kvferry.fleet import Registration
r = Registration(sys.argv[1], "decode", "d-far", "http://127.0.0.1:9", ttl_s=2).start()
print("REGISTERED", flush=True)
sys.stdin.read()
r.close()
"""


def test_an_instance_partitioned_from_etcd_leaves_and_comes_back():
    """The instance registers from another network namespace, over a veth; the veth goes down:
    its keepalives fail, its lease ends and the proxy (which still reaches etcd) removes it; the
    veth comes back: the instance registers again under a new lease and the proxy adds it."""
    import os
    import subprocess
    import sys

    ns = _Namespace()
    try:
        with etcd_server.EtcdServer(extra_hosts=(ns.host,)) as etcd, \
                cluster(etcd, prefill=1, decode=1) as c:
            env = dict(os.environ)
            far = subprocess.Popen(
                ["ip", "netns", "exec", ns.ns, sys.executable, "-c", _REGISTER_IN_NS,
                 f"etcd://{ns.host}:{etcd.client_port}{PREFIX}"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            try:
                assert far.stdout.readline().strip() == "REGISTERED"

                async def go():
                    async with aiohttp.ClientSession() as s:
                        await wait_for(s, c, lambda m: "d-far" in names(m, "decode"),
                                       "the far instance registered")
                        ns.link(False)
                        await wait_for(s, c, lambda m: "d-far" not in names(m, "decode"),
                                       "the partitioned instance removed", timeout=30)
                        ns.link(True)
                        await wait_for(s, c, lambda m: "d-far" in names(m, "decode"),
                                       "the instance back after the partition", timeout=30)
                run(go())
            finally:
                far.stdin.close()
                far.wait(timeout=20)
    finally:
        ns.close()


def test_kvferry_demo_with_discovery_while_instances_join_and_drain():
    """`kvferry demo --discovery etcd://...` drives the kvferry serve instances registered there
    (serve --register). Once requests are done, a third prefill instance starts (it joins) and
    the first is drained with `kvferry drain` (it leaves): every request is done and verified
    byte for byte by the decode instance, none failed, nothing held at the end."""
    import json
    import os
    import subprocess

    from common import free_port

    model = ["--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--num-blocks", "512",
             "--tp", "1"]
    env = dict(os.environ, KVFERRY_SECRET="demo-discovery-secret")
    procs: list[subprocess.Popen] = []

    def serve(role: str, name: str) -> str:
        proc = subprocess.Popen(
            [CLI, "serve", "--role", role, "--base-port", str(free_port()), "--control-port",
             "0", "--compute-us-per-token", "300", "--hold-lease-ms", "20000",
             "--register", etcd.url(PREFIX), "--register-name", name, "--register-ttl-s", "3",
             "--exit-on-stdin-eof", *model],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        procs.append(proc)
        line = proc.stdout.readline().strip()
        assert line.startswith("READY "), line
        return line.split(" ", 1)[1]

    with etcd_server.EtcdServer() as etcd:
        try:
            p0 = serve("prefill", "p0")
            serve("prefill", "p1")
            serve("decode", "d0")
            demo = subprocess.Popen(
                [CLI, "demo", "--discovery", etcd.url(PREFIX), "--requests", "240",
                 "--concurrency", "8", "--min-prompt", "32", "--max-prompt", "256",
                 "--prefill-tp", "1", "--decode-tp", "1", "--layers", "2", "--kv-heads", "2",
                 "--head-dim", "16", "--num-blocks", "512", "--hold-lease-ms", "20000",
                 "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            try:
                # Midway (a progress line with requests done): one joins, one drains.
                for line in demo.stderr:
                    if "requests done" in line and not line.split("]", 1)[1].strip().startswith(
                            "0/"):
                        break
                p2 = serve("prefill", "p2")
                drained = subprocess.run([CLI, "drain", p0], capture_output=True, text=True,
                                         timeout=30, env=env)
                assert drained.returncode == 0, drained.stderr
                out, err = demo.communicate(timeout=300)
            finally:
                if demo.poll() is None:
                    demo.kill()
            assert demo.returncode == 0, err[-3000:]
            report = json.loads(out)
            assert report["done"] == 240 and report["failed"] == 0, report["errors"]
            assert report["leaked"] is False
            assert report["bytes_verified"] > 0
            # p0 drained and exited by itself (its holds were read); p2 took requests.
            assert procs[0].wait(timeout=30) == 0
            assert "prefill instance p2 joined" in err, err[-3000:]

            async def p2_stats():
                from serve_control import ControlClient
                client = ControlClient(p2, env["KVFERRY_SECRET"])
                try:
                    return await client.stats(timeout=10)
                finally:
                    client.close()
            assert run(p2_stats())["requests_done"] > 0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.stdin.close()
                    p.terminate()
                    p.wait(timeout=10)
