"""The proxy's aiohttp application: the OpenAI routes, /metrics, /health, and the lifetime of its
HTTP client session, health checker and background legs."""

from __future__ import annotations

import asyncio
from typing import Optional

import aiohttp
from aiohttp import web

from . import health
from .config import ProxyConfig
from .deadline import deadline
from .forward import Forwarder, error_response
from .metrics import ProxyMetrics
from .pool import Pool

class Proxy:
    """State shared by the routes; one per application."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.prefill = Pool("prefill", config.prefill)
        self.decode = Pool("decode", config.decode)
        self.metrics = ProxyMetrics([self.prefill, self.decode])
        self.session: Optional[aiohttp.ClientSession] = None
        self.forwarder: Optional[Forwarder] = None
        self._health: Optional[asyncio.Task] = None

    async def start(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        self.forwarder = Forwarder(self.config, self.prefill, self.decode, self.metrics,
                                   self.session)
        self._health = asyncio.ensure_future(health.run(self.session,
                                                        [self.prefill, self.decode],
                                                        self.config))

    async def stop(self, app: web.Application) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
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
    return app
