"""kvferry.sglang, SGLang's dynamic transfer backend, driven by stand-ins of SGLang's schedulers
that follow alphabetc1/sglang d6a0fe41 (tests/python/sglang_scheduler.py names the file and
function each part follows; the sglang package here is tests/python/sglang_standin)."""
import json
import os
import sys
import time
import urllib.error
import urllib.request

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "sglang_standin"))

from common import free_port  # noqa: E402
from sglang.srt.disaggregation.base import KVPoll  # noqa: E402
from sglang.srt.disaggregation.utils import (KVClassType, TransferBackend,  # noqa: E402
                                             get_kv_class)
from sglang_scheduler import Decode, Prefill, Req, run, server_args  # noqa: E402

import kvferry.sglang as ks  # noqa: E402


def pair(p_tp, d_tp, mla=False, heads=4, prefill_cfg=None, decode_cfg=None, **kw):
    bport = free_port(1)
    prefill = Prefill(p_tp, free_port(p_tp), bport, mla=mla, model_heads=heads,
                      **dict(kw, **(prefill_cfg or {})))
    decode = Decode(d_tp, free_port(d_tp), bport, mla=mla, model_heads=heads,
                    **dict(kw, **(decode_cfg or {})))
    return prefill, decode, bport


def request(rid, room, prompt, bport):
    """The router's two legs (sglang_router mini_lb: the same bootstrap host, port and room
    to both servers)."""
    return Req(rid, room, prompt, "127.0.0.1", bport), Req(rid, room, prompt, "127.0.0.1", bport)


def nothing_held(server):
    for rank in server.ranks:
        stats = rank.mgr.worker.stats()
        assert stats["holds_outstanding"] == 0, stats


def test_the_provider_is_found_through_sglangs_dynamic_backend():
    """utils.get_kv_class(TransferBackend.DYNAMIC, ...) -> backend_factory.DisaggBackendFactory
    -> importlib + KvferryProvider() -> get_kv_class(KVClassType), as the fork loads it."""
    args = server_args(free_port(1), free_port(1), 1, 4)
    got = {t: get_kv_class(TransferBackend.DYNAMIC, t, args) for t in KVClassType}
    from sglang.srt.disaggregation.base.conn import KVArgs
    assert got[KVClassType.KVARGS] is KVArgs
    assert got[KVClassType.MANAGER] is ks.KvferryKVManager
    assert got[KVClassType.SENDER] is ks.KvferryKVSender
    assert got[KVClassType.RECEIVER] is ks.KvferryKVReceiver
    assert got[KVClassType.BOOTSTRAP_SERVER] is ks.KvferryBootstrapServer


@pytest.mark.parametrize("p_tp, d_tp, mla, prompt, chunk", [
    (1, 1, False, 23, 8),    # MHA, chunked prefill: three sends, the last page partial
    (1, 2, False, 16, 16),   # MHA TP 1 -> 2: each decode rank reads its heads
    (2, 1, True, 19, 8),     # MLA TP 2 -> 1: the replicated row from one prefill rank
    (2, 2, False, 30, 12),   # MHA TP 2 -> 2, chunked
])
def test_a_request_moves_every_byte_and_its_aux_row(p_tp, d_tp, mla, prompt, chunk):
    prefill, decode, bport = pair(p_tp, d_tp, mla=mla, chunk_tokens=chunk)
    try:
        reqs = [request(f"r{i}", 4242 + i, prompt + i, bport) for i in range(3)]
        for p, d in reqs:
            decode.add(d)  # the decode leg may come first: it waits for the announcements
            prefill.add(p)
        run([prefill, decode], lambda: len(decode.done) == 3 and len(prefill.done) == 3,
            "both servers to finish three requests")
        for p, d in reqs:
            assert d.finished == "ok" and p.finished == "ok", (d.finished, p.finished)
            assert d.first_token == [1000 + d.bootstrap_room % 1000] * d_tp  # the aux row
            assert all(rows == (prompt_rows := d.prompt * 3 * (1 if mla else 2))
                       for rows in d.checked), (d.checked, prompt_rows)
        nothing_held(prefill)
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_mamba_hybrid_moves_its_state_slot_with_its_pages(tp):
    """SGLang's state_type "mamba": per layer a conv and a temporal state tensor; the last send
    names the request's state slot, the decode's init its own; both land, byte for byte."""
    prefill, decode, bport = pair(tp, tp, mamba=True, chunk_tokens=8)
    try:
        reqs = [request(f"m{i}", 900 + i, 17 + 3 * i, bport) for i in range(3)]
        for p, d in reqs:
            prefill.add(p)
            decode.add(d)
        run([prefill, decode], lambda: len(decode.done) == 3 and len(prefill.done) == 3,
            "three hybrid requests")
        for p, d in reqs:
            assert d.finished == "ok" and p.finished == "ok", (d.finished, p.finished)
        nothing_held(prefill)
    finally:
        decode.close()
        prefill.close()


