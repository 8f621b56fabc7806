"""kvferry-proxy end to end (issue 21, item 3): fake vLLM instances (fake_vllm.py: vLLM's OpenAI
API over `kvferry serve`, which moves and verifies every byte of KV) behind the proxy, started as
`python3 -m kvferry.proxy` (or the installed kvferry-proxy under the wheel test).

Every completed request is checked byte for byte (the decode engine's verified_bytes, no block
recomputed); "nothing held" is the engines' own control `stats` (holds, loads outstanding, blocks
in use) and, where it must not be the lease that ended a hold, the prefill engines'
kvferry_holds_ended_total{reason="lease_expired"} (their lease is 60 s there).
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest

pytest.importorskip("aiohttp", reason="python3-aiohttp is not installed (make deps)")
pytest.importorskip("zmq", reason="python3-zmq is not installed (make deps)")
pytest.importorskip("prometheus_client", reason="python3-prometheus-client (make deps)")

import aiohttp  # noqa: E402

from proxy_cluster import (CLI, Cluster, answer_info, answer_text, bodies,  # noqa: E402
                           check_verified, metric, post)

if not CLI:
    pytest.skip("KVFERRY_CLI (the kvferry binary) is not set; ctest sets it",
                allow_module_level=True)

LONG_LEASE = ["--hold-lease-ms", "60000"]
# 400 tokens: 1.2 s of prefill. Layer-wise requests compute in chunks of 32 tokens, each a step
# of the engine, between which it takes control messages (an abort, stats); a whole-request
# prefill is one step, during which the engine answers nothing.
SLOW_PREFILL = ["--compute-us-per-token", "3000", "--prefill-chunk-tokens", "32"]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def xpyd():
    """Two prefill and two decode instances, whole-request transfer, a 3 s lease."""
    with Cluster(prefill=2, decode=2, serve_args=["--hold-lease-ms", "3000"]) as c:
        yield c


def test_streaming_and_not_through_both_endpoints(xpyd):
    async def go():
        async with aiohttp.ClientSession() as s:
            before = await xpyd.metrics(s)
            for body in [
                {"model": "m", "prompt": list(range(1, 201)), "max_tokens": 5},
                {"model": "m", "prompt": "the quick brown fox " * 20, "max_tokens": 4,
                 "stream": True, "stream_options": {"include_usage": True}},
                {"model": "m", "messages": [{"role": "user", "content": "hello " * 60}],
                 "max_tokens": 3, "max_completion_tokens": 3},
                {"model": "m", "messages": [{"role": "user", "content": "hello " * 61}],
                 "max_tokens": 6, "stream": True},
            ]:
                status, answer = await post(s, xpyd.url, body)
                assert status == 200, answer
                check_verified(answer_info(answer))
                assert answer_text(answer).count(" t") == (body.get("max_completion_tokens")
                                                            or body["max_tokens"])
            after = await xpyd.metrics(s)
            for name, labels in (("kvferry_proxy_requests_total", {"path": "whole"}),
                                 ("kvferry_proxy_requests_finished_total", {"outcome": "ok"}),
                                 ("kvferry_proxy_ttft_seconds_count", {})):
                assert metric(after, name, **labels) - metric(before, name, **labels) == 4, name
            await xpyd.wait_nothing_held(5)
    run(go())


def test_xpyd_spreads_by_least_outstanding(xpyd):
    async def go():
        async with aiohttp.ClientSession() as s:
            before = await xpyd.metrics(s)
            answers = await asyncio.gather(*(post(s, xpyd.url, b) for b in bodies(40, 1)))
            for status, answer in answers:
                assert status == 200, answer
                check_verified(answer_info(answer))
            after = await xpyd.metrics(s)
            for inst in xpyd.instances:
                sent = (metric(after, "kvferry_proxy_legs_total", instance=inst.name)
                        - metric(before, "kvferry_proxy_legs_total", instance=inst.name))
                assert 10 <= sent <= 30, (inst.name, sent)  # 40 legs per role over two
            await xpyd.wait_nothing_held(5)
    run(go())


def test_layerwise_bursts_spread_their_prefill_legs_by_least_outstanding():
    """Layer-wise legs count from the moment their instance is chosen. Before, a burst chose
    every prefill instance before any of its legs' tasks had run, so the legs of a burst that
    arrived while one prefill instance had a leg in flight all went to the other (an outside
    test saw 39 of 40 on one instance while the decode legs split evenly; issue 31)."""
    with Cluster(prefill=2, decode=2, serve_args=LONG_LEASE,
                 prefill_serve_args=["--compute-us-per-token", "3000"],
                 proxy_args=["--mode", "layerwise", "--layerwise-min-tokens", "16"]) as c:
        prefills = [i for i in c.instances if i.role == "prefill"]

        async def prefill_legs(s):
            m = await c.metrics(s)
            return [metric(m, "kvferry_proxy_legs_total", instance=i.name) for i in prefills]

        async def go():
            async with aiohttp.ClientSession() as s:
                before = await prefill_legs(s)
                # A long prompt (1.2 s of prefill) holds one prefill instance's leg in flight.
                slow = asyncio.ensure_future(post(s, c.url, {"model": "m", "max_tokens": 2,
                                                             "prompt": list(range(1, 401))}))
                deadline = time.monotonic() + 10
                while sum(await prefill_legs(s)) == sum(before):
                    assert time.monotonic() < deadline, "the slow request's leg never went"
                    await asyncio.sleep(0.01)
                assert not slow.done()
                reqs = [{"model": "m", "prompt": list(range(1 + i, 21 + i)), "max_tokens": 2}
                        for i in range(40)]
                answers = await asyncio.gather(*(post(s, c.url, b) for b in reqs), slow)
                for status, answer in answers:
                    assert status == 200, answer
                    check_verified(answer_info(answer))
                sent = [a - b for a, b in zip(await prefill_legs(s), before)]
                assert sum(sent) == 41, sent
                assert all(10 <= n <= 31 for n in sent), sent
                await c.wait_nothing_held(5)
        run(go())


def test_a_thousand_requests_with_a_third_abandoned_leave_nothing_held(xpyd):
    """1,000 requests, 16 at a time, 30 % of them abandoned by their client at a random moment
    (during either leg, between them, mid-stream). Every other one is answered and verified
    byte for byte; at the end nothing is held or in use on any instance, at once: abandoned legs
    are closed, abandoned prefills whose answer was on its way are read and freed by release
    legs (forward.py). The lease (3 s here) ends only what a race the proxy cannot see leaves
    behind (a leg that took longer than the 1 s grace to reach its engine): a handful at most."""
    rng = random.Random(7)

    async def one(s, body, abandon):
        if abandon is None:
            return await post(s, xpyd.url, body)
        task = asyncio.ensure_future(post(s, xpyd.url, body))
        await asyncio.sleep(abandon)
        if task.done():
            return task.result()
        task.cancel()  # closes the connection: the client went away
        await asyncio.gather(task, return_exceptions=True)
        return None

    async def go():
        start = time.monotonic()
        limit = asyncio.Semaphore(16)
        async with aiohttp.ClientSession() as s:
            lease_before = await xpyd.holds_ended_by_lease(s)

            async def bounded(body, abandon):
                async with limit:
                    return await one(s, body, abandon)

            work = [(b, rng.uniform(0, 0.03) if rng.random() < 0.3 else None)
                    for b in bodies(1000, 2)]
            results = await asyncio.gather(*(bounded(b, a) for b, a in work))
            elapsed = time.monotonic() - start
            answered = abandoned = 0
            for (body, abandon), result in zip(work, results):
                if result is None:
                    abandoned += 1
                    continue
                status, answer = result
                assert status == 200, answer
                check_verified(answer_info(answer))
                answered += 1
            drained = await xpyd.wait_nothing_held(15)
            by_lease = await xpyd.holds_ended_by_lease(s) - lease_before
            print(f"\n1000 requests in {elapsed:.1f} s: {answered} answered and verified, "
                  f"{abandoned} abandoned; nothing held {drained:.2f} s after the last answer; "
                  f"{by_lease} holds ended by their lease")
            assert answered + abandoned == 1000 and abandoned >= 200
            assert by_lease <= 5, by_lease
    run(go())


def test_layerwise_legs_go_at_once_and_short_prompts_take_the_whole_path():
    with Cluster(prefill=1, decode=1, serve_args=LONG_LEASE,
                 prefill_serve_args=["--compute-us-per-token", "500"],
                 proxy_args=["--mode", "layerwise", "--layerwise-min-tokens", "64"]) as c:
        async def go():
            async with aiohttp.ClientSession() as s:
                for body in [{"model": "m", "prompt": list(range(1, 401)), "max_tokens": 3},
                             {"model": "m", "prompt": "abc " * 150, "stream": True,
                              "max_tokens": 3},
                             {"model": "m", "prompt": list(range(1, 40)), "max_tokens": 2}]:
                    status, answer = await post(s, c.url, body)
                    assert status == 200, answer
                    check_verified(answer_info(answer))
                m = await c.metrics(s)
                assert metric(m, "kvferry_proxy_requests_total", path="layerwise") == 2
                assert metric(m, "kvferry_proxy_requests_total", path="whole") == 1
                await c.wait_nothing_held(5)
                assert await c.holds_ended_by_lease(s) == 0
        run(go())


def test_client_disconnect_mid_stream_aborts_both_legs_at_once_layerwise():
    """Layer-wise: the stream has started (the decode instance answered its headers) while the
    prefill computes (1.2 s) and the decode engine loads the layers as they come. The client
    leaves: the proxy closes both legs, the decode engine stops its load and its connector tells
    the prefill side, whose hold ends by that abort notice (kept until the hold exists) as soon
    as its compute is over, not by the 60 s lease."""
    with Cluster(prefill=1, decode=1, serve_args=LONG_LEASE, prefill_serve_args=SLOW_PREFILL,
                 proxy_args=["--mode", "layerwise", "--layerwise-min-tokens", "64"]) as c:
        async def go():
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "prompt": list(range(1, 401)), "max_tokens": 8,
                        "stream": True}
                response = await s.post(c.url + "/v1/completions", json=body,
                                        timeout=aiohttp.ClientTimeout(total=30))
                assert response.status == 200
                decode = c.of("decode")
                deadline = time.monotonic() + 5
                while (await c.stats(decode))["d0"]["loads_outstanding"] == 0:
                    assert time.monotonic() < deadline, "the decode never started its load"
                    await asyncio.sleep(0.02)
                left = time.monotonic()
                response.close()  # the client goes away mid-stream
                await c.wait_nothing_held(5)
                drained = time.monotonic() - left
                after = await c.stats()
                assert after["d0"]["requests_aborted"] == 1, after["d0"]
                assert after["d0"]["requests_done"] == 0, after["d0"]
                assert await c.holds_ended(s, "abort") == 1
                assert await c.holds_ended_by_lease(s) == 0
                m = await c.metrics(s)
                assert metric(m, "kvferry_proxy_requests_finished_total",
                              outcome="client_abort") == 1
                print(f"\nnothing held {drained:.2f} s after the client left (the prefill "
                      "engine answers nothing while it computes)")
        run(go())


def test_client_disconnect_mid_stream_frees_the_prefill_hold_at_once_whole_request():
    """Whole-request: the prefill has answered and holds the KV; the stream has started; the
    decode engine has the request waiting for free blocks (a layer-wise request B, 25 of its
    36 blocks, waits for a slow prefill). The client leaves: the proxy closes the decode leg,
    the decode engine ends the waiting request and its connector tells the prefill side (a load
    of no blocks, whose finished notice frees the hold, as DESIGN.md says), whose hold ends at
    once (the lease is 60 s)."""
    with Cluster(prefill=2, decode=1, serve_args=LONG_LEASE, prefill_serve_args=SLOW_PREFILL,
                 decode_num_blocks=36,
                 proxy_args=["--mode", "layerwise", "--layerwise-min-tokens", "300"]) as c:
        async def go():
            async with aiohttp.ClientSession() as s:
                blocker = asyncio.ensure_future(post(s, c.url, {
                    "model": "m", "prompt": list(range(1, 401)), "max_tokens": 2}))
                busy = await _wait_outstanding(c, s, "prefill")  # computing: it answers nothing
                other = [i for i in c.of("prefill") if i.name != busy]
                response = await s.post(c.url + "/v1/completions", json={
                    "model": "m", "prompt": list(range(500, 700)), "max_tokens": 8,
                    "stream": True}, timeout=aiohttp.ClientTimeout(total=30))
                assert response.status == 200  # the decode leg is out: the prefill answered
                assert (await c.stats(other))[other[0].name]["holds"] == 1
                left = time.monotonic()
                response.close()
                deadline = time.monotonic() + 3
                while (await c.stats(other))[other[0].name]["holds"]:
                    assert time.monotonic() < deadline, "the hold did not end"
                    await asyncio.sleep(0.01)
                freed = time.monotonic() - left
                assert not blocker.done(), "the blocker ended first: nothing was tested"
                status, answer = await asyncio.wait_for(blocker, 30)
                assert status == 200, answer
                check_verified(answer_info(answer))
                await c.wait_nothing_held(3)
                assert freed < 5.0, freed  # the lease is 60 s; 0.06 s here, idle
                assert await c.holds_ended_by_lease(s) == 0
                d0 = (await c.stats(c.of("decode")))["d0"]
                assert (d0["requests_done"], d0["requests_aborted"]) == (1, 1), d0
                print(f"\nthe prefill hold ended {freed:.3f} s after the client left")
        run(go())


def test_client_disconnect_while_the_prefill_leg_waits_aborts_it():
    """Whole-request path: request B waits in the prefill engine's queue behind A (1.2 s of
    compute) when its client leaves. After the grace (0.2 s here) its prefill leg is closed, the
    engine aborts B while it waits, and B never reaches a decode instance; A is answered and
    verified, and nothing is held (no hold ended by the 60 s lease)."""
    with Cluster(prefill=1, decode=1, serve_args=LONG_LEASE, prefill_serve_args=SLOW_PREFILL,
                 proxy_args=["--abandoned-grace-s", "0.2"]) as c:
        async def go():
            async with aiohttp.ClientSession() as s:
                before = await c.stats()
                a = asyncio.ensure_future(post(s, c.url, {"model": "m", "max_tokens": 4,
                                                          "prompt": list(range(1, 401))}))
                await asyncio.sleep(0.1)
                b = asyncio.ensure_future(post(s, c.url, {"model": "m", "max_tokens": 4,
                                                          "prompt": list(range(1000, 1100))}))
                await asyncio.sleep(0.3)
                b.cancel()
                await asyncio.gather(b, return_exceptions=True)
                status, answer = await asyncio.wait_for(a, 30)
                assert status == 200, answer
                check_verified(answer_info(answer))
                await c.wait_nothing_held(3)
                after = await c.stats()
                assert after["p0"]["requests_aborted"] == before["p0"]["requests_aborted"] + 1
                assert after["p0"]["requests_done"] == before["p0"]["requests_done"] + 1
                assert after["d0"]["requests_done"] == before["d0"]["requests_done"] + 1
                assert after["d0"]["requests_aborted"] == before["d0"]["requests_aborted"]
                assert await c.holds_ended_by_lease(s) == 0
        run(go())


def test_client_disconnect_mid_stream_of_tokens_stops_the_decode():
    with Cluster(prefill=1, decode=1, serve_args=LONG_LEASE, decode_token_delay_ms=50) as c:
        async def go():
            async with aiohttp.ClientSession() as s:
                response = await s.post(c.url + "/v1/completions", json={
                    "model": "m", "prompt": list(range(1, 200)), "max_tokens": 200,
                    "stream": True}, timeout=aiohttp.ClientTimeout(total=30))
                assert response.status == 200
                first = await asyncio.wait_for(response.content.readline(), 10)
                assert first.startswith(b"data: ")
                response.close()
                await c.wait_nothing_held(3)
                # The proxy notices within its poll, then closes the leg. The deadline only
                # bounds a broken proxy (2 s of polls was missed under ctest -j2 load).
                deadline = time.monotonic() + 15
                while True:
                    m = await c.metrics(s)
                    if (metric(m, "kvferry_proxy_outstanding_legs", role="decode") == 0
                            or time.monotonic() > deadline):
                        break
                    await asyncio.sleep(0.05)
                assert metric(m, "kvferry_proxy_outstanding_legs", role="decode") == 0
                assert metric(m, "kvferry_proxy_requests_finished_total",
                              outcome="client_abort") == 1
        run(go())


async def _wait_outstanding(c: Cluster, s: aiohttp.ClientSession, role: str) -> str:
    """The name of the one instance of `role` with a leg in flight."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = await c.metrics(s)
        busy = [i.name for i in c.of(role)
                if metric(m, "kvferry_proxy_outstanding_legs", role=role, instance=i.name) > 0]
        if busy:
            return busy[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {role} leg in flight within 10 s")


def test_a_prefill_instance_killed_mid_request_is_retried_on_another():
    with Cluster(prefill=2, decode=1, serve_args=LONG_LEASE,
                 prefill_serve_args=["--compute-us-per-token", "2000"]) as c:
        async def go():
            async with aiohttp.ClientSession() as s:
                task = asyncio.ensure_future(post(s, c.url, {"model": "m", "max_tokens": 3,
                                                             "prompt": list(range(1, 301))}))
                victim = await _wait_outstanding(c, s, "prefill")
                next(i for i in c.instances if i.name == victim).kill()
                status, answer = await asyncio.wait_for(task, 30)
                assert status == 200, answer
                check_verified(answer_info(answer))
                m = await c.metrics(s)
                assert metric(m, "kvferry_proxy_retries_total", role="prefill") == 1
                assert metric(m, "kvferry_proxy_leg_failures_total", role="prefill",
                              instance=victim) == 1
                assert metric(m, "kvferry_proxy_instance_up", role="prefill",
                              instance=victim) == 0
                await c.wait_nothing_held(3)
                # The next requests go to the survivor only.
                for _ in range(3):
                    status, answer = await post(s, c.url, {"model": "m", "max_tokens": 2,
                                                           "prompt": list(range(1, 41))})
                    assert status == 200, answer
        run(go())


def test_a_decode_instance_killed_mid_stream_is_an_error_and_nothing_stays_held():
    with Cluster(prefill=1, decode=2, serve_args=LONG_LEASE, decode_token_delay_ms=50) as c:
        async def go():
            async with aiohttp.ClientSession() as s:
                task = asyncio.ensure_future(post(s, c.url, {
                    "model": "m", "prompt": list(range(1, 300)), "max_tokens": 100,
                    "stream": True}))
                victim = await _wait_outstanding(c, s, "decode")
                await asyncio.sleep(0.2)  # some tokens streamed
                next(i for i in c.instances if i.name == victim).kill()
                status, events = await asyncio.wait_for(task, 30)
                assert status == 200
                assert "error" in events[-2] and events[-1] == "[DONE]", events[-3:]
                assert victim in events[-2]["error"]["message"]
                await c.wait_nothing_held(3)
                assert await c.holds_ended_by_lease(s) == 0
        run(go())


def test_a_decode_instance_killed_before_it_took_the_request_is_an_error():
    """Layer-wise: the decode instance dies while the request waits in its queue. The client
    gets a 502 naming it; the proxy closes the prefill leg. The prefill's hold has no reader
    left to free it, so it ends by its lease (2 s here), and then nothing is held."""
    with Cluster(prefill=1, decode=2, serve_args=["--hold-lease-ms", "2000"],
                 decode_queue_ms=5000,
                 proxy_args=["--mode", "layerwise", "--layerwise-min-tokens", "64"]) as c:
        async def go():
            async with aiohttp.ClientSession() as s:
                task = asyncio.ensure_future(post(s, c.url, {
                    "model": "m", "prompt": list(range(1, 401)), "max_tokens": 4}))
                victim = await _wait_outstanding(c, s, "decode")
                await asyncio.sleep(0.2)
                next(i for i in c.instances if i.name == victim).kill()
                status, answer = await asyncio.wait_for(task, 30)
                assert status == 502 and victim in answer["error"]["message"], answer
                await c.wait_nothing_held(5)
                assert await c.holds_ended_by_lease(s) == 1
        run(go())


def test_health_checks_take_a_stopped_instance_out_and_put_it_back():
    import signal
    with Cluster(prefill=1, decode=2) as c:
        async def go():
            async with aiohttp.ClientSession() as s:
                stopped = c.of("decode")[1]
                stopped.proc.send_signal(signal.SIGSTOP)  # alive, but answers nothing
                try:
                    deadline = time.monotonic() + 10
                    while True:
                        m = await c.metrics(s)
                        if metric(m, "kvferry_proxy_instance_up", instance=stopped.name) == 0:
                            break
                        assert time.monotonic() < deadline, "never taken out"
                        await asyncio.sleep(0.1)
                    async with s.get(c.url + "/health") as r:
                        assert (await r.json())["up"] == {"prefill": 1, "decode": 1}
                    before = metric(m, "kvferry_proxy_legs_total", instance=stopped.name)
                    for body in bodies(6, 3):
                        status, answer = await post(s, c.url, body)
                        assert status == 200, answer
                        check_verified(answer_info(answer))
                    m = await c.metrics(s)
                    assert metric(m, "kvferry_proxy_legs_total", instance=stopped.name) == before
                finally:
                    stopped.proc.send_signal(signal.SIGCONT)
                deadline = time.monotonic() + 10
                while metric(await c.metrics(s), "kvferry_proxy_instance_up",
                             instance=stopped.name) != 1:
                    assert time.monotonic() < deadline, "never put back"
                    await asyncio.sleep(0.1)
                status, answer = await post(s, c.url, bodies(1, 4)[0])
                assert status == 200, answer
        run(go())
