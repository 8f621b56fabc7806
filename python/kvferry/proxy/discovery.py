"""Membership from etcd (``--discovery etcd://HOST:PORT/PREFIX``; docs/fleet.md).

The proxy lists PREFIX/instances/ once, applies it, and watches the prefix from the next
revision: an instance whose key appears is added (serving, or draining as its value says), one
whose value says draining takes no new legs, one whose key goes (it left, or its lease expired)
is removed; legs in flight finish either way. etcd out of reach: the proxy keeps routing to the
last membership it knew, probes every ``probe_s``, and when etcd answers again lists the prefix
again and reconciles (instances that left meanwhile are removed). A value that cannot be used is
logged, naming the key, and changes nothing. Instances from flags, a file or the admin API are
never touched here.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from typing import Any, Optional

import aiohttp

from .config import ConfigError, Discovery, InstanceConfig, instance_from_dict
from .deadline import deadline
from .pool import STATES, Pool

logger = logging.getLogger("kvferry.proxy")


class EtcdError(RuntimeError):
    """etcd answered with an error, or a watch was cancelled: list again."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _prefix_end(prefix: str) -> str:
    """The range end of every key starting with `prefix` (its last byte plus one)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


def parse_value(key: str, value: str, instances_prefix: str
                ) -> tuple[str, InstanceConfig, str]:
    """(role, config, state) of one registered instance; ConfigError naming the key otherwise."""
    rest = key[len(instances_prefix):]
    role, _, name = rest.partition("/")
    if role not in ("prefill", "decode") or not name or "/" in name:
        raise ConfigError(f"etcd key {key}: expected {instances_prefix}ROLE/NAME with ROLE "
                          "prefill or decode")
    try:
        data = json.loads(value)
    except ValueError as e:
        raise ConfigError(f"etcd key {key}: expected a JSON object, found invalid JSON: {e}")
    if not isinstance(data, dict):
        raise ConfigError(f"etcd key {key}: expected a JSON object, found {value[:100]!r}")
    if data.get("role", role) != role or data.get("name", name) != name:
        raise ConfigError(f"etcd key {key}: its value names role {data.get('role')!r} and name "
                          f"{data.get('name')!r}, not the key's")
    state = data.get("state", "serving")
    if state == "drained":  # a draining instance with nothing left (kvferry.fleet): no legs
        state = "draining"
    if state not in STATES:
        raise ConfigError(f"etcd key {key}: state: expected one of {STATES}, found {state!r}")
    entry: dict[str, Any] = {"url": data.get("url"), "name": name}
    connector = data.get("connector")
    if role == "prefill" and connector is not None:
        if not isinstance(connector, dict):
            raise ConfigError(f"etcd key {key}: connector: expected an object, found "
                              f"{connector!r}")
        # The keys the proxy routes by; others (pp_size, a newer registrant's) are ignored.
        entry["connector"] = {k: v for k, v in connector.items()
                              if k in ("engine_id", "host", "port", "tp_size")}
    return role, instance_from_dict(entry, f"etcd key {key}", role), state


class EtcdDiscovery:
    def __init__(self, where: Discovery, pools: dict[str, Pool],
                 session: aiohttp.ClientSession, probe_s: float = 2.0,
                 timeout_s: float = 2.0):
        self.where, self.pools, self.session = where, pools, session
        self.probe_s, self.timeout_s = probe_s, timeout_s
        self.instances_prefix = where.prefix + "/instances/"
        self.connected = False
        self.revision = 0  # of the membership applied last

    async def run(self) -> None:
        """Lists, watches and reconciles until cancelled."""
        backoff = 0.2
        while True:
            try:
                revision = await self._list()
                if not self.connected:
                    logger.info("etcd %s%s: %d instances", self.where.base,
                                self.instances_prefix, self._count())
                self.connected, backoff = True, 0.2
                await self._watch(revision + 1)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, EtcdError,
                    ValueError) as e:
                if self.connected:
                    logger.warning("etcd %s out of reach (%s: %s): routing to the last "
                                   "membership known (%d instances) until it answers",
                                   self.where.base, type(e).__name__, e, self._count())
                self.connected = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.probe_s)

    def _count(self) -> int:
        return sum(1 for p in self.pools.values() for i in p.instances if i.source == "etcd")

    async def _post(self, path: str, body: dict) -> dict:
        async with deadline(self.timeout_s):
            async with self.session.post(self.where.base + path, json=body) as r:
                text = await r.text()
        if r.status != 200:
            raise EtcdError(f"{path}: status {r.status}: {text[:200]}")
        return json.loads(text)

    async def _list(self) -> int:
        answer = await self._post("/v3/kv/range", {"key": _b64(self.instances_prefix),
                                                   "range_end": _prefix_end(
                                                       self.instances_prefix)})
        revision = int(answer.get("header", {}).get("revision", 0))
        seen: set[tuple[str, str]] = set()
        for kv in answer.get("kvs", []):
            applied = self._apply_put(kv)
            if applied is not None:
                seen.add(applied)
        for role, pool in self.pools.items():
            for inst in list(pool.instances):
                if inst.source == "etcd" and (role, inst.name) not in seen:
                    pool.remove(inst.name)
        self.revision = revision
        return revision

    def _apply_put(self, kv: dict) -> Optional[tuple[str, str]]:
        key = base64.b64decode(kv.get("key", "")).decode(errors="replace")
        try:
            role, config, state = parse_value(
                key, base64.b64decode(kv.get("value", "")).decode(errors="replace"),
                self.instances_prefix)
        except ConfigError as e:
            logger.warning("%s; ignored", e)
            return None
        existing = self.pools[role].find(config.name)
        if existing is not None and existing.source != "etcd":
            logger.warning("etcd key %s names %s instance %s, which the proxy has from its %s "
                           "configuration; ignored", key, role, config.name, existing.source)
            return None
        self.pools[role].add(config, "etcd", state)
        return role, config.name

    def _apply_delete(self, kv: dict) -> None:
        key = base64.b64decode(kv.get("key", "")).decode(errors="replace")
        role, _, name = key[len(self.instances_prefix):].partition("/")
        pool = self.pools.get(role)
        inst = pool.find(name) if pool is not None else None
        if inst is not None and inst.source == "etcd":
            pool.remove(name)

    async def _probe(self) -> None:
        """Returns when etcd stops answering (a partition leaves the watch's stream silent)."""
        while True:
            await asyncio.sleep(self.probe_s)
            try:
                await self._post("/v3/kv/range", {"key": _b64(self.instances_prefix),
                                                  "count_only": True})
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, EtcdError,
                    ValueError) as e:
                raise EtcdError(f"probe: {type(e).__name__}: {e}") from None

    async def _watch(self, start_revision: int) -> None:
        body = {"create_request": {"key": _b64(self.instances_prefix),
                                   "range_end": _prefix_end(self.instances_prefix),
                                   "start_revision": str(start_revision)}}
        tasks = [asyncio.ensure_future(self._probe())]
        try:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s)
            async with self.session.post(self.where.base + "/v3/watch", json=body,
                                         timeout=timeout) as r:
                if r.status != 200:
                    raise EtcdError(f"/v3/watch: status {r.status}")
                tasks.append(asyncio.ensure_future(self._read_events(r)))
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # its error, if it ended with one
                raise EtcdError("the watch's stream ended")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read_events(self, response: aiohttp.ClientResponse) -> None:
        async for line in response.content:
            if not line.strip():
                continue
            message = json.loads(line)
            if "error" in message:
                raise EtcdError(f"watch: {message['error']}")
            result = message.get("result", {})
            if result.get("canceled") or result.get("compact_revision"):
                raise EtcdError(f"watch cancelled: {result.get('cancel_reason', '')} "
                                f"(compacted to {result.get('compact_revision', '-')})")
            for event in result.get("events", []):
                if event.get("type") == "DELETE":
                    self._apply_delete(event.get("kv", {}))
                else:  # PUT (the gateway leaves the type out for PUT, its zero value)
                    self._apply_put(event.get("kv", {}))
            revision = result.get("header", {}).get("revision")
            if revision is not None:
                self.revision = int(revision)
