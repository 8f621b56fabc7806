"""The proxy's configuration: a file (JSON, or TOML on Python 3.11+) and flags, never code.

A file holds every setting under the names of ProxyConfig's fields; flags override it, and
``--prefill``/``--decode`` replace the file's instance lists when given. An instance is a base
URL (``http://host:port``, no ``/v1``) with an optional name and, for prefill instances that take
layer-wise requests, its kvferry connector endpoint: the engine id, side-channel host, TP rank 0's
side-channel port (``base_port + dp_rank * tp_size``) and TP size, as configured on that vLLM
instance. On the command line::

    --prefill http://10.0.0.1:8100,name=p0,engine_id=prefill-0,kv_host=10.0.0.1,kv_port=5557
    --decode http://10.0.0.2:8200

and in a file::

    {"prefill": [{"url": "http://10.0.0.1:8100", "name": "p0",
                  "connector": {"engine_id": "prefill-0", "host": "10.0.0.1",
                                "port": 5557, "tp_size": 2}}],
     "decode": [{"url": "http://10.0.0.2:8200"}]}

Every error names the setting, what was expected and what was found.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

MODES = ("whole", "layerwise")


class ConfigError(ValueError):
    """A setting that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class Connector:
    """Where a prefill instance's kvferry connector listens (TP rank 0), for layer-wise legs."""

    engine_id: str
    host: str
    port: int
    tp_size: int


@dataclass(frozen=True)
class InstanceConfig:
    url: str  # base URL, no trailing slash, no /v1
    name: str
    connector: Optional[Connector] = None


