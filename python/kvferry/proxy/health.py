"""Health checks: every instance's health endpoint (vLLM's GET /health) at an interval.

An instance is taken out after ``health_failures`` consecutive failed checks (a connection
error, a timeout, or a status other than 200) and put back after one good check. A leg whose
connection fails takes its instance out at once (forward.py); the checks put it back.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from .config import ProxyConfig
from .deadline import deadline
from .pool import Instance, Pool

logger = logging.getLogger("kvferry.proxy")


async def check(session: aiohttp.ClientSession, instance: Instance, config: ProxyConfig) -> str:
    """"" when the instance answered its health check with 200, else why not."""
    try:
        async with deadline(config.health_timeout_s):
            async with session.get(instance.url + config.health_path) as response:
                await response.read()
                return "" if response.status == 200 else f"health check status {response.status}"
    except asyncio.TimeoutError:
        return f"no health answer within {config.health_timeout_s} s"
    except (aiohttp.ClientError, OSError) as e:
        return f"health check failed: {type(e).__name__}: {e}"


async def check_all(session: aiohttp.ClientSession, pools: list[Pool], config: ProxyConfig
                    ) -> None:
    instances = [(pool, inst) for pool in pools for inst in pool.instances]
    results = await asyncio.gather(*(check(session, inst, config) for _, inst in instances))
    for (pool, inst), why in zip(instances, results):
        if not why:
            pool.mark_up(inst)
            continue
        inst.failed_checks += 1
        if inst.failed_checks >= config.health_failures:
            pool.mark_down(inst, why)


async def run(session: aiohttp.ClientSession, pools: list[Pool], config: ProxyConfig) -> None:
    """Checks every instance until cancelled."""
    while True:
        await check_all(session, pools, config)
        await asyncio.sleep(config.health_interval_s)
