"""The proxy's aiohttp application: the OpenAI routes, /metrics, /health, the admin API, and the
lifetime of its HTTP client session, health checker, etcd discovery and background legs."""

from __future__ import annotations

import asyncio
import hmac
import json
import os
from typing import Callable, Optional

import aiohttp
from aiohttp import web

from . import health
from .config import ConfigError, ProxyConfig, instance_from_dict, parse_discovery
from .discovery import EtcdDiscovery
from .deadline import deadline
from .forward import Forwarder, error_response
from .metrics import ProxyMetrics
from .pool import STATES, Instance, Pool

# The admin API's bearer token; the admin API answers 403 when it is not set.
ADMIN_TOKEN_ENV = "KVFERRY_PROXY_ADMIN_TOKEN"

class Proxy:
    """State shared by the routes; one per application."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.prefill = Pool("prefill", config.prefill)
        self.decode = Pool("decode", config.decode)
        self.metrics = ProxyMetrics([self.prefill, self.decode])
        self.session: Optional[aiohttp.ClientSession] = None
        self.forwarder: Optional[Forwarder] = None
        self.pools = {"prefill": self.prefill, "decode": self.decode}
        self._health: Optional[asyncio.Task] = None
        self.discovery: Optional[EtcdDiscovery] = None
        self._discovery_task: Optional[asyncio.Task] = None
        self.admin_token = os.environ.get(ADMIN_TOKEN_ENV, "")

    async def start(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        self.forwarder = Forwarder(self.config, self.prefill, self.decode, self.metrics,
                                   self.session)
        self._health = asyncio.ensure_future(health.run(self.session,
                                                        [self.prefill, self.decode],
                                                        self.config))
        if self.config.discovery:
            self.discovery = EtcdDiscovery(parse_discovery(self.config.discovery), self.pools,
                                           self.session)
            self._discovery_task = asyncio.ensure_future(self.discovery.run())

    async def stop(self, app: web.Application) -> None:
        for task in (self._health, self._discovery_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.forwarder is not None:
            await self.forwarder.close()
        if self.session is not None:
            await self.session.close()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        assert self.forwarder is not None
        return await self.forwarder.handle(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        assert self.forwarder is not None
        return await self.forwarder.handle(request, "chat_completions")

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.text(),
                            headers={"Content-Type": self.metrics.content_type})

    async def health(self, request: web.Request) -> web.Response:
        up = {"prefill": self.prefill.up_count(), "decode": self.decode.up_count()}
        ok = up["prefill"] > 0 and up["decode"] > 0
        return web.json_response({"status": "ok" if ok else "unavailable", "up": up},
                                 status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models of a decode instance (OpenAI clients ask for it)."""
        assert self.session is not None
        instance = self.decode.pick()
        if instance is None:
            return error_response(503, "no decode instance is up")
        try:
            async with deadline(self.config.health_timeout_s):
                async with self.session.get(instance.url + "/v1/models",
                                            headers=_auth(request)) as response:
                    return web.Response(status=response.status, body=await response.read(),
                                        headers={"Content-Type": response.headers.get(
                                            "Content-Type", "application/json")})
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            return error_response(502, f"decode instance {instance.name}: /v1/models failed: "
                                  f"{type(e).__name__}: {e}", "upstream_error")


    # ------------------------------------------------------------------ the admin API

    def _admin_refusal(self, request: web.Request) -> Optional[web.Response]:
        if not self.admin_token:
            return error_response(403, f"the admin API is off: start the proxy with "
                                  f"{ADMIN_TOKEN_ENV} set to a token", "permission_error")
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.admin_token}".encode()):
            return error_response(401, "the admin API needs 'Authorization: Bearer TOKEN' with "
                                  f"the proxy's {ADMIN_TOKEN_ENV}", "authentication_error")
        return None

    def _pool_of(self, request: web.Request) -> tuple[Optional[Pool], Optional[web.Response]]:
        role = request.match_info["role"]
        if role not in self.pools:
            return None, error_response(404, f"role: expected prefill or decode, found {role!r}",
                                        "invalid_request_error")
        return self.pools[role], None

    @staticmethod
    def _describe(inst: Instance) -> dict:
        c = inst.config.connector
        return {"role": inst.role, "name": inst.name, "url": inst.url, "state": inst.state,
                "up": inst.up, "legs_in_flight": inst.outstanding, "source": inst.source,
                "connector": None if c is None else {"engine_id": c.engine_id, "host": c.host,
                                                     "port": c.port, "tp_size": c.tp_size}}

    async def admin_list(self, request: web.Request) -> web.Response:
        refused = self._admin_refusal(request)
        if refused is not None:
            return refused
        body = {role: [self._describe(i) for i in pool.instances]
                for role, pool in self.pools.items()}
        if self.discovery is not None:
            body["discovery"] = {"etcd": self.discovery.where.base + self.discovery.where.prefix,
                                 "connected": self.discovery.connected,
                                 "revision": self.discovery.revision}
        return web.json_response(body)

    async def admin_add(self, request: web.Request) -> web.Response:
        refused = self._admin_refusal(request)
        if refused is not None:
            return refused
        try:
            data = json.loads(await request.read())
            if not isinstance(data, dict):
                raise ConfigError("expected a JSON object with role, url, name (and connector)")
            role, state = data.pop("role", None), data.pop("state", "serving")
            if role not in self.pools:
                raise ConfigError(f"role: expected prefill or decode, found {role!r}")
            if state not in STATES:
                raise ConfigError(f"state: expected one of {STATES}, found {state!r}")
            config = instance_from_dict(data, "instance", role)
        except (ValueError, ConfigError) as e:
            return error_response(400, str(e), "invalid_request_error")
        existing = self.pools[role].find(config.name)
        if existing is not None and existing.source == "etcd":
            return error_response(409, f"{role} instance {config.name} is registered in etcd; "
                                  "change it there", "invalid_request_error")
        inst = self.pools[role].add(config, "admin" if existing is None else existing.source,
                                    state)
        return web.json_response(self._describe(inst), status=200 if existing else 201)

    async def admin_drain(self, request: web.Request) -> web.Response:
        return self._admin_change(request, Pool.drain)

    async def admin_remove(self, request: web.Request) -> web.Response:
        return self._admin_change(request, Pool.remove)

    def _admin_change(self, request: web.Request,
                      change: Callable[[Pool, str], Optional[Instance]]) -> web.Response:
        """change(pool, name) on the instance the path names; 404 when there is none."""
        refused = self._admin_refusal(request)
        if refused is not None:
            return refused
        pool, bad = self._pool_of(request)
        if bad is not None:
            return bad
        inst = change(pool, request.match_info["name"])
        if inst is None:
            return error_response(404, f"no {pool.role} instance "
                                  f"{request.match_info['name']!r}", "invalid_request_error")
        return web.json_response(self._describe(inst))


