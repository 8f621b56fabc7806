"""kvferry as SGLang's PD-disaggregation transfer backend (docs/sglang.md).

SGLang's prefill and decode servers each get one request from the router with the same
``bootstrap_room``; their schedulers drive a sender (prefill) and a receiver (decode) through
``KVPoll``'s states. Here the decode side pulls, read-only: its receiver subscribes to the
request's layer-wise transfer (docs/layerwise.md) under the transfer id ``sglang-<room>``, and
each ``send`` of a prefill chunk announces that chunk's pages, which the decode side reads while
the prefill computes the next chunk. After the last chunk the pages stay held until every decode
rank that reads them has confirmed, or until the hold's lease ends; only then does the sender
report a terminal state, so SGLang does not free a page a reader may still read (sglang#24527's
defect), except where SGLang fails a request on every rank at once (docs/sglang.md, "Known
limits"). The first output token and the other aux rows SGLang moves
beside the KV are kept by each prefill rank and pulled by the decode rank after its KV has landed.

The interface followed is SGLang's ``sglang/srt/disaggregation/base/conn.py`` at
alphabetc1/sglang d6a0fe41 (the dynamic-backend fork: ``init(kv_indices, aux_index,
state_indices)``, receivers built with ``prefill_dp_rank``), with upstream 9e9fde14's receiver
split (``init(prefill_dp_rank)`` then ``send_metadata``) accepted too. Load it with::

    --disaggregation-transfer-backend dynamic --disaggregation-transfer-backend-extra-config
    '{"backend_name": "kvferry", "module_path": "kvferry.sglang", "class_name": "KvferryProvider",
      ...kvferry settings (docs/sglang.md)...}'

Nothing here raises into SGLang's event loop outside the documented failure path: a failure makes
``poll()`` return ``KVPoll.Failed`` and ``failure_exception()`` raise it with its reason.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import http.server
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Optional

from . import _kvferry

logger = logging.getLogger("kvferry.sglang")

# SGLang's KVPoll (base/conn.py): plain ints, ordered, since schedulers MIN-all-reduce them.
FAILED, BOOTSTRAPPING, WAITING_FOR_INPUT, TRANSFERRING, SUCCESS = 0, 1, 2, 3, 4

_MAX_BODY = 1 << 20  # bootstrap and aux HTTP bodies
_HTTP_TIMEOUT_S = 5.0


class KVTransferError(RuntimeError):
    """What failure_exception raises: the room and why ("KVTransferError(bootstrap_room=R):
    reason", the shape of SGLang's own backends' errors)."""

    def __init__(self, room: Any, reason: str):
        super().__init__(f"KVTransferError(bootstrap_room={room}): {reason}")
        self.bootstrap_room, self.reason = room, reason


def transfer_id(room: Any) -> str:
    """kvferry's transfer (and request) id of SGLang's bootstrap room."""
    return f"sglang-{int(room)}"


def _attention_dp_rank(args: Any, cfg: dict, attn_tp_size: int, mode: str) -> int:
    """This rank's attention-DP rank under DP attention: SGLang's own
    (layers/dp_attention.get_attention_dp_rank, as CommonKVManager reads it) where importable;
    else, on prefill, from engine_rank (the full TP rank there); else "attn_dp_rank" in the extra
    config. A decode rank's engine_rank is tp_rank % attn_tp_size, which cannot tell it."""
    try:
        from sglang.srt.layers.dp_attention import get_attention_dp_rank  # type: ignore
        return int(get_attention_dp_rank())
    except Exception:  # noqa: BLE001 - not inside SGLang, or not initialised
        pass
    if "attn_dp_rank" in cfg:
        return int(cfg["attn_dp_rank"])
    if mode == "prefill":
        return int(args.engine_rank) // attn_tp_size
    raise _kvferry.InvalidArgumentError(
        "kvferry.sglang: DP attention on a decode server, but SGLang's attention-DP rank is not "
        "available to this process; set \"attn_dp_rank\" in the extra config")


def _mode(disaggregation_mode: Any) -> str:
    value = str(getattr(disaggregation_mode, "value", disaggregation_mode)).lower()
    if value not in ("prefill", "decode"):
        raise _kvferry.InvalidArgumentError(
            f"kvferry.sglang: disaggregation mode must be prefill or decode, found {value!r}")
    return value


def extra_config(server_args: Any) -> dict:
    """The JSON of --disaggregation-transfer-backend-extra-config (the dynamic backend's own keys
    and kvferry's settings side by side); {} when absent."""
    raw = getattr(server_args, "disaggregation_transfer_backend_extra_config", None)
    if not raw:
        return {}
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        raise _kvferry.InvalidArgumentError(
            f"--disaggregation-transfer-backend-extra-config is not JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise _kvferry.InvalidArgumentError(
            "--disaggregation-transfer-backend-extra-config must be a JSON object")
    return cfg


# Straight to the peer: an http_proxy in the engine's environment must not carry kvferry's
# bootstrap and aux requests, which go to the cluster's own addresses.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http(method: str, url: str, body: Optional[dict] = None,
          timeout: float = _HTTP_TIMEOUT_S) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    with _OPENER.open(req, timeout=timeout) as r:
        out = r.read(_MAX_BODY + 1)
    if len(out) > _MAX_BODY:
        raise ValueError(f"{url}: answer longer than {_MAX_BODY} bytes")
    return out


# ----------------------------------------------------------------------------- bootstrap server