@dataclass
class ProxyConfig:
    prefill: list[InstanceConfig] = field(default_factory=list)
    decode: list[InstanceConfig] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    # whole: the prefill leg, then the decode leg with the prefill's kv_transfer_params.
    # layerwise: both legs at once with one transfer id (prompts of layerwise_min_tokens or
    # more, and prefill instances with a connector; others take the whole-request path).
    mode: str = "whole"
    layerwise_min_tokens: int = 256
    # Text prompts are not tokenised here: their token count is estimated as UTF-8 bytes
    # divided by this (about 4 for English text with common BPE vocabularies). It only picks
    # the path (whole or layer-wise); nothing is cut.
    bytes_per_token: float = 4.0
    connect_timeout_s: float = 5.0  # TCP connect to an instance
    prefill_timeout_s: float = 300.0  # a prefill leg, request to answer
    first_byte_timeout_s: float = 300.0  # a decode leg, request to first byte (KV load included)
    stream_idle_timeout_s: float = 60.0  # between two chunks of a stream, either side
    decode_timeout_s: float = 3600.0  # a decode leg in all
    client_body_timeout_s: float = 30.0  # reading a client's request body
    # The largest request body taken, MiB (long prompts as token lists are large JSON: 64 MiB
    # is about 8 M tokens written as numbers); a larger one is answered 413.
    max_request_mib: int = 64
    # etcd://HOST:PORT/PREFIX: instances registered under PREFIX join, drain and leave at run
    # time (docs/fleet.md); the static lists above stay, and may then be empty.
    discovery: str = ""
    # A leg whose client left: a whole-request prefill may still answer in this time (its KV is
    # then read and freed by a release leg), a decode leg still start its response (the
    # instance has then taken it), before it is closed (forward.py).
    abandoned_grace_s: float = 1.0
    health_path: str = "/health"
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    health_failures: int = 2  # consecutive failed checks that take an instance out
    log_level: str = "info"

    def validate(self) -> "ProxyConfig":
        if self.discovery:
            parse_discovery(self.discovery)
        elif not self.prefill:
            raise ConfigError("prefill: expected at least one prefill instance (--prefill URL, "
                              "or --discovery etcd://...), found none")
        elif not self.decode:
            raise ConfigError("decode: expected at least one decode instance (--decode URL, "
                              "or --discovery etcd://...), found none")
        for role, instances in (("prefill", self.prefill), ("decode", self.decode)):
            names = [i.name for i in instances]
            if len(set(names)) != len(names):
                raise ConfigError(f"{role}: instance names must differ, found {names}")
        if self.mode not in MODES:
            raise ConfigError(f"mode: expected one of {MODES}, found {self.mode!r}")
        if (self.mode == "layerwise" and not self.discovery
                and not any(i.connector for i in self.prefill)):
            raise ConfigError("mode layerwise: expected the connector endpoint (engine_id, "
                              "kv_host, kv_port, tp_size) of at least one prefill instance, found "
                              "none; without them only whole-request transfers are possible")
        if not 1 <= self.port <= 65535 and self.port != 0:
            raise ConfigError(f"port: expected 0..65535, found {self.port}")
        for name in ("bytes_per_token", "connect_timeout_s", "prefill_timeout_s",
                     "first_byte_timeout_s", "stream_idle_timeout_s", "decode_timeout_s",
                     "client_body_timeout_s", "abandoned_grace_s",
                     "health_interval_s", "health_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}: expected a positive number, found {value!r}")
        for name in ("layerwise_min_tokens", "health_failures", "max_request_mib"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: expected a positive integer, found {value!r}")
        if not self.health_path.startswith("/"):
            raise ConfigError(f"health_path: expected a path starting with /, found "
                              f"{self.health_path!r}")
        return self


@dataclass(frozen=True)
class Discovery:
    """Where the membership is kept: etcd's v3 JSON gateway and a key prefix (kvferry.fleet)."""

    base: str  # http://HOST:PORT
    prefix: str  # no trailing slash


def parse_discovery(text: str) -> Discovery:
    """``etcd://HOST:PORT/PREFIX`` (PREFIX defaults to /kvferry)."""
    from ..fleet import parse_etcd_url
    try:
        return Discovery(*parse_etcd_url(text))
    except ValueError as e:
        raise ConfigError(f"discovery: {e}") from None


_SCALARS = {f.name: f for f in dataclasses.fields(ProxyConfig) if f.name not in ("prefill",
                                                                                   "decode")}


def _port(value: Any, where: str) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a port number, found {value!r}") from None
    if isinstance(value, bool) or not 1 <= port <= 65535:
        raise ConfigError(f"{where}: expected a port number in 1..65535, found {value!r}")
    return port


def _base_url(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a URL such as http://10.0.0.1:8100, found {value!r}")
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise ConfigError(f"{where}: expected a URL such as http://10.0.0.1:8100, found {value!r}")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        raise ConfigError(f"{where}: expected the instance's base URL without /v1 (the proxy adds "
                          f"/v1/completions and /v1/chat/completions), found {value!r}")
    return f"{parts.scheme}://{parts.netloc}{path}"


def _connector(value: Any, where: str) -> Connector:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected an object with engine_id, host, port and tp_size, "
                          f"found {value!r}")
    unknown = set(value) - {"engine_id", "host", "port", "tp_size"}
    missing = {"engine_id", "host", "port"} - set(value)
    if unknown or missing:
        raise ConfigError(f"{where}: expected keys engine_id, host, port (and tp_size), found "
                          f"{sorted(value)}")
    engine_id, host = value["engine_id"], value["host"]
    for key, text in (("engine_id", engine_id), ("host", host)):
        if not isinstance(text, str) or not 0 < len(text.encode()) <= 1024:
            raise ConfigError(f"{where}.{key}: expected a string of 1 to 1024 bytes, found "
                              f"{text!r}")
    tp = value.get("tp_size", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= 1024:
        raise ConfigError(f"{where}.tp_size: expected an integer in 1..1024, found {tp!r}")
    return Connector(engine_id, host, _port(value["port"], f"{where}.port"), tp)


def instance_from_dict(value: Any, where: str, role: str) -> InstanceConfig:
    if isinstance(value, str):
        value = {"url": value}
    if not isinstance(value, dict) or "url" not in value:
        raise ConfigError(f"{where}: expected an object with a url (and name, connector), found "
                          f"{value!r}")
    allowed = {"url", "name", "connector"} if role == "prefill" else {"url", "name"}
    unknown = set(value) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; expected {sorted(allowed)}")
    url = _base_url(value["url"], f"{where}.url")
    name = value.get("name") or urlsplit(url).netloc
    if not isinstance(name, str):
        raise ConfigError(f"{where}.name: expected a string, found {name!r}")
    connector = None
    if value.get("connector") is not None:
        connector = _connector(value["connector"], f"{where}.connector")
    return InstanceConfig(url, name, connector)


def instance_from_flag(text: str, role: str) -> InstanceConfig:
    """``URL[,name=N][,engine_id=E,kv_host=H,kv_port=P,tp_size=N]`` (the connector keys for
    prefill instances only, all of engine_id, kv_host and kv_port or none)."""
    where = f"--{role} {text!r}"
    url, *pairs = [p.strip() for p in text.split(",")]
    fields: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"{where}: expected key=value after the URL, found {pair!r}")
        fields[key] = value
    allowed = {"name", "engine_id", "kv_host", "kv_port", "tp_size"} if role == "prefill" else {
        "name"}
    unknown = set(fields) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; expected {sorted(allowed)}")
    out: dict[str, Any] = {"url": url}
    if "name" in fields:
        out["name"] = fields["name"]
    connector_keys = {"engine_id", "kv_host", "kv_port"}
    given = connector_keys & set(fields)
    if given and given != connector_keys:
        raise ConfigError(f"{where}: a connector endpoint needs engine_id, kv_host and kv_port "
                          f"together, found only {sorted(given)}")
    if given:
        tp = fields.get("tp_size", "1")
        if not tp.isdigit():
            raise ConfigError(f"{where}: tp_size: expected an integer, found {tp!r}")
        out["connector"] = {"engine_id": fields["engine_id"], "host": fields["kv_host"],
                            "port": fields["kv_port"], "tp_size": int(tp)}
    elif "tp_size" in fields:
        raise ConfigError(f"{where}: tp_size belongs to a connector endpoint (engine_id, kv_host, "
                          "kv_port), which is missing")
    return instance_from_dict(out, where, role)


def read_file(path: str) -> dict:
    """The settings of a JSON file, or of a TOML file (.toml, Python 3.11+)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
    try:
        if p.suffix == ".toml":
            try:
                import tomllib
            except ImportError:
                raise ConfigError(f"--config {path}: TOML needs Python 3.11 or newer; use a "
                                  ".json file") from None
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ValueError as e:  # json.JSONDecodeError and tomllib.TOMLDecodeError
        raise ConfigError(f"--config {path}: not valid {p.suffix.lstrip('.') or 'JSON'}: "
                          f"{e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected an object of settings, found "
                          f"{type(data).__name__}")
    return data


def from_sources(file_settings: dict, flag_settings: dict) -> ProxyConfig:
    """The configuration of a file's settings overridden by flags (both keyed by field names;
    flags' prefill/decode are lists of --prefill/--decode texts)."""
    known = set(_SCALARS) | {"prefill", "decode"}
    unknown = set(file_settings) - known
    if unknown:
        raise ConfigError(f"config file: unknown settings {sorted(unknown)}; expected some of "
                          f"{sorted(known)}")
    config = ProxyConfig()
    for name, value in file_settings.items():
        if name in ("prefill", "decode"):
            if not isinstance(value, list):
                raise ConfigError(f"{name}: expected a list of instances, found {value!r}")
            setattr(config, name, [instance_from_dict(v, f"{name}[{i}]", name)
                                   for i, v in enumerate(value)])
        else:
            setattr(config, name, _typed(name, value))
    for name, value in flag_settings.items():
        if value is None:
            continue
        if name in ("prefill", "decode"):
            if value:
                setattr(config, name, [instance_from_flag(v, name) for v in value])
        else:
            setattr(config, name, _typed(name, value))
    return config.validate()


def _typed(name: str, value: Any) -> Any:
    kind = type(_SCALARS[name].default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(f"{name}: expected a {kind.__name__}, found {value!r}")
    return value