def test_bad_state_indices_fail_the_request_instead_of_raising_into_sglang():
    """A numpy array of two slots for a Mamba request (one is expected): poll says Failed with
    the reason; nothing raises from init (an array has no truth value: `indices or ()` raised)."""
    import numpy as np
    prefill, decode, bport = pair(1, 1, mamba=True)
    try:
        recv = ks.KvferryKVReceiver(decode.ranks[0].mgr, f"127.0.0.1:{bport}", 77,
                                    prefill_dp_rank=None)
        deadline = time.monotonic() + 10
        while recv.poll() != KVPoll.WaitingForInput:
            assert time.monotonic() < deadline
        recv.init(np.array([1, 2]), 0, np.array([3, 4]))
        assert recv.poll() == KVPoll.Failed
        with pytest.raises(ks.KVTransferError, match="exactly one state slot"):
            recv.failure_exception()
    finally:
        decode.close()
        prefill.close()


def test_the_prefill_waits_for_its_reader_before_sglang_frees_its_pages():
    """The decode leg arrives after the prefill finished: the sender stays Transferring (SGLang
    keeps the pages) until the read, so no page is freed under a reader (sglang#24527)."""
    prefill, decode, bport = pair(1, 1)
    try:
        p, d = request("late", 77, 13, bport)
        prefill.add(p)
        for _ in range(20):
            prefill.step()
        assert p.finished is None and prefill.inflight == [p]
        assert p.senders[0].poll() == KVPoll.Transferring
        decode.add(d)
        run([prefill, decode], lambda: d.finished and p.finished, "the late reader")
        assert d.finished == "ok" and p.finished == "ok"
    finally:
        decode.close()
        prefill.close()


def test_aborts_at_each_stage_end_both_sides_and_hold_nothing():
    prefill, decode, bport = pair(1, 1, chunk_tokens=4,
                                  prefill_cfg={"hold_lease_ms": 1500})
    try:
        # 1. Prefill aborts between chunks: the decode side fails at once (the transfer ended).
        p1, d1 = request("a1", 11, 20, bport)
        decode.add(d1)
        prefill.add(p1)
        run([prefill, decode], lambda: getattr(p1, "computed", 0) >= 4, "a first chunk")
        prefill.abort(p1)
        run([prefill, decode], lambda: p1.finished and d1.finished, "abort 1")
        assert "Aborted by AbortReq" in p1.finished and "Decode transfer failed" in d1.finished
        # 2. Decode aborts while it waits for its pages: the prefill's hold ends by its lease.
        p2, d2 = request("a2", 12, 8, bport)
        decode.add(d2)
        run([decode], lambda: decode.waiting.get(id(d2)), "the handshake")
        decode.abort(d2)
        decode.step()
        assert d2.finished and "Aborted by AbortReq" in d2.finished
        prefill.add(p2)
        run([prefill], lambda: p2.finished, "the prefill hold to end by its lease", 20)
        assert p2.finished == "ok", p2.finished  # the pages went back to SGLang
        # 3. Prefill aborts after its last chunk, its pages held: the hold ends at once (SGLang
        #    frees them), and the reader that comes afterwards fails instead of reading them.
        p3, d3 = request("a3", 13, 8, bport)
        prefill.add(p3)
        run([prefill], lambda: p3 in prefill.inflight, "the last chunk")
        prefill.abort(p3)
        prefill.step()
        assert p3.finished and "Aborted by AbortReq" in p3.finished
        decode.add(d3)
        run([decode], lambda: d3.finished, "the reader of an ended transfer")
        assert "Decode transfer failed" in d3.finished, d3.finished
        # 4. Decode aborts mid-transfer (prefill never starts it): the load stops at once.
        p4, d4 = request("a4", 14, 8, bport)
        decode.add(d4)
        run([decode], lambda: d4 in decode.running, "preallocation")
        decode.abort(d4)
        run([decode], lambda: d4.finished, "the aborted load to stop")
        assert "Aborted by AbortReq" in d4.finished
        nothing_held(prefill)
    finally:
        decode.close()
        prefill.close()