class _Quiet(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # noqa: D401 - http.server's hook
        logger.debug("%s: " + fmt, self.address_string(), *args)

    def _answer(self, code: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, message: str) -> None:
        self._answer(code, json.dumps({"error": message}).encode())


class KvferryBootstrapServer:
    """SGLang's bootstrap server for kvferry (one per prefill server, started by SGLang's
    tokenizer manager with ``(host, port)`` = its --host and --disaggregation-bootstrap-port).
    Each prefill rank registers where its kvferry worker listens (``PUT /route``, the routes of
    SGLang's common/conn.py CommonKVBootstrapServer); a decode rank reads the whole table once per
    prefill server (``GET /route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1``, which
    also answers SGLang's parallel-info fields) and then talks to the workers directly."""

    def __init__(self, host: str, port: int):
        self._lock = threading.Lock()
        self._ranks: dict[tuple[int, int, int], dict] = {}  # (dp group, tp rank, pp rank)
        self._sizes: Optional[tuple[int, int, int]] = None  # attn tp, dp, pp
        server = self

        class Handler(_Quiet):
            def do_PUT(self) -> None:  # noqa: N802 - http.server's names
                if urllib.parse.urlsplit(self.path).path != "/route":
                    return self._error(404, f"no route {self.path}")
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= _MAX_BODY:
                    return self._error(413, f"a registration is 1 to {_MAX_BODY} bytes")
                try:
                    entry = json.loads(self.rfile.read(length))
                    code, message = server._register(entry)
                except (ValueError, TypeError, KeyError) as e:
                    code, message = 400, f"bad registration: {e}"
                if code != 200:
                    return self._error(code, message)
                self._answer(200, b'{"ok": true}')

            def do_GET(self) -> None:  # noqa: N802
                url = urllib.parse.urlsplit(self.path)
                if url.path == "/health":
                    return self._answer(200, b"OK", "text/plain")
                if url.path != "/route":
                    return self._error(404, f"no route {url.path}")
                q = urllib.parse.parse_qs(url.query)
                try:
                    keys = [int(q[k][0]) for k in ("engine_rank", "target_dp_group",
                                                   "target_pp_rank")]
                except (KeyError, ValueError):
                    return self._error(400, "engine_rank, target_dp_group and target_pp_rank "
                                            "are required integers")
                code, body = server._route(*keys)
                self._answer(code, json.dumps(body).encode())

            def do_POST(self) -> None:  # noqa: N802
                self._error(405, "PUT /route or GET /route, /health")

        self._httpd = http.server.ThreadingHTTPServer((host, int(port)), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="kvferry-sglang-bootstrap")
        self._thread.start()

    def _register(self, e: dict) -> tuple[int, str]:
        sizes = (int(e["attn_tp_size"]), int(e["attn_dp_size"]) if int(
            e.get("system_dp_size", 1)) == 1 else int(e["system_dp_size"]), int(e["pp_size"]))
        dp_group = int(e["attn_dp_rank"]) if int(e.get("system_dp_size", 1)) == 1 else int(
            e["system_dp_rank"])
        key = (dp_group, int(e["attn_tp_rank"]), int(e["pp_rank"]))
        if not isinstance(e.get("kvferry"), dict):
            return 400, "the registration carries no kvferry section (a rank of another backend?)"
        if not all(0 <= k < s for k, s in zip(key, (sizes[1], sizes[0], sizes[2]))):
            return 400, f"rank {key} is outside the sizes {sizes} it names"
        with self._lock:
            if self._sizes is not None and self._sizes != sizes:
                return 409, (f"this prefill server's ranks registered (attn tp, dp, pp) "
                             f"{self._sizes}; this one says {sizes}")
            self._sizes = sizes
            self._ranks[key] = dict(e)
        return 200, ""

    def _route(self, tp: int, dp: int, pp: int) -> tuple[int, dict]:
        with self._lock:
            if self._sizes is None:
                return 503, {"error": "no prefill rank has registered yet"}
            if (tp, dp, pp) == (-1, -1, -1):
                tp_size, dp_size, pp_size = self._sizes
                return 200, {"prefill_attn_tp_size": tp_size, "prefill_dp_size": dp_size,
                             "prefill_pp_size": pp_size,
                             "ranks": [dict(v, dp_group=k[0]) for k, v in self._ranks.items()]}
            e = self._ranks.get((dp, tp, pp))
        if e is None:
            return 404, {"error": f"no rank registered as dp {dp}, tp {tp}, pp {pp}"}
        return 200, {"rank_ip": e["rank_ip"], "rank_port": e["rank_port"]}

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


# ----------------------------------------------------------------------------- manager

class _Aux:
    """A prefill rank's aux rows of finished requests, kept until read or their time ends, and
    served read-only over HTTP (``GET /aux/<room>``): the decode rank pulls them after its KV."""

    def __init__(self, host: str, keep_s: float, max_rows: int = 8192):
        self._rows: dict[int, tuple[bytes, float]] = {}
        self._lock = threading.Lock()
        self._keep_s, self._max = keep_s, max_rows
        aux = self

        class Handler(_Quiet):
            def do_GET(self) -> None:  # noqa: N802
                parts = urllib.parse.urlsplit(self.path).path.split("/")
                if len(parts) != 3 or parts[1] != "aux" or not parts[2].isdigit():
                    return self._error(404, "GET /aux/<bootstrap room>")
                data = aux.get(int(parts[2]))
                if data is None:
                    return self._error(404, f"no aux rows for room {parts[2]} (not finished "
                                            "here, or kept past their time)")
                self._answer(200, data, "application/octet-stream")

        self._httpd = http.server.ThreadingHTTPServer((host, 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, daemon=True,
                         name="kvferry-sglang-aux").start()

    def put(self, room: int, data: bytes) -> None:
        now = time.monotonic()
        with self._lock:
            for r in [r for r, (_, t) in self._rows.items() if t < now]:
                del self._rows[r]
            while len(self._rows) >= self._max:
                del self._rows[next(iter(self._rows))]
            self._rows[room] = (data, now + self._keep_s)

    def read_soon(self, room: int, grace_s: float = 30.0) -> None:
        """The request's hold ended (its readers confirmed): its rows go after a short grace,
        which covers a reader pulling them just after its confirmation."""
        with self._lock:
            entry = self._rows.get(room)
            if entry is not None:
                self._rows[room] = (entry[0], min(entry[1], time.monotonic() + grace_s))

    def get(self, room: int) -> Optional[bytes]:
        with self._lock:
            entry = self._rows.get(room)
        return entry[0] if entry is not None and entry[1] >= time.monotonic() else None

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class KvferryKVManager:
    """One per SGLang scheduler process (one attention TP rank of one PP stage of one DP group):
    kvferry's scheduler and worker for that rank, its KV pools registered with the worker.
    Called positionally by SGLang: ``(kv_args, DisaggregationMode, server_args, is_mla)``."""

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: Optional[bool] = False):
        self.kv_args, self.server_args = args, server_args
        self.mode = _mode(disaggregation_mode)
        self.is_mla = bool(is_mla_backend)
        cfg = self.cfg = extra_config(server_args)
        tp = int(getattr(server_args, "tp_size", 1) or 1)
        dp = int(getattr(server_args, "dp_size", 1) or 1)
        dp_attention = bool(getattr(server_args, "enable_dp_attention", False))
        self.attn_tp_size = tp // dp if dp_attention else tp
        self.attn_tp_rank = int(args.engine_rank) % self.attn_tp_size
        self.system_dp_size = 1 if dp_attention else dp
        self.system_dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        self.attn_dp_size = dp if dp_attention else 1
        self.attn_dp_rank = _attention_dp_rank(args, cfg, self.attn_tp_size, self.mode) if (
            dp_attention) else 0
        self.dp_group = self.attn_dp_rank if self.system_dp_size == 1 else self.system_dp_rank
        self.dp_size = self.attn_dp_size if self.system_dp_size == 1 else self.system_dp_size
        self.pp_size = int(getattr(server_args, "pp_size", 1) or 1)
        self.pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        self.page_size = int(getattr(server_args, "page_size", 1) or 1)
        self.host = str(cfg.get("host") or getattr(server_args, "host", None) or "127.0.0.1")
        if self.host in ("0.0.0.0", "::"):
            raise _kvferry.InvalidArgumentError(
                f"kvferry.sglang: --host {self.host} is a wildcard; kvferry tells peers where its "
                "workers listen, so set \"host\" in the extra config to this machine's address")
        bport = int(getattr(server_args, "disaggregation_bootstrap_port", 8998) or 8998)
        # Rule 7's ports: base + (dp group * pp + pp rank) * attn tp + tp rank.
        default_base = bport + 1 if self.mode == "prefill" else bport + 1 + 512
        self.base_port = int(cfg.get("base_port", default_base))
        port_rank = (self.dp_group * self.pp_size + self.pp_rank) * self.attn_tp_size + (
            self.attn_tp_rank)
        self.port = self.base_port + port_rank
        self.memory = str(cfg.get("memory", f"cuda:{int(getattr(args, 'gpu_id', 0) or 0)}"))
        self.hold_lease_ms = int(cfg.get("hold_lease_ms", 120000))
        self.timeout_s = float(cfg.get("waiting_timeout_s", 300))
        name = f"{getattr(server_args, 'host', self.host)}:{getattr(server_args, 'port', 0)}"
        self.engine_id = str(cfg.get("engine_id") or f"sglang-{self.mode}-{name}")
        # A Mamba / linear-attention model's per-request state (SGLang's state_type "mamba":
        # each state tensor one request's state per slot, state_indices one slot): kvferry state
        # groups, one per distinct slot size, read once the last chunk is announced.
        self.state_type = str(getattr(args, "state_type", "none") or "none")
        ptrs = [int(p) for p in (getattr(args, "state_data_ptrs", None) or [])]
        if ptrs and self.state_type != "mamba":
            raise _kvferry.NotSupportedError(
                f"kvferry.sglang: this model's pool carries {self.state_type!r} state buffers "
                "beside its KV; kvferry's SGLang backend moves Mamba state (state_type "
                "'mamba'), not SWA or NSA state yet")
        self.state_groups: list[tuple[int, list[int], int]] = []  # (slot bytes, ptrs, slots)
        for ptr, length, item in zip(ptrs, args.state_data_lens, args.state_item_lens):
            group = next((g for g in self.state_groups if g[0] == int(item)), None)
            if group is None:
                group = (int(item), [], int(length) // int(item))
                self.state_groups.append(group)
            group[1].append(ptr)
        self._lock = threading.Lock()
        self._finished_sending: set[str] = set()
        self._finished_recving: dict[str, str] = {}  # rid -> error ("" when done)
        # Requests whose end a sender or receiver still waits for: only theirs are kept from
        # get_finished, so a request SGLang dropped (failed on another rank) leaves nothing.
        self._live: set[str] = set()
        self._load_errors: dict[str, str] = {}
        # Bootstrap lookups (which retry while a prefill server starts) and aux pulls (one short
        # GET each) on pools of their own, so slow lookups never hold back a pull.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="kvferry-sglang-bootstrap")
        self._aux_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="kvferry-sglang-aux")
        self._prefills: dict[str, concurrent.futures.Future] = {}  # decode: bootstrap addr
        self._registered = False
        self._register_lock = threading.Lock()  # the decode side registers its caches lazily
        self.first_layer = 0
        self._closed = False
        self._aux: Optional[_Aux] = None
        self.scheduler = _kvferry.Scheduler(
            self.mode, self.engine_id, self.host, self.base_port, self.dp_group,
            self.attn_tp_size, self.hold_lease_ms, self.pp_size)
        self.worker = _kvferry.Worker(
            self.mode, self.engine_id, tp_size=self.attn_tp_size, tp_rank=self.attn_tp_rank,
            dp_rank=self.dp_group, host=self.host, base_port=self.base_port,
            secret=str(cfg.get("secret", "")), transport=str(cfg.get("transport", "auto")),
            transfer_timeout_ms=int(self.timeout_s * 1000), hold_lease_ms=self.hold_lease_ms,
            failure_policy="fail",
            transport_options={str(k): str(v) for k, v in
                               (cfg.get("transport_options") or {}).items()},
            pp_size=self.pp_size, pp_rank=self.pp_rank,
            layerwise_start_timeout_ms=int(self.timeout_s * 1000),
            layerwise_progress_timeout_ms=int(float(cfg.get("progress_timeout_s", 30)) * 1000))
        self.num_layers = self._layers()
        if self.mode == "prefill":
            heads = int(getattr(args, "kv_head_num", 1) or 1)
            self.model_heads = 1 if self.is_mla else int(cfg.get("kv_heads",
                                                                  heads * self.attn_tp_size))
            self._register_caches(self.model_heads)
            self._aux = _Aux(self.host, self.hold_lease_ms / 1000.0)
            self._bootstrap_host = str(getattr(server_args, "dist_init_addr", None) or "").split(
                ":")[0] or str(getattr(server_args, "host", "127.0.0.1"))
            if self._bootstrap_host in ("0.0.0.0", "::"):
                self._bootstrap_host = "127.0.0.1"
            self._bootstrap_port = bport
            self._registration = self._pool.submit(self._register_to_bootstrap)

    # -- geometry

    def _layers(self) -> int:
        n = len(self.kv_args.kv_data_ptrs)
        if self.is_mla:
            return n
        if n % 2:
            raise _kvferry.InvalidArgumentError(
                f"kvferry.sglang: an MHA pool lists K then V of each layer, found {n} buffers")
        return n // 2

    def _row_bytes(self) -> int:
        item = int(self.kv_args.kv_item_lens[0])
        if item % self.page_size:
            raise _kvferry.InvalidArgumentError(
                f"kvferry.sglang: a page of {item} bytes is not {self.page_size} equal rows")
        return item // self.page_size

    def geometry(self) -> dict:
        """What a decode rank must match: the pool's per-token row, its page and the model-wide
        head count the prefill side declares (kv_head_num x attention TP unless "kv_heads")."""
        return {"mla": self.is_mla, "row_bytes": self._row_bytes(), "page_size": self.page_size,
                "layers": self.num_layers, "heads": self.model_heads,
                "aux_item_lens": [int(x) for x in self.kv_args.aux_item_lens],
                "state": [[g[0], len(g[1])] for g in self.state_groups],
                "first_layer": int(getattr(self.kv_args, "prefill_start_layer", 0) or 0),
                "tp": self.attn_tp_size}

    @property
    def total_layers(self) -> int:
        """kvferry's layer index runs over the groups' layers, group after group."""
        return self.num_layers + sum(len(g[1]) for g in self.state_groups)

    def group_ids(self, pages: list[int], state: Optional[int], complete: bool) -> list[list[int]]:
        """Every group's block ids: the pages, and per state group the state slot in the last
        page's position once the prompt is complete (-1, no block, before)."""
        tail = [-1] * max(len(pages) - 1, 0)
        slot = [int(state)] if complete and state is not None else [-1]
        return [list(pages)] + [tail + slot for _ in self.state_groups]

    def _register_caches(self, model_heads: int) -> None:
        a = self.kv_args
        lens, items = list(a.kv_data_lens), list(a.kv_item_lens)
        if len(set(items)) != 1:
            raise _kvferry.NotSupportedError(
                f"kvferry.sglang: KV buffers with pages of different sizes {sorted(set(items))} "
                "(draft-model buffers beside the target's?) are not supported")
        row = self._row_bytes()
        blocks = int(lens[0]) // int(items[0])
        local = 1 if self.is_mla else max(model_heads // self.attn_tp_size, 1)
        if row % local:
            raise _kvferry.InvalidArgumentError(
                f"kvferry.sglang: a token's row of {row} bytes is not {local} heads")
        first = int(getattr(a, "prefill_start_layer", 0) or 0) if self.mode == "prefill" else (
            self.first_layer)
        L = self.num_layers
        if self.is_mla:
            spec = _kvferry.CacheSpec.create(
                "mla_fused", L, [("kv", 1, row)], blocks, self.page_size, dtype="int8",
                tp_size=self.attn_tp_size, tp_rank=self.attn_tp_rank,
                # The row's split is opaque here (bytes); both sides declare it alike.
                fields=[int(x) for x in self.cfg.get("mla_fields", [row - 1, 1])],
                first_layer=first)
            bases = [[int(p)] for p in a.kv_data_ptrs]
        else:
            hd = row // local
            spec = _kvferry.CacheSpec.create(
                "mha", L, [("k", model_heads, hd), ("v", model_heads, hd)], blocks,
                self.page_size, dtype="int8", tp_size=self.attn_tp_size,
                tp_rank=self.attn_tp_rank, first_layer=first)
            ptrs = [int(p) for p in a.kv_data_ptrs]
            bases = [[ptrs[i], ptrs[L + i]] for i in range(L)]
        if not self.state_groups:
            self.worker.register_kv_caches(spec, bases, self.memory)
        else:
            specs, all_bases = [spec], [bases]
            for item, gptrs, slots in self.state_groups:
                specs.append(_kvferry.CacheSpec.create(
                    "state", len(gptrs), [("state", self.attn_tp_size, item, "int8")], slots,
                    self.page_size, dtype="int8", tp_size=self.attn_tp_size,
                    tp_rank=self.attn_tp_rank, first_layer=first))
                all_bases.append([[p] for p in gptrs])
            self.worker.register_kv_cache_groups(specs, all_bases, self.memory)
        self._registered = True

    # -- prefill: where this rank is

    def _register_to_bootstrap(self) -> None:
        """PUT /route at the prefill server's bootstrap server, retried until it answers (the
        tokenizer manager may start it after this scheduler) or 60 s have passed."""
        entry = {"role": "Prefill", "attn_tp_size": self.attn_tp_size,
                 "attn_tp_rank": self.attn_tp_rank, "attn_dp_size": self.attn_dp_size,
                 "attn_dp_rank": self.attn_dp_rank, "pp_size": self.pp_size,
                 "pp_rank": self.pp_rank, "system_dp_size": self.system_dp_size,
                 "system_dp_rank": self.system_dp_rank, "rank_ip": self.host,
                 "rank_port": self.port,
                 "kvferry": dict(self.geometry(), engine_id=self.engine_id,
                                 base_port=self.base_port, aux_port=self._aux.port)}
        url = f"http://{self._bootstrap_host}:{self._bootstrap_port}/route"
        deadline = time.monotonic() + 60
        while True:
            try:
                _http("PUT", url, entry)
                return
            except urllib.error.HTTPError as e:
                raise RuntimeError(f"kvferry.sglang: {url} refused this rank: "
                                   f"{e.read(4096).decode(errors='replace')}") from e
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvferry.sglang: no bootstrap server at {url} after "
                                       f"60 s: {e}") from e
                time.sleep(0.2)

    def keep_aux(self, room: int, aux_index: int) -> None:
        """Copies the request's aux rows (SGLang's MetadataBuffers, host memory) for its reader."""
        a = self.kv_args
        data = b"".join(ctypes.string_at(int(p) + int(n) * int(aux_index), int(n))
                        for p, n in zip(a.aux_data_ptrs, a.aux_item_lens))
        self._aux.put(int(room), data)

    # -- decode: where the prefill ranks are

    def prefill_info(self, bootstrap_addr: str) -> concurrent.futures.Future:
        """The table of a prefill server's ranks (resolved once, on a thread; a failure is not
        cached, so the next request asks again)."""
        with self._lock:
            fut = self._prefills.get(bootstrap_addr)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._pool.submit(self._resolve, bootstrap_addr)
                self._prefills[bootstrap_addr] = fut
            return fut

    def _resolve(self, addr: str) -> dict:
        url = f"http://{addr}/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1"
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                info = json.loads(_http("GET", url))
                sizes = (int(info["prefill_attn_tp_size"]) * int(info["prefill_dp_size"])
                         * int(info["prefill_pp_size"]))
                if len(info.get("ranks") or []) >= sizes or time.monotonic() > deadline:
                    break  # every rank registered (or the table as it is, refused below)
            except urllib.error.HTTPError as e:
                if e.code != 503 or time.monotonic() > deadline:
                    raise RuntimeError(f"bootstrap server {addr}: HTTP {e.code}: "
                                       f"{e.read(4096).decode(errors='replace')}") from e
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise RuntimeError(f"no bootstrap server answers at {addr}: {e}") from e
            if self._closed:
                raise RuntimeError("the manager was closed")
            time.sleep(0.2)
            continue
        return self._table(addr, info)

    def _table(self, addr: str, info: dict) -> dict:
        ranks = info.get("ranks") or []
        tp, dp, pp = (int(info["prefill_attn_tp_size"]), int(info["prefill_dp_size"]),
                      int(info["prefill_pp_size"]))
        if not ranks or any(not isinstance(r.get("kvferry"), dict) for r in ranks):
            raise RuntimeError(f"bootstrap server {addr} lists ranks of another transfer "
                               "backend; both servers need --disaggregation-transfer-backend "
                               "dynamic with kvferry.sglang")
        g = ranks[0]["kvferry"]
        if pp != self.pp_size:
            raise RuntimeError(f"the prefill server at {addr} has {pp} pipeline stages, this "
                               f"decode server {self.pp_size}; kvferry's SGLang backend needs "
                               "equal PP")
        if bool(g["mla"]) != self.is_mla:
            raise RuntimeError(f"the prefill server at {addr} runs an "
                               f"{'MLA' if g['mla'] else 'MHA'} pool, this one does not")
        if int(g["page_size"]) != self.page_size:
            raise RuntimeError(f"the prefill server at {addr} has --page-size "
                               f"{g['page_size']}, this decode server {self.page_size}; set "
                               "them equal")
        if self.state_groups and tp != self.attn_tp_size:
            raise RuntimeError(f"Mamba state moves between equal TP sizes only (as SGLang's own "
                               f"backends): the prefill server has attention TP {tp}, this one "
                               f"{self.attn_tp_size}")
        if [list(x) for x in g.get("state", [])] != [[i, len(p)] for i, p, _ in
                                                      self.state_groups]:
            raise RuntimeError(f"the prefill server's state buffers are {g.get('state')} (slot "
                               "bytes, tensors), this server's "
                               f"{[[i, len(p)] for i, p, _ in self.state_groups]}")
        mine = [int(x) for x in self.kv_args.aux_item_lens]
        if list(g["aux_item_lens"]) != mine:
            raise RuntimeError(f"the prefill server's aux rows are {g['aux_item_lens']} bytes, "
                               f"this server's {mine}: the two servers run different models or "
                               "SGLang versions")
        # Decode stage p holds the layers prefill stage p holds (equal PP).
        stage = next((r["kvferry"] for r in ranks if int(r["pp_rank"]) == self.pp_rank), g)
        with self._register_lock:
            if not self._registered:
                self.model_heads = int(g["heads"])
                self.first_layer = int(stage.get("first_layer", 0))
                self._register_caches(self.model_heads)
        hosts: dict[tuple[int, int, int], tuple[str, int]] = {}
        for r in ranks:
            hosts[(int(r["dp_group"]), int(r["attn_tp_rank"]), int(r["pp_rank"]))] = (
                str(r["rank_ip"]), int(r["kvferry"]["aux_port"]))
        return {"tp": tp, "dp": dp, "pp": pp, "engine_id": str(g["engine_id"]),
                "base_port": int(g["base_port"]), "hosts": hosts}

    # -- both: the native calls a step makes

    def step(self) -> None:
        """Hands kvferry's scheduler's queued metadata to the worker (StartLoadKv)."""
        self.worker.start_load_kv(self.scheduler.build_connector_meta())

    def pump(self) -> None:
        """Collects what the worker finished since last asked (never blocks)."""
        with self._lock:
            sending, recving = self.worker.get_finished()
            # A load's error may come in an earlier TakeLoadErrors than its finish
            # (connector.h): kept until the finish comes.
            for e in self.worker.take_load_errors():
                if e["request_id"] in self._live:
                    self._load_errors[e["request_id"]] = f"{e['code']}: {e['message']}"
            self._finished_sending.update(r for r in sending if r in self._live)
            for rid in (r for r in recving if r in self._live):
                self._finished_recving[rid] = self._load_errors.pop(rid, "")

    def watch(self, rid: str, live: bool) -> None:
        """Starts or stops keeping what the worker reports about `rid`."""
        with self._lock:
            if live:
                self._live.add(rid)
            else:
                self._live.discard(rid)
                self._finished_sending.discard(rid)
                self._finished_recving.pop(rid, None)
                self._load_errors.pop(rid, None)

    def registration_error(self) -> Optional[str]:
        """Prefill: why this rank could not register with the bootstrap server, if it could not."""
        fut = getattr(self, "_registration", None)
        if fut is None or not fut.done() or fut.exception() is None:
            return None
        return str(fut.exception())

    def take_sent(self, rid: str) -> bool:
        with self._lock:
            if rid in self._finished_sending:
                self._finished_sending.discard(rid)
                return True
            return False

    def take_received(self, rid: str) -> Optional[str]:
        with self._lock:
            return self._finished_recving.pop(rid, None)

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._aux_pool.shutdown(wait=False, cancel_futures=True)
        if self._aux is not None:
            self._aux.close()
        self.worker.close()


def _state_slot(state_indices: Any, mgr: KvferryKVManager) -> Optional[int]:
    """The request's Mamba state slot from SGLang's state_indices (one entry, an index or a
    one-element array); None without state groups."""
    if not mgr.state_groups:
        if state_indices is not None and len(state_indices):
            raise _kvferry.InvalidArgumentError(
                "state_indices given, but this server registered no state buffers")
        return None
    flat: list[int] = []
    for entry in (() if state_indices is None else state_indices):  # arrays have no bool
        try:
            flat.extend(int(x) for x in entry)  # an array or a list of slots
        except TypeError:
            flat.append(int(entry))  # one slot (a 0-d array or an int)
    if len(flat) != 1:
        raise _kvferry.InvalidArgumentError(
            f"a Mamba request names exactly one state slot, found state_indices {flat}")
    return flat[0]


# ----------------------------------------------------------------------------- sender

class KvferryKVSender:
    """Prefill side of one request. It needs nothing from the decode side before it starts (the
    decode rank subscribes by transfer id), so it reports WaitingForInput at once; Transferring
    from init until the pages' hold ends; then Success, or Failed when aborted or refused."""

    def __init__(self, mgr: KvferryKVManager, bootstrap_addr: str, bootstrap_room: int,
                 dest_tp_ranks: Any = None, pp_rank: Any = None, **_: Any):
        self.mgr, self.room = mgr, int(bootstrap_room or 0)
        self.rid = transfer_id(self.room)
        self.params = {"do_remote_decode": True, "transfer_id": self.rid}
        self.num_pages = 0
        self.aux_index: Optional[int] = None
        self.pages: list[int] = []
        self.held = False  # the last chunk went out and kvferry holds the pages
        self.state = WAITING_FOR_INPUT
        self.reason = ""
        self.aborted = False
        self.started = time.monotonic()

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index
        if self.state == WAITING_FOR_INPUT:
            self.state = TRANSFERRING

    def _fail(self, reason: str) -> None:
        if self.state not in (SUCCESS, FAILED):
            self.state, self.reason = FAILED, reason

    def _finish(self, state: int, reason: str = "") -> None:
        self.mgr.watch(self.rid, False)
        if state == SUCCESS:
            self.state = SUCCESS
        else:
            self._fail(reason)

    def send(self, kv_indices: Any, state_indices: Any = None) -> None:
        if self.state in (SUCCESS, FAILED) or self.held:
            return
        pages = [int(p) for p in kv_indices]
        computed = len(self.pages) * self.mgr.page_size
        self.pages.extend(pages)
        prompt = self.num_pages * self.mgr.page_size
        last = len(self.pages) >= self.num_pages
        try:
            if len(self.pages) > self.num_pages:
                raise _kvferry.InvalidArgumentError(
                    f"send() brought {len(self.pages)} pages in all, init() announced "
                    f"{self.num_pages}")
            m = self.mgr
            state = _state_slot(state_indices, m) if last else None
            if m.state_groups:
                m.scheduler.request_scheduled_all_groups(
                    self.rid, self.params, m.group_ids(self.pages, state, last), computed,
                    len(pages) * m.page_size, prompt)
            else:
                m.scheduler.request_scheduled(self.rid, self.params, self.pages, computed,
                                              len(pages) * m.page_size, prompt)
            m.step()
            for layer in range(m.total_layers):
                m.worker.save_kv_layer(layer)
            if last:
                if self.aux_index is not None:
                    m.keep_aux(self.room, self.aux_index)
                if m.state_groups:
                    held, _ = m.scheduler.request_finished_all_groups(
                        self.rid, self.params, "length", m.group_ids(self.pages, state, True))
                else:
                    held, _ = m.scheduler.request_finished(self.rid, self.params, "length",
                                                           self.pages)
                m.step()
                if not held:
                    raise _kvferry.InternalError("kvferry did not hold the request's pages")
                m.watch(self.rid, True)
                self.held = True
        except Exception as e:  # into poll, never into SGLang's loop
            logger.warning("kvferry.sglang: room %s: %s", self.room, e)
            self._end_transfer()
            self._fail(f"kvferry refused the chunk: {e}")

    def _end_transfer(self) -> None:
        """Ends the request's transfer (kvferry's TransferEnd): announced readers fail at once, a
        hold is invalidated (ended, its readers' confirmations refused) before this returns."""
        try:
            self.mgr.scheduler.request_finished(self.rid, self.params, "abort", [])
            self.mgr.step()
        except Exception as e:  # noqa: BLE001 - best effort, logged
            logger.warning("kvferry.sglang: room %s: ending its transfer: %s", self.room, e)

    def poll(self) -> int:
        if self.state in (SUCCESS, FAILED):
            return self.state
        error = self.mgr.registration_error()
        if error is not None:
            # Held or not: no decode rank can find a rank its bootstrap server refused, so nobody
            # will ever read the request (the refusal may come after its last chunk was held).
            self._end_transfer()
            self.mgr.watch(self.rid, False)
            self._fail(f"this prefill rank is not registered with its bootstrap server: {error}")
            return self.state
        try:
            self.mgr.pump()
        except Exception as e:  # noqa: BLE001
            self._fail(f"kvferry worker: {e}")
            return self.state
        if self.held and self.mgr.take_sent(self.rid):
            # The hold ended: every reader confirmed, or its lease ran out. SGLang may free now.
            if self.mgr._aux is not None:
                self.mgr._aux.read_soon(self.room)
            self._finish(FAILED if self.aborted else SUCCESS, "Aborted by AbortReq.")
        return self.state

    def abort(self) -> None:
        """SGLang's AbortReq: the transfer ends here and now, held or not. kvferry invalidates
        the hold before this returns, so a reader still reading fails when it confirms (rule 10)
        and never uses bytes from pages SGLang frees and reuses next."""
        if self.state in (SUCCESS, FAILED):
            return
        self.aborted = True
        self._end_transfer()
        self.mgr.watch(self.rid, False)
        self._fail("Aborted by AbortReq.")

    def clear(self) -> None:
        pass

    def failure_exception(self) -> None:
        """SGLang calls it on every rank once any rank failed, then frees the pages: a transfer
        still announced here ends so its readers fail at once."""
        if self.state not in (SUCCESS, FAILED):
            self._end_transfer()
        self._fail("failed on another rank of this prefill server")
        self.mgr.watch(self.rid, False)
        raise KVTransferError(self.room, self.reason if self.reason else
                              "failed on another rank of this prefill server")

    # upstream SGLang's sender additions
    def get_transfer_metric(self) -> Any:
        try:
            from sglang.srt.disaggregation.base.conn import KVTransferMetric  # type: ignore
        except ImportError:
            return None
        return KVTransferMetric(transfer_latency_s=time.monotonic() - self.started)

    def pop_decode_prefix_len(self) -> int:
        return 0

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk


# ----------------------------------------------------------------------------- receiver

class KvferryKVReceiver:
    """Decode side of one request: Bootstrapping while the prefill server's rank table is read
    (on a thread, once per prefill server), WaitingForInput until SGLang preallocates and calls
    init, Transferring while kvferry reads the pages and then the aux rows, then Success or
    Failed."""

    def __init__(self, mgr: KvferryKVManager, bootstrap_addr: str,
                 bootstrap_room: Optional[int] = None, prefill_dp_rank: Optional[int] = None,
                 **_: Any):
        self.mgr, self.addr = mgr, str(bootstrap_addr)
        self.room = int(bootstrap_room or 0)
        self.rid = transfer_id(self.room)
        self.prefill_dp_rank = prefill_dp_rank
        self.state = BOOTSTRAPPING
        self.reason = ""
        self.aux_index: Optional[int] = None
        self._aux: Optional[concurrent.futures.Future] = None
        self._info: Optional[dict] = None
        self._loading = False
        self._aborted = False
        self._deadline = time.monotonic() + mgr.timeout_s
        self._fut = mgr.prefill_info(self.addr)

    def _fail(self, reason: str) -> None:
        if self.state not in (SUCCESS, FAILED):
            self.state, self.reason = FAILED, reason
            self.mgr.watch(self.rid, False)
            logger.info("kvferry.sglang: room %s failed: %s", self.room, reason)

    def _bootstrapped(self) -> bool:
        if self._info is None and self._fut.done():
            e = self._fut.exception()
            if e is not None:
                self._fail(f"bootstrap: {e}")
                return False
            self._info = self._fut.result()
            if self.state == BOOTSTRAPPING:
                self.state = WAITING_FOR_INPUT
        return self._info is not None

    def init(self, kv_indices: Any = None, aux_index: Optional[int] = None,
             state_indices: Any = None) -> None:
        if isinstance(kv_indices, int) and aux_index is None and state_indices is None:
            self.prefill_dp_rank = kv_indices  # upstream's init(prefill_dp_rank)
            return
        self.send_metadata(kv_indices, aux_index, state_indices)

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None,
                      state_indices: Any = None, decode_prefix_len: Optional[int] = None) -> None:
        if self.state in (SUCCESS, FAILED):
            return
        if not self._bootstrapped():
            self._fail("init() before the prefill server's ranks were known (SGLang calls it "
                       "only after WaitingForInput)")
            return
        info, m = self._info, self.mgr
        try:
            state = _state_slot(state_indices, m)
        except Exception as e:  # noqa: BLE001 - into poll, never into SGLang's loop
            self._fail(f"state_indices: {e}")
            return
        dp = (int(self.prefill_dp_rank) if self.prefill_dp_rank is not None
              else self.room % info["dp"])
        if not 0 <= dp < info["dp"]:
            self._fail(f"prefill DP rank {dp} of a server with {info['dp']}")
            return
        stage_hosts = [info["hosts"].get((dp, t, p), (None, 0))[0]
                       for p in range(info["pp"]) for t in range(info["tp"])]
        if None in stage_hosts:
            self._fail(f"the prefill server at {self.addr} has not registered every rank of DP "
                       f"group {dp} yet")
            return
        params = {"do_remote_prefill": True, "transfer_id": self.rid,
                  "remote_engine_id": info["engine_id"], "remote_host": stage_hosts[0],
                  "remote_port": info["base_port"] + dp * info["pp"] * info["tp"],
                  "remote_tp_size": info["tp"]}
        if info["pp"] > 1:
            params["remote_pp_size"] = info["pp"]
        if any(h != stage_hosts[0] for h in stage_hosts):
            params["remote_rank_hosts"] = stage_hosts
        # The rank whose aux rows this rank pulls: one it reads KV from, of the last stage.
        source = m.attn_tp_rank * info["tp"] // m.attn_tp_size
        self._aux_source = info["hosts"][(dp, source, info["pp"] - 1)]
        self.aux_index = aux_index
        try:
            pages = [int(p) for p in kv_indices]
            m.watch(self.rid, True)
            if m.state_groups:
                m.scheduler.update_state_after_alloc_all_groups(
                    self.rid, params, m.group_ids(pages, state, True), -1, -1)
            else:
                m.scheduler.update_state_after_alloc(self.rid, params, pages, -1, -1)
            m.step()
            self._loading = True
            self.state = TRANSFERRING
        except Exception as e:  # noqa: BLE001 - into poll
            self._fail(f"kvferry refused the load: {e}")

    def _fetch_aux(self) -> bytes:
        """On a pool thread: the aux rows' bytes only. They are copied into SGLang's metadata
        slot by poll(), on SGLang's thread, while the slot is still this request's."""
        host, port = self._aux_source
        data = _http("GET", f"http://{host}:{port}/aux/{self.room}")
        want = sum(int(n) for n in self.mgr.kv_args.aux_item_lens)
        if len(data) != want:
            raise RuntimeError(f"aux rows of {len(data)} bytes from {host}:{port}, expected "
                               f"{want}")
        return data

    def _store_aux(self, data: bytes) -> None:
        a, at = self.mgr.kv_args, 0
        for ptr, n in zip(a.aux_data_ptrs, a.aux_item_lens):
            ctypes.memmove(int(ptr) + int(n) * int(self.aux_index), data[at:at + int(n)], int(n))
            at += int(n)

    def poll(self) -> int:
        if self.state in (SUCCESS, FAILED):
            return self.state
        if self.state == BOOTSTRAPPING:
            if not self._bootstrapped() and time.monotonic() > self._deadline:
                self._fail(f"no answer from the bootstrap server at {self.addr} in "
                           f"{self.mgr.timeout_s:.0f} s")
            return self.state
        if not self._loading:
            return self.state
        if self._aux is None:
            try:
                self.mgr.pump()
            except Exception as e:  # noqa: BLE001
                self._fail(f"kvferry worker: {e}")
                return self.state
            error = self.mgr.take_received(self.rid)
            if error is None:
                return self.state  # still reading (an aborted load too, until it stops)
            self._loading = False
            if self._aborted:
                self._fail("Aborted by AbortReq.")
                return self.state
            if error:
                self._fail(f"reading the KV from the prefill server at {self.addr}: {error}")
                return self.state
            self.mgr.watch(self.rid, False)
            if self.aux_index is None:
                self.state = SUCCESS
                return self.state
            self._loading = True
            self._aux = self.mgr._aux_pool.submit(self._fetch_aux)
        if self._aux.done():
            self._loading = False
            e = self._aux.exception()
            if e is not None:
                self._fail(f"pulling the aux rows (first token) from the prefill rank: {e}")
            elif self._aborted:
                self._fail("Aborted by AbortReq.")
            else:
                self._store_aux(self._aux.result())
                self.state = SUCCESS
        return self.state

    def _stop_load(self, why: str) -> None:
        try:
            self.mgr.worker.abort_load(self.rid, why)
        except Exception as e:  # noqa: BLE001 - logged; the load still ends by its deadline
            logger.warning("kvferry.sglang: room %s: abort: %s", self.room, e)

    def abort(self) -> None:
        """SGLang's AbortReq. A load still reading keeps reporting Transferring until kvferry
        says it stopped (its reads write into the pages SGLang gave it, so SGLang must keep
        them until then); then Failed."""
        if self.state in (SUCCESS, FAILED):
            return
        self._aborted = True
        if self._loading and self._aux is None:
            self._stop_load("aborted by SGLang (AbortReq)")
            return
        self._fail("Aborted by AbortReq.")

    def clear(self) -> None:
        self.mgr.watch(self.rid, False)

    def failure_exception(self) -> None:
        """SGLang calls it on every rank once any rank failed, then frees the pages at once: a
        load still reading here is stopped now (its reads may still finish into those pages
        while the stop takes effect: a known limit, docs/sglang.md)."""
        if self._loading and self._aux is None:
            self._stop_load("failed on another rank of this decode server")
        self._loading = False
        self._fail("failed on another rank of this decode server")
        raise KVTransferError(self.room, self.reason if self.reason else
                              "failed on another rank of this decode server")


# ----------------------------------------------------------------------------- provider

class KvferryProvider:
    """The dynamic backend provider (the fork's backend_factory.DisaggBackendFactory builds it
    with no arguments and asks get_kv_class for each KVClassType)."""

    def get_kv_class(self, class_type: Any) -> Optional[type]:
        name = str(getattr(class_type, "value", class_type)).lower()
        if name == "kvargs":
            try:
                from sglang.srt.disaggregation.base.conn import KVArgs  # type: ignore
            except ImportError:
                return _KVArgs
            return KVArgs
        return {"manager": KvferryKVManager, "sender": KvferryKVSender,
                "receiver": KvferryKVReceiver,
                "bootstrap_server": KvferryBootstrapServer}.get(name)


class _KVArgs:
    """SGLang's KVArgs where SGLang is not importable: a plain attribute holder."""
