"""The kvferry-proxy command line: flags and a configuration file (config.py), then serve until
SIGINT or SIGTERM. Prints ``READY http://HOST:PORT`` once it listens (``--port 0`` takes a free
port)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Optional

from .config import MODES, ConfigError, ProxyConfig, from_sources, read_file

DEFAULTS = ProxyConfig()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvferry-proxy",
        description="OpenAI-compatible proxy for disaggregated prefill/decode serving with "
                    "kvferry: each request goes to a prefill instance and then (or, layer-wise, "
                    "at the same time) to a decode instance, least outstanding first.")
    add = p.add_argument
    add("--config", metavar="FILE", help="settings file (JSON, or .toml); flags override it")
    add("--prefill", action="append", metavar="SPEC",
        help="a prefill instance: URL[,name=N][,engine_id=E,kv_host=H,kv_port=P,tp_size=T] "
             "(the connector keys for layer-wise legs); repeat for each")
    add("--decode", action="append", metavar="SPEC", help="a decode instance: URL[,name=N]; "
        "repeat for each")
    add("--host", help=f"address to listen on (default {DEFAULTS.host})")
    add("--port", type=int, help=f"port to listen on, 0 for any (default {DEFAULTS.port})")
    add("--mode", choices=MODES, help=f"transfer mode (default {DEFAULTS.mode})")
    add("--layerwise-min-tokens", type=int, metavar="N",
        help="prompts shorter than this take the whole-request path in layer-wise mode "
             f"(default {DEFAULTS.layerwise_min_tokens})")
    add("--bytes-per-token", type=float, metavar="B",
        help="text prompts' token count is estimated as UTF-8 bytes / B "
             f"(default {DEFAULTS.bytes_per_token:g})")
    for name, what in (("connect_timeout_s", "TCP connect to an instance"),
                       ("prefill_timeout_s", "a prefill leg"),
                       ("first_byte_timeout_s", "a decode leg to its first byte"),
                       ("stream_idle_timeout_s", "a gap in a stream"),
                       ("decode_timeout_s", "a decode leg in all"),
                       ("client_body_timeout_s", "reading a request body"),
                       ("abandoned_grace_s", "a leg whose client left may still answer "
                        "(prefill: a release leg then frees its KV) or start its response "
                        "(decode) before it is closed"),
                       ("health_interval_s", "between health checks"),
                       ("health_timeout_s", "one health check")):
        add("--" + name.replace("_", "-"), type=float, metavar="S",
            help=f"seconds: {what} (default {getattr(DEFAULTS, name):g})")
    add("--discovery", metavar="URL",
        help="etcd://HOST:PORT/PREFIX: instances registered there join, drain and leave with no "
             "restart (docs/fleet.md); --prefill/--decode may then be left out")
    add("--max-request-mib", type=int, metavar="M",
        help="the largest request body taken, MiB; a larger one is answered 413 (default "
             f"{DEFAULTS.max_request_mib})")
    add("--health-path", help=f"health endpoint of the instances (default "
        f"{DEFAULTS.health_path})")
    add("--health-failures", type=int, metavar="N",
        help=f"failed checks in a row that take an instance out (default "
             f"{DEFAULTS.health_failures})")
    add("--log-level", choices=("debug", "info", "warning", "error"),
        help=f"default {DEFAULTS.log_level}")
    return p


def load(argv: Optional[list[str]] = None) -> ProxyConfig:
    args = vars(parser().parse_args(argv))
    path = args.pop("config")
    return from_sources(read_file(path) if path else {}, args)


async def serve(config: ProxyConfig) -> None:
    from aiohttp import web

    from .app import build_app

    runner = web.AppRunner(build_app(config), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"READY http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Optional[list[str]] = None) -> None:
    try:
        import aiohttp  # noqa: F401  (a clear message rather than an ImportError later)
        import prometheus_client  # noqa: F401
    except ImportError as e:
        sys.exit(f"kvferry-proxy: needs aiohttp and prometheus_client, but {e.name} is missing: "
                 "apt-get install python3-aiohttp python3-prometheus-client (Debian), or pip "
                 "install 'kvferry[proxy]'")
    try:
        config = load(argv)
    except ConfigError as e:
        sys.exit(f"kvferry-proxy: {e}")
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
