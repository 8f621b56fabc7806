"""An instance's membership of a fleet in etcd (docs/fleet.md): registration under a lease kept
alive, its state (serving, draining), and leaving. Standard library only (etcd's v3 JSON gateway
over HTTP), so an engine process needs nothing more than kvferry.

Keys and values::

    PREFIX/instances/ROLE/NAME -> {"role": "prefill" | "decode", "name": NAME,
                                    "url": "http://HOST:PORT",         # its OpenAI API
                                    "connector": {"engine_id": ..., "host": ..., "port": ...,
                                                  "tp_size": ..., "pp_size": ...} | null,
                                    "state": "serving" | "draining",
                                    "version": "kvferry X.Y.Z"}

The key lives on a lease of ``ttl_s`` seconds, renewed every ``ttl_s / 3``: an instance that
dies, or is cut off from etcd for longer than the lease, leaves the fleet by itself. A
registration that finds its lease gone (etcd restarted, or the lease expired while etcd was out of
reach) grants a new one and writes its key again.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Any, Optional
from urllib.parse import urlsplit

logger = logging.getLogger("kvferry.fleet")

ROLES = ("prefill", "decode")
# drained: an instance that was draining reports that nothing is held or loading any more (the
# vLLM adapter); a proxy treats it as draining.
STATES = ("serving", "draining", "drained")


class FleetError(RuntimeError):
    """etcd refused or could not be reached; the message says which call and why."""


def parse_etcd_url(text: str) -> tuple[str, str]:
    """``etcd://HOST:PORT/PREFIX`` -> (the gateway's base URL, the prefix without a trailing
    slash; /kvferry when none is given). ValueError naming what was expected otherwise."""
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "etcd" or not parts.hostname or port is None or parts.query:
        raise ValueError(f"expected etcd://HOST:PORT/PREFIX (for example "
                         f"etcd://127.0.0.1:2379/kvferry), found {text!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"http://{host}:{port}", parts.path.rstrip("/") or "/kvferry"


def instance_key(prefix: str, role: str, name: str) -> str:
    return f"{prefix}/instances/{role}/{name}"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def call(base: str, path: str, body: dict, timeout_s: float) -> dict:
    """One JSON call to etcd's v3 gateway; FleetError when it fails."""
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        raise FleetError(f"etcd {base}{path}: status {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise FleetError(f"etcd {base}{path}: {e}") from None
    # A streamed call (lease keepalive) answers one JSON object per line; the first is ours.
    line = text.strip().split("\n", 1)[0]
    try:
        answer = json.loads(line) if line else {}
    except ValueError:
        raise FleetError(f"etcd {base}{path}: expected JSON, found {line[:200]!r}") from None
    if isinstance(answer, dict) and "error" in answer:
        raise FleetError(f"etcd {base}{path}: {answer['error']}")
    return answer.get("result", answer) if isinstance(answer, dict) else {}


def _version() -> str:
    try:
        from importlib.metadata import version
        return "kvferry " + version("kvferry")
    except Exception:  # not installed as a distribution (a build tree): say so
        return "kvferry (build tree)"


class Registration:
    """This instance's key in etcd, kept alive by a thread until close().

    ``connector`` (prefill instances that take layer-wise legs): engine_id, host, port (TP rank
    0's side channel), tp_size and pp_size. start() registers at once and raises FleetError when
    etcd cannot be reached; afterwards every failure is retried by the thread (logged once per
    outage), and the key is written again whenever the lease was lost."""

    def __init__(self, etcd: str, role: str, name: str, url: str,
                 connector: Optional[dict] = None, ttl_s: int = 10, timeout_s: float = 2.0,
                 on_drain: Optional[Any] = None):
        """`on_drain`: called (from the keepalive thread, once) when someone else set this
        instance's key to draining (`kvferry drain etcd://.../instances/ROLE/NAME`); the state is
        kept, not written back."""
        if role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, found {role!r}")
        if not name or "/" in name:
            raise ValueError(f"name: expected a non-empty name without '/', found {name!r}")
        if not isinstance(ttl_s, int) or ttl_s < 2:
            raise ValueError(f"ttl_s: expected whole seconds, at least 2, found {ttl_s!r}")
        self.base, self.prefix = parse_etcd_url(etcd)
        self.key = instance_key(self.prefix, role, name)
        self.ttl_s, self.timeout_s = ttl_s, timeout_s
        self.value: dict[str, Any] = {"role": role, "name": name, "url": url,
                                      "connector": connector, "state": "serving",
                                      "version": _version()}
        self._on_drain = on_drain
        self._lease = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._out = False  # etcd unreachable since the last failure was logged

    # ---------------------------------------------------------------- the public calls

    def start(self, wait: bool = True) -> "Registration":
        """Registers now (`wait`: FleetError when etcd cannot be reached), or, without `wait`,
        as soon as etcd answers (an engine that starts before etcd is reachable)."""
        try:
            with self._lock:
                self._register()
        except FleetError as e:
            if wait:
                raise
            logger.warning("cannot register %s in etcd yet: %s; retrying every %.1f s",
                           self.key, e, self.ttl_s / 3)
            self._out = True
        self._thread = threading.Thread(target=self._keepalive, name="kvferry-fleet",
                                        daemon=True)
        self._thread.start()
        return self

    def set_state(self, state: str) -> None:
        """serving or draining; written now (FleetError when etcd cannot be reached: the thread
        writes it when etcd is back)."""
        if state not in STATES:
            raise ValueError(f"state: expected one of {STATES}, found {state!r}")
        with self._lock:
            self.value["state"] = state
            self._put()

    def close(self, revoke: bool = True) -> None:
        """Stops the keepalive; with `revoke`, the key goes now (else when the lease ends)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s * 3)
        if revoke and self._lease:
            try:
                call(self.base, "/v3/lease/revoke", {"ID": str(self._lease)}, self.timeout_s)
            except FleetError as e:
                logger.warning("leaving the fleet: %s; the key %s goes with its lease (%d s)",
                               e, self.key, self.ttl_s)

    # ---------------------------------------------------------------- the thread

    def _register(self) -> None:
        answer = call(self.base, "/v3/lease/grant", {"TTL": self.ttl_s}, self.timeout_s)
        self._lease = int(answer["ID"])
        self._put()
        logger.info("registered %s in etcd %s (lease %d s)", self.key, self.base, self.ttl_s)

    def _put(self) -> None:
        call(self.base, "/v3/kv/put", {"key": b64(self.key), "value": b64(json.dumps(self.value)),
                                       "lease": str(self._lease)}, self.timeout_s)

    def _adopt_external_state(self) -> None:
        """A drain set on the key by someone else is this instance's state from now on."""
        answer = call(self.base, "/v3/kv/range", {"key": b64(self.key)}, self.timeout_s)
        for kv in answer.get("kvs", []):
            try:
                state = json.loads(unb64(kv.get("value", ""))).get("state")
            except (ValueError, AttributeError):
                continue
            if state == "draining" and self.value["state"] == "serving":
                self.value["state"] = "draining"
                logger.info("%s was set draining in etcd", self.key)
                if self._on_drain is not None:
                    self._on_drain()

    def _keepalive(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                with self._lock:
                    if self._lease and not self._out:
                        self._adopt_external_state()
                    answer = (call(self.base, "/v3/lease/keepalive", {"ID": str(self._lease)},
                                   self.timeout_s) if self._lease else {})
                    if int(answer.get("TTL", 0)) <= 0:  # no lease, or it is gone: register
                        if self._lease:
                            logger.warning("the lease of %s ended; registering again", self.key)
                        self._register()
                    elif self._out:
                        self._put()  # a state set while etcd was away
                if self._out:
                    logger.info("etcd %s is back; %s is registered", self.base, self.key)
                    self._out = False
            except (FleetError, KeyError, ValueError) as e:
                if not self._out:
                    logger.warning("cannot renew %s in etcd: %s; retrying every %.1f s", self.key,
                                   e, self.ttl_s / 3)
                    self._out = True