class FailingScheduler:
    """kvferry's scheduler of one rank, refusing the next announced chunk."""

    def __init__(self, inner):
        self.inner = inner

    def request_scheduled(self, *a, **kw):
        raise kvferry_error("injected: this rank's chunk was refused")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def kvferry_error(message):
    import kvferry
    return kvferry.InternalError(message)


def test_a_failure_on_one_prefill_rank_ends_the_transfer_on_every_rank():
    """One prefill rank fails mid-prompt: SGLang's MIN all-reduce fails the request on every
    rank and frees its pages, calling failure_exception() on each; the other rank's transfer
    ends there, so the decode side fails at once, not at its progress deadline."""
    prefill, decode, bport = pair(2, 2, chunk_tokens=4, decode_cfg={"progress_timeout_s": 30})
    try:
        p, d = request("split", 41, 24, bport)
        decode.add(d)
        prefill.add(p)
        run([prefill, decode], lambda: getattr(p, "computed", 0) >= 8, "two chunks")
        mgr = prefill.ranks[1].mgr
        mgr.scheduler = FailingScheduler(mgr.scheduler)  # rank 1's next chunk is refused
        run([prefill, decode], lambda: p.finished and d.finished, "both to fail", 20)
        assert "another rank" in p.finished, p.finished  # rank 0's text: the rank that did not
        assert "injected" in p.senders[1].reason, p.senders[1].reason
        # Decode rank 1 read from prefill rank 1, whose transfer ended with the refusal: it
        # fails at once, naming that, and every decode rank fails with it (MIN all-reduce).
        assert "Decode transfer failed" in d.finished, d.finished
        assert "Timeout" not in d.senders[1].reason, d.senders[1].reason
        nothing_held(prefill)
    finally:
        decode.close()
        prefill.close()


def test_prefill_death_fails_the_reader_by_its_deadline():
    prefill, decode, bport = pair(1, 1, chunk_tokens=4, decode_cfg={"progress_timeout_s": 1})
    try:
        p, d = request("dies", 21, 24, bport)
        decode.add(d)
        prefill.add(p)
        run([prefill, decode], lambda: getattr(p, "computed", 0) >= 8, "two chunks")
        prefill.close()
        run([decode], lambda: d.finished, "the reader to fail", 30)
        assert "Decode transfer failed" in d.finished, d.finished
        assert "KVTransferError(bootstrap_room=21)" in d.finished
    finally:
        decode.close()


def test_decode_death_ends_the_prefill_hold_by_its_lease():
    prefill, decode, bport = pair(1, 1, prefill_cfg={"hold_lease_ms": 1000})
    try:
        p, d = request("orphan", 31, 12, bport)
        decode.add(d)
        run([decode], lambda: d in decode.running, "the decode leg to subscribe")
        decode.close()
        prefill.add(p)
        run([prefill], lambda: p.finished, "the hold to end", 20)
        assert p.finished == "ok", p.finished  # ended by its lease: the pages go back
        nothing_held(prefill)
    finally:
        prefill.close()


