"""One client request through a prefill instance and a decode instance.

Whole-request path: the prefill leg (retried once on another prefill instance when it fails or
times out), then the decode leg with the kv_transfer_params the prefill answered; the decode's
answer, streamed or not, is the client's. Layer-wise path: both legs at once with one transfer id;
the decode's answer is the client's, the prefill's is awaited in the background only to release
it (its failure is not the client's error when the decode answered; it is not retried, since the
decode leg already names that prefill instance's connector).

A decode leg that could not connect (the request never reached the instance) is sent once to
another decode instance; any other decode failure is the client's error: a 502/504 answer, or,
once a stream has started, an error event and the end of the stream.

Client disconnects (any time; watched on the connection, since aiohttp does not cancel a handler
by default): the legs in flight are closed, which makes a vLLM instance abort that request (a
decode instance's kvferry connector then tells the prefill side to free its hold at once), with
two refinements, both bounded by abandoned_grace_s, so that no KV is left held until its lease
(120 s by default) for want of a reader:
- a decode leg is closed once its response has started (the instance has the request), not
  before: a request dropped before an instance took it would tell no one to free the KV;
- a whole-request prefill leg may still answer: a prefill that already finished in its engine
  holds its KV for a decode leg no one will send. When it answers, or had answered before the
  decode leg went out, a release leg goes out: the decode leg with max_tokens 1, not streamed,
  its answer dropped, so the KV is read and freed now. A prefill still running after the grace is
  closed (aborted).
A layer-wise prefill leg is closed at once (its decode leg's abort frees what it holds). Holds
still end by lease when a decode instance dies before reading, or a prefill finishes after its
grace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, TypeVar

import aiohttp
from aiohttp import web

from .config import ProxyConfig
from .deadline import deadline
from .legs import (BadRequest, decode_body, layerwise_decode_params, new_transfer_id,
                   prefill_body, prompt_tokens, release_body)
from .metrics import ProxyMetrics
from .pool import Instance, Pool

logger = logging.getLogger("kvferry.proxy")
_T = TypeVar("_T")

API_PATHS = {"completions": "/v1/completions", "chat_completions": "/v1/chat/completions"}
CLIENT_POLL_S = 0.05  # how often a request's client connection is looked at
UPSTREAM_KEY_ENV = "KVFERRY_PROXY_UPSTREAM_API_KEY"  # bearer token when the client sends none


class LegFailure(Exception):
    """A leg that got no usable answer. `reason` is the metric label; `reached` is False when
    the request never reached the instance (no connection), so it may go to another one."""

    def __init__(self, reason: str, message: str, status: int = 502, reached: bool = True):
        super().__init__(message)
        self.reason, self.message, self.status, self.reached = reason, message, status, reached


class UpstreamAnswer(Exception):
    """A prefill instance refused the request itself (4xx): its answer goes to the client."""

    def __init__(self, status: int, body: bytes, content_type: str):
        super().__init__(f"status {status}")
        self.status, self.body, self.content_type = status, body, content_type


class ClientGone(Exception):
    """The client's connection closed (or stopped reading) while its answer was being sent."""


@dataclass
class Flight:
    """One client request on its way."""

    request_id: str
    endpoint: str
    body: dict
    headers: dict[str, str]
    started: float
    layerwise: bool
    stream: bool = False
    prefill_name: str = ""
    decode_started: bool = False
    decode_failed: bool = False
    outcome: str = "ok"
    response: Optional[web.StreamResponse] = None
    release_params: Optional[dict] = field(default=None, repr=False)

    @property
    def api(self) -> str:
        return API_PATHS[self.endpoint]


def error_response(status: int, message: str, kind: str = "proxy_error") -> web.Response:
    """An error in the OpenAI API's shape."""
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)


async def client_gone(request: web.Request) -> None:
    """Returns when the client's connection has closed."""
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            return
        await asyncio.sleep(CLIENT_POLL_S)


def _failure_of(error: BaseException, role: str, instance: Instance, timeout_s: float
                ) -> LegFailure:
    where = f"{role} instance {instance.name} ({instance.url})"
    if isinstance(error, asyncio.TimeoutError):
        return LegFailure("timeout", f"no answer from the {where} within {timeout_s:g} s", 504)
    if isinstance(error, aiohttp.ClientConnectorError):
        return LegFailure("connect", f"cannot connect to the {where}: {error}", 502,
                          reached=False)
    return LegFailure("disconnected", f"the {where} failed mid-request: "
                      f"{type(error).__name__}: {error}", 502)