def _auth(request: web.Request) -> dict[str, str]:
    value = request.headers.get("Authorization")
    return {"Authorization": value} if value else {}


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own errors (an unknown path, a method a path does not take, a body past the
    cap) answered in the OpenAI API's shape, as the proxy's other errors are."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        what = {404: f"no route {request.method} {request.path}; the proxy serves POST "
                     "/v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health "
                     "and GET /metrics",
                405: f"{request.path} does not take {request.method}",
                413: f"the request body is larger than the proxy's cap "
                     f"({request.app['proxy'].config.max_request_mib} MiB, --max-request-mib)"}
        response = error_response(e.status, what.get(e.status, e.reason), "invalid_request_error")
        if e.status == 405 and "Allow" in e.headers:
            response.headers["Allow"] = e.headers["Allow"]
        return response


def build_app(config: ProxyConfig) -> web.Application:
    proxy = Proxy(config)
    app = web.Application(client_max_size=config.max_request_mib << 20,
                          middlewares=[json_errors])
    app["proxy"] = proxy
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat_completions)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/metrics", proxy.metrics_text)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/admin/instances", proxy.admin_list)
    app.router.add_post("/admin/instances", proxy.admin_add)
    app.router.add_post("/admin/instances/{role}/{name}/drain", proxy.admin_drain)
    app.router.add_delete("/admin/instances/{role}/{name}", proxy.admin_remove)
    return app