def test_a_bootstrap_server_that_never_answers_fails_the_handshake():
    bport = free_port(1)
    decode = Decode(1, free_port(1), bport, waiting_timeout_s=20)
    try:
        d = Req("nobody", 5, 8, "127.0.0.1", bport)
        decode.add(d)
        run([decode], lambda: d.finished, "the handshake failure")
        assert "Decode handshake failed" in d.finished and "no bootstrap server" in d.finished
    finally:
        decode.close()


def test_the_bootstrap_server_answers_sglangs_routes():
    port = free_port(1)
    server = ks.KvferryBootstrapServer("127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"

    def call(method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(base + path, data=data, method=method)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    try:
        assert call("GET", "/health") == (200, b"OK")
        assert call("GET", "/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1")[0] == 503
        entry = {"attn_tp_size": 2, "attn_tp_rank": 1, "attn_dp_size": 1, "attn_dp_rank": 0,
                 "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
                 "rank_ip": "127.0.0.1", "rank_port": 7001, "kvferry": {"engine_id": "e"}}
        assert call("PUT", "/route", entry)[0] == 200
        code, body = call("GET", "/route?engine_rank=1&target_dp_group=0&target_pp_rank=0")
        assert code == 200 and json.loads(body) == {"rank_ip": "127.0.0.1", "rank_port": 7001}
        code, body = call("GET", "/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1")
        info = json.loads(body)
        assert (info["prefill_attn_tp_size"], info["prefill_dp_size"],
                info["prefill_pp_size"]) == (2, 1, 1)
        assert call("GET", "/route?engine_rank=0&target_dp_group=0&target_pp_rank=0")[0] == 404
        assert call("GET", "/route?engine_rank=x")[0] == 400
        assert call("PUT", "/route", dict(entry, attn_tp_size=4))[0] == 409
        assert call("PUT", "/route", dict(entry, attn_tp_rank=5))[0] == 400
        assert call("PUT", "/route", {k: v for k, v in entry.items() if k != "kvferry"})[0] == 400
        assert call("PUT", "/route", {"nothing": 1})[0] == 400
        assert call("POST", "/route", entry)[0] == 405
    finally:
        server.close()


def test_bootstrap_and_aux_requests_never_go_through_an_http_proxy():
    """An engine's environment may name an http_proxy; kvferry's requests go to the peers'
    own addresses. A fresh interpreter (urllib builds its proxy table once per process)."""
    import subprocess
    port = free_port(1)
    server = ks.KvferryBootstrapServer("127.0.0.1", port)
    try:
        env = dict(os.environ, http_proxy="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9",
                   no_proxy="", NO_PROXY="")
        out = subprocess.run(
            [sys.executable, "-c", "import sys, kvferry.sglang as ks; "
             f"sys.stdout.write(ks._http('GET', 'http://127.0.0.1:{port}/health').decode())"],
            env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout == "OK", out.stderr[-2000:]
    finally:
        server.close()


@pytest.mark.parametrize("p_tp, d_tp, kw, p_kw, d_kw, reason", [
    # Mamba state moves between equal TP sizes only, as in SGLang's own backends.
    (2, 1, {"mamba": True}, {}, {}, "equal TP"),
    # Page sizes must match: the handshake names both.
    (1, 1, {}, {"page_size": 4}, {"page_size": 8}, "--page-size 4, this decode server 8"),
], ids=["mamba_unequal_tp", "page_sizes"])
def test_mismatched_servers_are_refused_with_a_reason(p_tp, d_tp, kw, p_kw, d_kw, reason):
    bport = free_port(1)
    prefill = Prefill(p_tp, free_port(p_tp), bport, **kw, **p_kw)
    decode = Decode(d_tp, free_port(d_tp), bport, **kw, **d_kw)
    try:
        d = Req("x", 9, 8, "127.0.0.1", bport)
        decode.add(d)
        run([decode], lambda: d.finished, "the refusal")
        assert "Decode handshake failed" in d.finished and reason in d.finished, d.finished
    finally:
        decode.close()
        prefill.close()


def test_a_refusal_that_comes_after_the_request_was_held_still_fails_it():
    """The bootstrap server's refusal reaches the rank only after the request's last chunk was
    held (its PUT /route is answered late): the request fails with the reason at once, instead of
    waiting out its hold's lease and ending "ok" with nobody ever able to read it. Before the fix
    the held request ignored the refusal (test_sglang.py flaked on the test below that way)."""
    import http.server
    import socketserver
    import threading

    answer = threading.Event()
    asked = threading.Event()

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):  # noqa: N802 - http.server's names
            asked.set()
            answer.wait(30)
            body = b"refused: another TP size registered first"
            self.send_response(409)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Refuse)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    bport = httpd.server_address[1]
    server = Prefill(1, free_port(1), bport, start_bootstrap=False)
    try:
        assert asked.wait(30), "the rank never asked its bootstrap server"
        p = Req("late-refusal", 5, 8, "127.0.0.1", bport)
        server.add(p)
        run([server], lambda: all(s.held for s in p.senders), "the request held")
        answer.set()
        run([server], lambda: p.finished, "the refusal")
        assert "not registered with its bootstrap server" in p.finished, p.finished
        assert "refused" in p.finished, p.finished
        # Nothing of it is kept: its transfer ended, and its rank no longer watches it.
        assert all(s.mgr._live == set() for s in p.senders), [s.mgr._live for s in p.senders]
        nothing_held(server)
    finally:
        answer.set()
        server.close()
        httpd.shutdown()
        httpd.server_close()


def test_a_prefill_rank_the_bootstrap_server_refused_fails_its_requests_with_the_reason():
    """A second prefill server pointed at the first one's bootstrap port with another TP size:
    its ranks' PUT /route is refused (409), and its requests fail instead of waiting."""
    bport = free_port(1)
    first = Prefill(1, free_port(1), bport)
    second = Prefill(2, free_port(2), bport, start_bootstrap=False)
    try:
        p = Req("refused", 3, 8, "127.0.0.1", bport)
        second.add(p)
        run([second], lambda: p.finished, "the refusal")
        assert "not registered with its bootstrap server" in p.finished, p.finished
        assert "(1, 1, 1)" in p.finished, p.finished
    finally:
        second.close()
        first.close()


def test_a_wildcard_host_is_refused_at_startup():
    args = server_args(free_port(1), free_port(1), 1, 4)
    args.host = "0.0.0.0"
    a = ks._KVArgs()
    a.engine_rank = 0
    with pytest.raises(Exception, match="wildcard"):
        ks.KvferryKVManager(a, "prefill", args, False)


def test_upstream_receivers_init_then_send_metadata():
    """Upstream SGLang 9e9fde14's receiver: init(prefill_dp_rank), then send_metadata(...)."""
    prefill, decode, bport = pair(1, 1)
    try:
        p, d = request("up", 61, 9, bport)
        prefill.add(p)
        recv = ks.KvferryKVReceiver(decode.ranks[0].mgr, f"127.0.0.1:{bport}", 61)
        recv.init(0)
        deadline = time.monotonic() + 10
        while recv.poll() != KVPoll.WaitingForInput:
            assert time.monotonic() < deadline
            prefill.step()
        import numpy as np
        recv.send_metadata(np.array([5, 6, 7]), 3, None, decode_prefix_len=0)
        while recv.poll() not in (KVPoll.Success, KVPoll.Failed):
            assert time.monotonic() < deadline
            prefill.step()
        assert recv.poll() == KVPoll.Success
        assert int(decode.ranks[0].meta.output_ids[3, 0]) == 1061
    finally:
        decode.close()
        prefill.close()