def _uncount(instance: Instance) -> None:
    instance.outstanding -= 1


class Forwarder:
    def __init__(self, config: ProxyConfig, prefill: Pool, decode: Pool, metrics: ProxyMetrics,
                 session: aiohttp.ClientSession):
        self.config, self.prefill, self.decode = config, prefill, decode
        self.metrics, self.session = metrics, session
        self._upstream_key = os.environ.get(UPSTREAM_KEY_ENV, "")
        self._background: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ the client's side

    async def handle(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        try:
            async with deadline(self.config.client_body_timeout_s):
                raw = await request.read()
        except asyncio.TimeoutError:
            return error_response(408, f"the request body did not arrive within "
                                  f"{self.config.client_body_timeout_s:g} s")
        try:
            body = json.loads(raw)
        except ValueError as e:
            return error_response(400, f"expected a JSON request body, found invalid JSON: {e}",
                                  "invalid_request_error")
        if not isinstance(body, dict):
            return error_response(400, "expected a JSON object as the request body",
                                  "invalid_request_error")
        try:
            tokens, _ = prompt_tokens(endpoint, body, self.config.bytes_per_token)
        except BadRequest as e:
            return error_response(400, str(e), "invalid_request_error")
        headers = {"X-Request-Id": request.headers.get("X-Request-Id")
                   or f"kvferry-proxy-{uuid.uuid4().hex}"}
        authorization = request.headers.get("Authorization") or (
            f"Bearer {self._upstream_key}" if self._upstream_key else "")
        if authorization:
            headers["Authorization"] = authorization
        layerwise = (self.config.mode == "layerwise"
                     and tokens >= self.config.layerwise_min_tokens)
        flight = Flight(headers["X-Request-Id"], endpoint, body, headers,
                        asyncio.get_running_loop().time(), layerwise,
                        stream=bool(body.get("stream")))
        self.metrics.requests.labels(endpoint, "layerwise" if layerwise else "whole").inc()
        work = asyncio.ensure_future(self._serve(request, flight))
        watch = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # aiohttp cancels handlers of lost clients if told to
            work.cancel()
            watch.cancel()
            self.metrics.finished.labels("client_abort").inc()
            raise
        watch.cancel()
        if not work.done():  # the client left: closing the legs aborts them at the instances
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            flight.outcome = "client_abort"
        self.metrics.finished.labels(flight.outcome).inc()
        if work.cancelled():
            return flight.response or web.Response(status=499, text="client closed the request")
        return work.result()

    async def _serve(self, request: web.Request, flight: Flight) -> web.StreamResponse:
        try:
            if flight.layerwise:
                return await self._layerwise(request, flight)
            return await self._whole(request, flight)
        except UpstreamAnswer as a:
            flight.outcome = "error"
            return web.Response(status=a.status, body=a.body,
                                headers={"Content-Type": a.content_type})
        except LegFailure as f:
            flight.outcome = "error"
            logger.warning("request %s failed: %s", flight.request_id, f.message)
            return error_response(f.status, f.message, "upstream_error")
        except ClientGone:
            flight.outcome = "client_abort"
            return flight.response or web.Response(status=499, text="client closed the request")

    # ------------------------------------------------------------------ the two paths

    async def _whole(self, request: web.Request, flight: Flight) -> web.StreamResponse:
        prefill = asyncio.ensure_future(self._prefill_with_retry(flight))
        try:
            params, instance = await asyncio.shield(prefill)
        except asyncio.CancelledError:  # the client left during the prefill leg (or as it ended)
            self._keep(asyncio.ensure_future(self._abandon_prefill(flight, prefill)))
            raise
        flight.prefill_name = instance.name
        try:
            return await self._decode(request, flight, decode_body(flight.body, params))
        except asyncio.CancelledError:
            if params and not flight.decode_started:
                self._release(flight, params)
            raise

    async def _layerwise(self, request: web.Request, flight: Flight) -> web.StreamResponse:
        instance = self.prefill.pick(need_connector=True)
        if instance is None or instance.config.connector is None:
            flight.layerwise = False
            return await self._whole(request, flight)
        transfer_id = new_transfer_id()
        flight.prefill_name = instance.name
        # The leg counts from the moment it is chosen, not from when its task first runs: a burst
        # picks every prefill instance before any of its legs' tasks has started.
        instance.outstanding += 1
        prefill = asyncio.ensure_future(self._background_prefill(
            instance, flight, prefill_body(flight.body, transfer_id)))
        prefill.add_done_callback(lambda _: _uncount(instance))
        leg = decode_body(flight.body, layerwise_decode_params(instance.config.connector,
                                                               transfer_id))
        self._keep(prefill)
        try:
            response = await self._decode(request, flight, leg)
        except BaseException:  # the client left, or the decode failed: abort the prefill too
            prefill.cancel()
            raise
        if response.status != 200 or flight.decode_failed:
            prefill.cancel()
        return response

    # ------------------------------------------------------------------ prefill legs

    async def _on_two_instances(self, pool: Pool,
                                attempt: Callable[[Instance], Awaitable[_T]],
                                retry: Callable[[LegFailure], bool]) -> _T:
        """attempt(instance) on the best instance of `pool` that is up and, when it fails in a
        way `retry` accepts, once more on another. LegFailure (503) when none is up; the last
        failure, naming the instances tried, when both fail."""
        tried: list[Instance] = []
        last: Optional[LegFailure] = None
        for n in range(2):
            instance = pool.pick(exclude=tried)
            if instance is None:
                break
            if n:
                self.metrics.retries.labels(pool.role).inc()
            tried.append(instance)
            try:
                return await attempt(instance)
            except LegFailure as f:
                if not retry(f):
                    raise
                last = f
        if last is None:
            raise LegFailure("no_instance", f"no {pool.role} instance is up", 503)
        names = ", ".join(i.name for i in tried)
        raise LegFailure(last.reason, f"{pool.role} failed on {names}: {last.message}",
                         last.status)

    async def _prefill_with_retry(self, flight: Flight) -> tuple[Optional[dict], Instance]:
        """The whole-request prefill leg, sent once more to another instance when it fails."""
        body = prefill_body(flight.body)

        async def attempt(instance: Instance) -> tuple[Optional[dict], Instance]:
            params = (await self._prefill_leg(instance, flight, body)).get("kv_transfer_params")
            if params is not None and not isinstance(params, dict):
                logger.warning("request %s: prefill instance %s answered kv_transfer_params "
                               "%r, not an object; the decode instance computes the prompt",
                               flight.request_id, instance.name, params)
                params = None
            return params, instance

        return await self._on_two_instances(self.prefill, attempt, lambda f: True)

    async def _prefill_leg(self, instance: Instance, flight: Flight, body: dict,
                           counted: bool = False) -> dict:
        """The prefill's answer (a JSON object); LegFailure or UpstreamAnswer otherwise.
        `counted`: the caller counted the leg in the instance's outstanding legs and uncounts
        it (a layer-wise leg, counted when its instance was chosen)."""
        if not counted:
            instance.outstanding += 1
        self.metrics.legs.labels("prefill", instance.name).inc()
        timeout = self.config.prefill_timeout_s
        try:
            async with deadline(timeout):
                async with self.session.post(instance.url + flight.api, json=body,
                                             headers=flight.headers) as response:
                    data = await response.read()
                    status = response.status
                    content_type = response.headers.get("Content-Type", "application/json")
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            failure = _failure_of(e, "prefill", instance, timeout)
            self._failed(self.prefill, instance, failure)
            raise failure from e
        finally:
            if not counted:
                instance.outstanding -= 1
        if status >= 500:
            failure = LegFailure("status", f"prefill instance {instance.name} answered "
                                 f"{status}: {data[:300].decode(errors='replace')}")
            self._failed(self.prefill, instance, failure)
            raise failure
        if status != 200:
            raise UpstreamAnswer(status, data, content_type)
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            failure = LegFailure("bad_answer", f"prefill instance {instance.name} answered 200 "
                                 f"with no JSON object: {data[:300].decode(errors='replace')}")
            self._failed(self.prefill, instance, failure)
            raise failure
        return answer

    async def _background_prefill(self, instance: Instance, flight: Flight, body: dict) -> None:
        """A layer-wise prefill leg: its answer only ends it; failures are logged and counted.
        Its instance counted it when it was chosen; the task's end uncounts it (also when the
        task is cancelled before it ran)."""
        try:
            await self._prefill_leg(instance, flight, body, counted=True)
        except LegFailure as f:
            logger.info("request %s: layer-wise prefill leg: %s", flight.request_id, f.message)
        except UpstreamAnswer as a:
            logger.info("request %s: layer-wise prefill leg refused with status %d: %s",
                        flight.request_id, a.status, a.body[:300].decode(errors="replace"))

    # ------------------------------------------------------------------ decode legs

    async def _decode(self, request: web.Request, flight: Flight, body: dict
                      ) -> web.StreamResponse:
        """The decode leg; sent once more to another instance only when it never reached the
        first (no connection): the KV it names is still held for another reader."""
        async def attempt(instance: Instance) -> web.StreamResponse:
            flight.decode_started = True
            return await self._decode_on(instance, request, flight, body)

        return await self._on_two_instances(self.decode, attempt, lambda f: not f.reached)

    async def _decode_on(self, instance: Instance, request: web.Request, flight: Flight,
                         body: dict) -> web.StreamResponse:
        instance.outstanding += 1
        self.metrics.legs.labels("decode", instance.name).inc()
        loop = asyncio.get_running_loop()
        response: Optional[aiohttp.ClientResponse] = None
        clean = False
        timeout = self.config.first_byte_timeout_s
        try:
            try:
                response = await self._post_leg(instance.url + flight.api, body, flight, timeout)
                if response.status != 200 or not flight.stream:
                    timeout = min(self.config.decode_timeout_s, max(
                        1.0, self.config.decode_timeout_s - (loop.time() - flight.started)))
                    async with deadline(timeout):
                        data = await response.read()
            except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
                failure = _failure_of(e, "decode", instance, timeout)
                self._failed(self.decode, instance, failure)
                raise failure from e
            content_type = response.headers.get("Content-Type", "application/json")
            if response.status != 200:  # the instance's own error, to the client as is
                if response.status >= 500:
                    self._failed(self.decode, instance, LegFailure(
                        "status", f"decode answered {response.status}"))
                flight.outcome = "error"
                clean = True
                return web.Response(status=response.status, body=data,
                                    headers={"Content-Type": content_type})
            if not flight.stream:
                self._observe_ttft(flight, instance)
                clean = True
                return web.Response(status=200, body=data, headers={"Content-Type": content_type})
            clean = await self._relay(request, flight, instance, response)
            return flight.response
        finally:
            instance.outstanding -= 1
            if response is not None:
                if clean:
                    response.release()
                else:
                    response.close()  # closing the connection aborts the request there

    async def _post_leg(self, url: str, body: dict, flight: Flight, timeout: float
                        ) -> aiohttp.ClientResponse:
        """POSTs a decode leg; returns once its response has started. Cancelled before that (the
        client left), the request keeps going until its response starts or for
        abandoned_grace_s, and is closed then: an instance aborts a request whose connection
        closes only once it has taken it (its engine then tells the prefill side to free the
        KV), and a request dropped before that would leave the prefill's hold to its lease."""
        post = asyncio.ensure_future(self.session.post(url, json=body, headers=flight.headers))
        try:
            async with deadline(timeout):
                return await asyncio.shield(post)
        except asyncio.CancelledError:
            self._keep(asyncio.ensure_future(self._close_when_started(post)))
            raise
        except BaseException:
            post.cancel()
            raise

    async def _close_when_started(self, post: "asyncio.Future[aiohttp.ClientResponse]") -> None:
        try:
            response = await asyncio.wait_for(asyncio.shield(post),
                                              self.config.abandoned_grace_s)
        except asyncio.TimeoutError:
            post.cancel()
            await asyncio.gather(post, return_exceptions=True)
            return
        except (aiohttp.ClientError, OSError):
            return
        response.close()

    async def _relay(self, request: web.Request, flight: Flight, instance: Instance,
                     response: aiohttp.ClientResponse) -> bool:
        """Streams the decode's answer to the client; True when it ended cleanly. A failure of
        the decode mid-stream ends the client's stream with an error event."""
        idle = self.config.stream_idle_timeout_s
        out = web.StreamResponse(status=200, headers={
            "Content-Type": response.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache"})
        try:
            async with deadline(idle):
                await out.prepare(request)
        except (ConnectionResetError, asyncio.TimeoutError) as e:
            raise ClientGone() from e
        flight.response = out
        loop = asyncio.get_running_loop()
        end = flight.started + self.config.decode_timeout_s
        first = True
        while True:
            wait = min(self.config.first_byte_timeout_s if first else idle,
                       max(0.001, end - loop.time()))
            try:
                async with deadline(wait):
                    chunk = await response.content.readany()
            except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
                failure = _failure_of(e, "decode", instance, wait)
                self._failed(self.decode, instance, failure)
                flight.outcome, flight.decode_failed = "error", True
                logger.warning("request %s: %s", flight.request_id, failure.message)
                await self._stream_error(out, failure.message)
                return False
            if not chunk:
                break
            if first:
                self._observe_ttft(flight, instance)
                first = False
            try:
                async with deadline(idle):
                    await out.write(chunk)
            except (ConnectionResetError, asyncio.TimeoutError) as e:
                raise ClientGone() from e
        try:
            async with deadline(idle):
                await out.write_eof()
        except (ConnectionResetError, asyncio.TimeoutError):
            pass  # everything was sent; the client left before the end of the stream
        return True

    async def _stream_error(self, out: web.StreamResponse, message: str) -> None:
        """An error event and the end of the stream, as vLLM ends a stream that fails."""
        event = json.dumps({"error": {"message": message, "type": "upstream_error",
                                      "code": 502}})
        try:
            async with deadline(self.config.stream_idle_timeout_s):
                await out.write(f"data: {event}\n\ndata: [DONE]\n\n".encode())
                await out.write_eof()
        except (ConnectionResetError, asyncio.TimeoutError):
            pass  # the client is gone too

    # ------------------------------------------------------------------ release legs

    async def _abandon_prefill(self, flight: Flight,
                               prefill: "asyncio.Future[tuple[Optional[dict], Instance]]"
                               ) -> None:
        """A whole-request prefill leg whose client left. Closing it at once aborts it, but a
        prefill that already finished in its engine (its answer on the way) keeps its hold until
        the lease, since no decode instance knows of it. So the leg gets abandoned_grace_s to
        answer, and its KV is then read and freed by a release leg; a prefill still running after
        that is closed (aborted)."""
        grace = self.config.abandoned_grace_s
        try:
            params, _ = await asyncio.wait_for(asyncio.shield(prefill), grace)
        except asyncio.TimeoutError:
            prefill.cancel()
            await asyncio.gather(prefill, return_exceptions=True)
            return
        except (LegFailure, UpstreamAnswer):
            return
        if params:
            await self._release_leg(flight, params)

    def _release(self, flight: Flight, params: dict) -> None:
        self._keep(asyncio.ensure_future(self._release_leg(flight, params)))

    async def _release_leg(self, flight: Flight, params: dict) -> None:
        instance = self.decode.pick()
        if instance is None:
            logger.info("request %s: its client left after the prefill; no decode instance is "
                        "up to read its KV, which is freed by its lease", flight.request_id)
            return
        instance.outstanding += 1
        self.metrics.legs.labels("release", instance.name).inc()
        timeout = self.config.first_byte_timeout_s
        try:
            async with deadline(timeout):
                async with self.session.post(instance.url + flight.api,
                                             json=release_body(flight.body, params),
                                             headers=flight.headers) as response:
                    await response.read()
                    if response.status != 200:
                        self._failed(self.decode, instance, LegFailure(
                            "status", f"release leg answered {response.status}"), "release")
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            self._failed(self.decode, instance, _failure_of(e, "decode", instance, timeout),
                         "release")
        finally:
            instance.outstanding -= 1

    # ------------------------------------------------------------------ bookkeeping

    def _failed(self, pool: Pool, instance: Instance, failure: LegFailure,
                role: Optional[str] = None) -> None:
        self.metrics.leg_failures.labels(role or pool.role, instance.name, failure.reason).inc()
        if failure.reason in ("connect", "disconnected"):
            pool.mark_down(instance, failure.message)

    def _observe_ttft(self, flight: Flight, instance: Instance) -> None:
        elapsed = asyncio.get_running_loop().time() - flight.started
        self.metrics.ttft.labels(flight.prefill_name, instance.name).observe(elapsed)

    def _keep(self, task: "asyncio.Future[Any]") -> None:
        """Keeps a background task referenced until it ends (a layer-wise prefill leg being
        released, a release leg)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
