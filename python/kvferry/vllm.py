"""kvferry as a vLLM KV connector (KVConnectorBase_V1).

Use it with vLLM's disaggregated serving by passing, on both instances, one configuration for all
ranks (TP/DP ranks come from vLLM's parallel state, cache geometry from the tensors)::

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.vllm",
                           "kv_role": "kv_producer",          # kv_consumer on the decode side
                           "engine_id": "prefill-0",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"base_port": 5557, "host": "10.0.0.1",
                                                         "secret": "...", "transport": "auto"}}'

With caches in device memory add "kv_buffer_device": "cpu" (host-buffer mode, as NixlConnector:
kvferry moves host mirrors of the caches; vLLM's copy ops from set_host_xfer_buffer_ops, or torch
where vLLM hands over none, move blocks device->host when a prefill completes and host->device
before a load is reported).

On Ascend (vllm-ascend), NPU caches register as npu:N memory, and the LLM-DataDist connector's
kv_transfer_config works with only kv_connector and kv_connector_module_path changed
(kvferry.vllm_ascend: kv_port as the base port, an engine id per role, the rank table's server
id), as do the Mooncake connectors' (MooncakeConnectorV1, MooncakeLayerwiseConnector,
MooncakeHybridConnector: kv_port and their "prefill"/"decode" entries); its per-layer tuples are
read by kvferry.vllm_ascend_layout.

The class subclasses KVConnectorBase_V1 when vLLM is importable; without vLLM it works
standalone (the tests drive it as vLLM's scheduler and one-process-per-rank workers do). Extra
settings come from kv_connector_extra_config, then from the reference connector's environment
variables (VLLM_ASCEND_LLMDD_RPC_IP, VLLM_ASCEND_LLMDD_RPC_PORT,
DISAGGREGATED_PREFILL_RANK_TABLE_PATH, ASCEND_RT_VISIBLE_DEVICES) and KVFERRY_SECRET, then
KVTransferConfig's kv_port (the base port).

Contract kept towards vLLM: no scheduler hook raises on request input (bad kv_transfer_params are
logged once and mean "no remote KV"); finished_recving holds only requests vLLM handed over as
loads; finished_sending only requests vLLM has finished.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any, Optional

from . import _kvferry
from . import vllm_ascend, vllm_groups
from .vllm_hostcopy import copy_blocks
from .vllm_layout import host_mirrors, is_host_tensor, read_caches, tensor_info
from .vllm_stats import KvferryConnectorStats, KvferryPromMetrics, StatsTaker

try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1 as _Base,
        KVConnectorMetadata as _MetaBase,
    )
except Exception:  # vLLM absent: standalone
    _Base = object
    _MetaBase = object
try:  # pragma: no cover - depends on the vLLM version
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorHandshakeMetadata as _HandshakeBase,
    )
except Exception:
    _HandshakeBase = object
try:  # pragma: no cover - depends on the vLLM version
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        SupportsHMA as _SupportsHMA,
    )
    _BASES: tuple = (_Base, _SupportsHMA) if _Base is not object else (_Base,)
except Exception:
    _BASES = (_Base,)
logger = logging.getLogger("kvferry.vllm")

_MAX_ID_BYTES = 1024  # the wire format's bound on request, engine and host names
_MAX_BLOCKS = 1 << 22
_MAX_TP = 256  # kvferry's kMaxTpSize (cache_spec.h), for TP and PP sizes alike


class KvferryConnectorMetadata(_MetaBase):  # type: ignore[misc, valid-type]
    """The scheduler's per-step metadata (picklable, shipped to worker processes): the native
    metadata as bytes, the requests whose loads vLLM waits for in finished_recving and, for
    host-buffer mode, each such load's local block ids (`load_blocks`) and the prefill requests
    whose prompt completes this step with the blocks to copy device->host (`saves`), and the
    layer-wise prefill requests this step writes with their blocks (`layerwise`), and the
    requests vLLM preempted in this step (`preempted`, SchedulerOutput.preempted_req_ids, which
    today's vLLM hands the workers only through this metadata: handle_preemptions)."""

    def __init__(self, data: bytes = b"", awaited: tuple[str, ...] = (),
                 load_blocks: Optional[dict] = None, saves: Optional[dict] = None,
                 layerwise: Optional[dict] = None, preempted: tuple[str, ...] = ()):
        self.data = data
        self.awaited = tuple(awaited)
        self.load_blocks = dict(load_blocks or {})
        self.saves = dict(saves or {})
        self.layerwise = dict(layerwise or {})
        self.preempted = tuple(preempted)


class KvferryHandshakeMetadata(_HandshakeBase):  # type: ignore[misc, valid-type]
    """What a worker tells its instance's scheduler at startup (vLLM's get_handshake_metadata,
    gathered by EngineCore from every worker into set_xfer_handshake_metadata_pp_aware, or
    set_xfer_handshake_metadata in older vLLM): where it listens and which rank it is. Picklable
    (it crosses vLLM's executor)."""

    def __init__(self, engine_id: str, host: str, port: int, pp_rank: int, tp_rank: int):
        self.engine_id, self.host, self.port = engine_id, host, port
        self.pp_rank, self.tp_rank = pp_rank, tp_rank

    def __repr__(self) -> str:
        return (f"KvferryHandshakeMetadata({self.engine_id!r}, {self.host}:{self.port}, "
                f"stage {self.pp_rank}, TP rank {self.tp_rank})")


def rank_hosts(metadata: Any, engine_id: str, host: str, base_port: int, dp_rank: int,
               pp_size: int, tp_size: int) -> list[str]:
    """The host of each of an instance's pp_size x tp_size workers, stage-major, from the
    handshake metadata vLLM gathered (a mapping keyed by (pp_rank, tp_rank) or by tp_rank, whose
    kvferry values name their rank themselves); [] when every worker is on `host`. A worker that
    reports another engine or a port other than rule 7's is a ValueError (vLLM stops at startup
    with it); ranks without metadata (older vLLM keys it by TP rank alone, so its stages collide)
    are taken to listen on `host`, logged once."""
    hosts = [host] * (pp_size * tp_size)
    seen: set[int] = set()
    for md in (metadata or {}).values():
        if not isinstance(md, KvferryHandshakeMetadata):
            continue  # another connector's (vLLM's MultiConnector hands every child all of them)
        rank = md.pp_rank * tp_size + md.tp_rank
        port = base_port + (dp_rank * pp_size + md.pp_rank) * tp_size + md.tp_rank
        if md.engine_id != engine_id or not 0 <= md.pp_rank < pp_size or not (
                0 <= md.tp_rank < tp_size) or md.port != port:
            raise ValueError(
                f"kvferry: a worker of this instance reported {md!r}; expected engine "
                f"{engine_id!r}, a stage below {pp_size}, a TP rank below {tp_size} and its "
                f"port base_port + (dp_rank * pp_size + pp_rank) * tp_size + tp_rank = {port}; "
                "check that every worker of the instance has the same kv_transfer_config")
        hosts[rank] = md.host
        seen.add(rank)
    missing = [r for r in range(pp_size * tp_size) if r not in seen]
    if missing and any(h != host for h in hosts):
        logger.warning("kvferry: no handshake metadata from ranks %s (this vLLM keys it by TP "
                       "rank alone); taking them to listen on %s", missing, host)
    # Every rank on `host`: nothing to say; any elsewhere (all on one other host too): name them.
    return hosts if any(h != host for h in hosts) else []


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _prompt_tokens(request: Any) -> int:
    """A vLLM Request's prompt length (prompt_token_ids, else num_prompt_tokens)."""
    prompt = _get(request, "prompt_token_ids")
    return len(prompt) if prompt is not None else int(_get(request, "num_prompt_tokens", 0))


def _register(s: "_Settings", on_drain: Any = None) -> list:
    """kv_connector_extra_config "register": {"etcd": "etcd://HOST:PORT/PREFIX", "url":
    "http://HOST:API_PORT", "name": NAME, "ttl_s": 10, "kv_host": HOST}: DP rank 0's scheduler
    registers the instance (both roles for kv_both) with its connector endpoint (docs/fleet.md),
    in the background when etcd is not reachable yet."""
    spec = s.extra.get("register")
    if not spec or s.dp_rank != 0:
        return []
    from .fleet import Registration
    if not isinstance(spec, dict) or not spec.get("etcd") or not spec.get("url"):
        raise _kvferry.InvalidArgumentError(
            "kv_connector_extra_config register: expected {\"etcd\": \"etcd://HOST:PORT/PREFIX\", "
            f"\"url\": \"http://HOST:PORT\" (this instance's OpenAI API), ...}}, found {spec!r}")
    roles = {"kv_producer": ["prefill"], "kv_consumer": ["decode"],
             "kv_both": ["prefill", "decode"]}.get(str(s.kv_role), ["prefill"])
    name = str(spec.get("name") or s.engine_id)
    connector = {"engine_id": s.engine_id, "host": str(spec.get("kv_host") or s.host),
                 "port": s.base_port, "tp_size": s.tp_size, "pp_size": s.pp_size}
    out = []
    for role in roles:
        try:
            out.append(Registration(str(spec["etcd"]), role, name, str(spec["url"]),
                                    connector if role == "prefill" else None,
                                    ttl_s=int(spec.get("ttl_s", 10)),
                                    on_drain=on_drain).start(wait=False))
        except ValueError as e:
            raise _kvferry.InvalidArgumentError(f"kv_connector_extra_config register: {e}")
    return out


def _is_scheduler(role: Any) -> bool:
    return "scheduler" in str(getattr(role, "name", role)).lower()


def _int(value: Any) -> Optional[int]:
    """An int that is not a bool; None for anything else."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value.encode()) <= _MAX_ID_BYTES


def remote_prefill_params(params: Any) -> tuple[Optional[dict], str]:
    """The load a request's kv_transfer_params ask for, normalised to what kvferry's scheduler
    takes, and "" ; or (None, why) when they ask for none ("" why) or are unusable. Accepts
    NixlConnector's shapes too: `tp_size` for remote_tp_size, remote_block_ids as one group."""
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None, ""
    transfer = params.get("transfer_id")
    if transfer is not None and not _name(transfer):
        return None, "transfer_id must be a non-empty string of at most 1024 bytes"
    if params.get("metaserver") is not None and params.get("remote_host") is None:
        return None, ("they name a metaserver: vllm-ascend's layer-wise proxy "
                      "(load_balance_proxy_layerwise_server_example.py), whose decode instance "
                      "posts its blocks there for the prefill to push into; kvferry's decode "
                      "reads from the prefill instead. Use load_balance_proxy_server_example.py "
                      "(prefill first) or kvferry-proxy")
    blocks = params.get("remote_block_ids")
    if transfer is not None and blocks is None:
        blocks = []  # a layer-wise leg: the prefill side announces its blocks with each layer
    more = params.get("remote_group_block_ids")
    if (isinstance(blocks, (list, tuple)) and blocks
            and all(isinstance(g, (list, tuple)) for g in blocks)):
        # NixlConnector's hybrid allocator: a tuple of lists, one per KV cache group.
        blocks, more = blocks[0], (list(blocks[1:]) or more)

    def bad_ids(ids: Any) -> bool:
        return not isinstance(ids, (list, tuple)) or len(ids) > _MAX_BLOCKS or any(
            _int(b) is None or not -1 <= b < (1 << 62) for b in ids)

    if bad_ids(blocks):
        return None, "remote_block_ids must be a list of block ids"
    if more is not None and (not isinstance(more, (list, tuple)) or len(more) >= 16
                             or any(bad_ids(g) for g in more)):
        return None, ("remote_group_block_ids must be a list of block id lists, one per KV "
                      "cache group after the first")
    tp = params.get("remote_tp_size", params.get("tp_size"))
    pp = params.get("remote_pp_size", params.get("pp_size", 1))
    port = _int(params.get("remote_port"))
    out = {"do_remote_prefill": True, "remote_block_ids": list(blocks),
           "remote_engine_id": params.get("remote_engine_id"),
           "remote_host": params.get("remote_host"), "remote_port": port,
           "remote_tp_size": _int(tp)}
    if not _name(out["remote_engine_id"]) or not _name(out["remote_host"]):
        return None, "remote_engine_id and remote_host must be non-empty strings"
    if port is None or not 1 <= port <= 65535:
        return None, "remote_port must be a port number"
    if out["remote_tp_size"] is None or not 1 <= out["remote_tp_size"] <= _MAX_TP:
        return None, "remote_tp_size (or tp_size) must be a positive TP size"
    if pp is not None:
        if _int(pp) is None or not 1 <= pp <= _MAX_TP:
            return None, "remote_pp_size (or pp_size) must be a positive PP size"
        if pp > 1:
            out["remote_pp_size"] = pp
    if port + (pp or 1) * out["remote_tp_size"] - 1 > 65535:
        return None, "remote_port + remote_pp_size * remote_tp_size - 1 is past port 65535"
    if more:
        out["remote_group_block_ids"] = [list(g) for g in more]
    hosts = params.get("remote_rank_hosts")
    if hosts is not None:
        ranks = (pp or 1) * out["remote_tp_size"]
        if not isinstance(hosts, (list, tuple)) or len(hosts) != ranks or not all(
                _name(h) for h in hosts):
            return None, (f"remote_rank_hosts must be a list of {ranks} host names, one per "
                          "remote rank (remote_pp_size x remote_tp_size, stage-major)")
        out["remote_rank_hosts"] = list(hosts)
    rid = params.get("remote_request_id")
    if rid is not None:
        if not _name(rid):
            return None, "remote_request_id must be a non-empty string"
        out["remote_request_id"] = rid
    if transfer is not None:
        out["transfer_id"] = transfer
    return out, ""


def first_layer(layer_names: list[str], pp_size: int) -> int:
    """The model-wide index of a pipeline stage's first layer, from vLLM's layer names
    ("model.layers.12.self_attn.attn": the first all-digit component): the smallest. A load
    reads each of its layers from the prefill stage holding it (cache layer l is model layer
    first + l), so with pipeline parallelism the stage's indices must be one contiguous run, and
    names without an index or runs with gaps are refused. Without it, a name without an index
    means 0."""
    indices = []
    for name in layer_names:
        index = next((int(p) for p in str(name).split(".") if p.isdigit()), None)
        if index is None:
            if pp_size > 1:
                raise _kvferry.InvalidArgumentError(
                    f"pipeline-parallel size {pp_size}, but the layer name {name!r} has no "
                    "layer index (expected vLLM's 'model.layers.N....'): kvferry cannot tell "
                    "which layers this stage holds")
            return 0
        indices.append(index)
    if pp_size > 1 and indices and sorted(set(indices)) != list(
            range(min(indices), min(indices) + len(indices))):
        raise _kvferry.InvalidArgumentError(
            f"pipeline-parallel size {pp_size}, but this stage's layer indices "
            f"{sorted(indices)[:8]}... are not one run of consecutive layers: kvferry maps a "
            "stage's cache layer l to model layer first + l when it reads across stages")
    return min(indices) if indices else 0


def layerwise_transfer_id(params: Any) -> Optional[str]:
    """The transfer id of a prefill leg sent for layer-wise transfer (docs/layerwise.md):
    do_remote_decode with a transfer_id; None for any other request."""
    if not isinstance(params, dict) or params.get("do_remote_decode") is not True:
        return None
    transfer = params.get("transfer_id")
    return transfer if _name(transfer) else None


def current_stream_handle(tensor: Any) -> int:
    """The native handle of the stream the engine writes `tensor`'s device on now (a CUstream
    for cuda), for Worker.save_kv_layer; 0 for host tensors or a device kvferry does not know."""
    device = getattr(tensor, "device", None)
    kind = getattr(device, "type", None)
    if kind not in ("cuda", "npu"):
        return 0
    import torch  # present wherever a device tensor is
    if kind == "cuda":
        return int(torch.cuda.current_stream(device).cuda_stream)
    npu = getattr(torch, "npu", None)  # torch_npu
    stream = npu.current_stream(device) if npu is not None else None
    return int(getattr(stream, "npu_stream", 0) or 0)


def cuda_unavailable_message(memory: str, native: str) -> str:
    """The refusal of CUDA caches kvferry cannot open (no driver, no device), in a vLLM user's
    terms: the native message's own advice (the CLI's sim device) means nothing inside vLLM."""
    found = re.sub(r";[^;]*\bsim device\b[^;]*$", "", native.strip())
    return (f"register_kv_caches: the KV caches are {memory} memory, which kvferry moves itself "
            f"through the CUDA driver, and that failed: {found}. Either run this vLLM worker "
            "where the NVIDIA driver is installed and the GPU is visible (libcuda.so.1 loadable, "
            "CUDA_VISIBLE_DEVICES naming it), or add \"kv_buffer_device\": \"cpu\" to "
            "--kv-transfer-config on both instances (host-buffer mode: kvferry moves host copies "
            "of the caches and vLLM or torch copies the blocks to and from the GPU)")


class _Settings:
    """Everything the connector reads from vLLM's config and the environment."""

    def __init__(self, vllm_config: Any):
        ktc = _get(vllm_config, "kv_transfer_config")
        extra = dict(_get(ktc, "kv_connector_extra_config", {}) or {})
        self.extra = extra
        self.kv_role = _get(ktc, "kv_role", "kv_producer")
        roles = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
        if self.kv_role not in roles:
            raise _kvferry.InvalidArgumentError(
                "kv_role must be kv_producer (prefill), kv_consumer (decode) or kv_both (each "
                f"request's kv_transfer_params decide), found {self.kv_role!r}")
        # kv_both: the prefill side of requests with do_remote_decode and the decode side of
        # those with do_remote_prefill, on the same caches (its workers serve and read).
        self.native_role = roles[self.kv_role]
        self.serves = self.native_role in ("prefill", "both")
        self.reads = self.native_role in ("decode", "both")
        # kvferry's id of this instance: a decode instance's is distinct from any prefill's,
        # so both may be given one engine_id (vllm_ascend.internal_engine_id); a kv_both
        # instance is named as a prefill one, since decode instances read from it by that name.
        self.engine_id = vllm_ascend.internal_engine_id(
            str(_get(ktc, "engine_id", "") or extra.get("engine_id", "kvferry-0")),
            self.native_role)
        parallel = _get(vllm_config, "parallel_config")
        self.tp_size = int(extra.get("tp_size", _get(parallel, "tensor_parallel_size", 1) or 1))
        self.pp_size = int(extra.get("pp_size",
                                     _get(parallel, "pipeline_parallel_size", 1) or 1))
        dp = None
        for field in ("data_parallel_index", "data_parallel_rank", "data_parallel_rank_local"):
            dp = _int(_get(parallel, field))
            if dp is not None:
                break
        self.dp_rank = int(extra.get("dp_rank", dp or 0))
        # A vllm-ascend Mooncake connector's config: its role's entry must describe this instance.
        placement = vllm_ascend.mooncake_placement(extra)
        if placement is not None:
            vllm_ascend.check_mooncake_placement(
                placement, self.native_role, self.tp_size,
                _int(_get(parallel, "data_parallel_size")), self.pp_size,
                (_int(_get(parallel, "prefill_context_parallel_size")),
                 _int(_get(parallel, "decode_context_parallel_size"))))
        self.host = vllm_ascend.listen_host(extra)
        self.base_port = vllm_ascend.base_port(extra, _get(ktc, "kv_port"))
        self.secret = extra.get("secret", os.environ.get("KVFERRY_SECRET", ""))
        self.transport = extra.get("transport", "auto")
        # vLLM's host-buffer mode (NixlConnector's route for memory it cannot reach): device
        # caches are mirrored in host memory, which kvferry moves; vLLM's copy ops move blocks.
        self.use_host_buffer = str(_get(ktc, "kv_buffer_device", "") or "") == "cpu"
        # Backend options by key ("tcp.connections": 4), checked by the transport.
        self.transport_options = {str(k): str(v).lower() if isinstance(v, bool) else str(v)
                                  for k, v in (extra.get("transport_options") or {}).items()}
        # "shm_permit_any_tracer": true is the backend option shm.permit_any_tracer by its own
        # name (prefill side: prctl(PR_SET_PTRACER_ANY), so shm works under Yama ptrace_scope=1; it
        # lets every same-user process ptrace this one; docs/transport.md); transport_options,
        # when it sets that option too, decides.
        if str(extra.get("shm_permit_any_tracer", False)).lower() in ("1", "true", "yes"):
            self.transport_options.setdefault("shm.permit_any_tracer", "true")
        self.rank_table = extra.get("rank_table_path",
                                    os.environ.get("DISAGGREGATED_PREFILL_RANK_TABLE_PATH", ""))
        self.visible_devices = extra.get("visible_devices",
                                         os.environ.get("ASCEND_RT_VISIBLE_DEVICES", ""))
        self.server_id = vllm_ascend.server_id(extra, self.rank_table, self.host)
        self.hold_lease_ms = int(extra.get("hold_lease_ms", 120000))
        self.transfer_timeout_ms = int(extra.get("transfer_timeout_ms", 30000))
        self.failure_policy = (_get(ktc, "kv_load_failure_policy")
                               or extra.get("kv_load_failure_policy", "recompute"))
        cache = _get(vllm_config, "cache_config")
        self.block_size = int(_get(cache, "block_size", 16) or 16)
        model = _get(vllm_config, "model_config")
        self.total_kv_heads: Optional[int] = None
        if model is not None and hasattr(model, "get_total_num_kv_heads"):
            self.total_kv_heads = int(model.get_total_num_kv_heads())
        self.use_mla = bool(_get(model, "use_mla", False))
        # The fused MLA cache's row split, from the HF config as vLLM's MLA backends read it.
        self.mla_split: Optional[tuple[int, int]] = None
        hf = _get(model, "hf_text_config") or _get(model, "hf_config")
        lora, rope = _get(hf, "kv_lora_rank"), _get(hf, "qk_rope_head_dim")
        if self.use_mla and isinstance(lora, int) and isinstance(rope, int):
            self.mla_split = (lora, rope)
        # The model's depth, all pipeline stages (vLLM's get_pp_indices splits
        # num_hidden_layers): in the compatibility hash, where a stage's own range is not.
        depth = _get(hf, "num_hidden_layers")
        self.model_layers = int(depth) if isinstance(depth, int) and depth > 0 else 0

    def pipeline_ranks(self) -> tuple[int, int]:
        """(pp_size, pp_rank) of this worker process: vLLM's pipeline group where it is
        importable and initialised (get_pp_group(), as vLLM's make_layers reads it); else the
        extra config's pp_size/pp_rank (tests); a PP size above 1 with neither is a
        configuration error."""
        try:  # pragma: no cover - with vLLM
            from vllm.distributed.parallel_state import get_pp_group  # type: ignore
            group = get_pp_group()
            size, rank = int(group.world_size), int(group.rank_in_group)
        except Exception:
            size = rank = None
        if size is not None:  # pragma: no cover - with vLLM
            return size, rank
        if "pp_rank" in self.extra:
            return self.pp_size, int(self.extra["pp_rank"])
        if self.pp_size == 1:
            return 1, 0
        raise _kvferry.InvalidArgumentError(
            f"pipeline-parallel size {self.pp_size} but vLLM's parallel state is not available "
            "to tell this worker's stage; run inside vLLM's worker processes")

    def worker_ranks(self) -> tuple[int, int]:
        """(tp_size, tp_rank) of this worker process: vLLM's parallel state where it is
        importable and initialised (as NixlConnector reads it); else the extra config's
        tp_size/tp_rank (tests); a TP size above 1 with neither is a configuration error."""
        try:  # pragma: no cover - with vLLM
            from vllm.distributed.parallel_state import (  # type: ignore
                get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size)
            size, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        except Exception:
            size = rank = None
        if size is not None:  # pragma: no cover - with vLLM
            for key, value in (("tp_size", size), ("tp_rank", rank)):
                if key in self.extra and int(self.extra[key]) != value:
                    raise _kvferry.InvalidArgumentError(
                        f"kv_connector_extra_config sets {key}={self.extra[key]} but vLLM's "
                        f"parallel state says {value}; remove {key}: ranks come from vLLM")
            return size, rank
        if "tp_rank" in self.extra:
            return self.tp_size, int(self.extra["tp_rank"])
        if self.tp_size == 1:
            return 1, 0
        raise _kvferry.InvalidArgumentError(
            f"TP size {self.tp_size} but vLLM's parallel state is not available to tell this "
            "worker's TP rank; run inside vLLM's worker processes")


class KvferryConnector(*_BASES):  # type: ignore[misc, valid-type]
    """vLLM KV connector backed by kvferry. One instance per role per process. SupportsHMA:
    hybrid models (full attention with sliding-window layers) keep vLLM's hybrid KV cache
    manager, and each KV cache group moves as a group of its own (kvferry.vllm_groups)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        if _Base is not object:  # pragma: no cover - with vLLM
            try:
                super().__init__(vllm_config, role, kv_cache_config)
            except TypeError:
                super().__init__(vllm_config, role)
        else:
            self._role = role
            self._connector_metadata: Optional[KvferryConnectorMetadata] = None
        self._settings = s = _Settings(vllm_config)
        # vLLM's KV cache groups kvferry moves; None for one group (the path before HMA).
        self._groups = vllm_groups.transfer_groups(kv_cache_config, s.block_size)
        self._is_scheduler = _is_scheduler(role)
        self._scheduler: Optional[_kvferry.Scheduler] = None
        self._worker: Optional[_kvferry.Worker] = None
        self._awaited_next: list[str] = []  # scheduler: loads vLLM waits for, this step
        self._warned: set[str] = set()  # scheduler: requests whose bad params were logged
        self._awaited: set[str] = set()  # worker: loads to report in finished_recving
        self._holds: set[str] = set()  # worker: holds not yet reported as sent
        self._finished_seen: set[str] = set()  # worker: held requests vLLM has finished
        self._load_error_blocks: set[int] = set()
        self._stats = StatsTaker()  # worker: figures since vLLM last asked
        self._load_blocks_next: dict[str, list[int]] = {}  # scheduler: host mode, this step
        self._saves_pending: dict[str, tuple[Any, list[int]]] = {}  # scheduler: host mode
        self._device_caches: Optional[dict] = None  # worker, host mode: vLLM's device caches
        self._host_caches: Optional[dict] = None  # worker, host mode: their host mirrors
        self._copy_blocks: Any = None  # worker, host mode: vLLM's copy_kv_blocks
        self._torch_copy_logged = False  # worker, host mode: torch copies blocks (logged once)
        self._load_blocks: dict[str, list[int]] = {}  # worker, host mode: awaited loads' blocks
        # Layer-wise (docs/layerwise.md). Scheduler, prefill: requests sent with a transfer id,
        # with their params and blocks so far. Worker, prefill: kvferry's layer of each of vLLM's
        # layer names, the layers announced in this step, and in host mode this step's blocks.
        self._layerwise: dict[str, tuple[Any, dict, list[int]]] = {}
        self._ended_transfers: set[str] = set()  # scheduler: layer-wise legs ended by preemption
        self._layer_index: dict[str, int] = {}
        # A hybrid's state layers (Mamba, linear attention), with their names: vLLM's mixers call
        # no save_kv_layer, so wait_for_save announces them at the end of each step's forward.
        self._state_layers: list[tuple[int, str, Any]] = []
        self._saved_layers: set[int] = set()
        self._save_warned = False
        self._applied = False  # worker: the bound metadata went to the native worker
        self._registrations: list = []  # scheduler: this instance's keys in etcd (fleet.py)
        # Scheduler, for a drain (docs/fleet.md): requests held for their readers, loads vLLM
        # waits for, until vLLM reports them in finished_sending / finished_recving.
        self._held_ids: set[str] = set()
        self._loading_ids: set[str] = set()
        self._draining = threading.Event()
        self._drained = False
        if self._is_scheduler:
            self._scheduler = _kvferry.Scheduler(
                s.native_role, s.engine_id, s.host, s.base_port, s.dp_rank, s.tp_size,
                s.hold_lease_ms, s.pp_size, vllm_groups.has_state(self._groups))
            self._registrations = _register(s, self._draining.set)

    if _Base is object:
        @property
        def role(self) -> Any:
            return self._role

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        """HND (head-major blocks) for MHA, so K/V of a run of heads is one byte range; MLA
        caches have no head axis: no preference."""
        model = _get(vllm_config, "model_config")
        if model is None or bool(_get(model, "use_mla", False)):
            return None
        return "HND"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Optional[dict] = None) -> bool:
        """True (vLLM then runs PIECEWISE CUDA graphs, which keep the attention layers' hooks
        outside the graph): a layer-wise prefill leg is announced from save_kv_layer, which a
        FULL graph never calls. kv_connector_extra_config "layerwise": false says the proxy
        never sends layer-wise legs, and keeps FULL graphs."""
        value = (extra_config or {}).get("layerwise", True)
        return str(value).lower() not in ("0", "false", "no", "off")

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> KvferryConnectorStats:
        """vLLM's loggers rebuild the workers' aggregated figures from their data
        (kvferry.vllm_stats)."""
        return KvferryConnectorStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list,
                           per_engine_labelvalues: dict) -> KvferryPromMetrics:
        """kvferry's series in vLLM's /metrics (kvferry.vllm_stats.KvferryPromMetrics)."""
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ----------------------------------------------------------------- scheduler side

    def _params(self, request: Any) -> Optional[dict]:
        params, why = remote_prefill_params(_get(request, "kv_transfer_params"))
        rid = str(_get(request, "request_id"))
        if params is not None and params.get("transfer_id") is None:
            # The prefill side's groups must be ours (a hook never raises into vLLM: a mismatch
            # is prefilled here, as any unusable params).
            theirs = 1 + len(params.get("remote_group_block_ids") or ())
            ours = len(self._groups) if self._groups is not None else 1
            if theirs != ours:
                params, why = None, (f"they name blocks of {theirs} KV cache group(s) and this "
                                     f"instance has {ours}: the two instances must run the same "
                                     "model with the same hybrid KV cache manager setting")
        if why and rid not in self._warned and len(self._warned) < 100000:
            self._warned.add(rid)
            logger.warning("request %s: ignoring kv_transfer_params %r (%s); it is prefilled "
                           "locally", rid, _get(request, "kv_transfer_params"), why)
        return params

    def _loaded_prompt(self, request: Any) -> int:
        """The prompt tokens a load brings: with a state group the prompt less its last token,
        which the decode side computes from the loaded state (NixlConnector's
        _get_remote_prefill_token_count)."""
        prompt = _prompt_tokens(request)
        return prompt - 1 if vllm_groups.has_state(self._groups) and prompt > 1 else prompt

    def _truncate_for_state(self, request: Any) -> None:
        """Prefill side of a model with a state group, a request for remote decode: it computes
        its prompt less the last token and stops after one, so that its state is the one before
        that token (NixlConnector's _truncate_mamba_request_for_prefill, once per request)."""
        raw = _get(request, "kv_transfer_params")
        if (not vllm_groups.has_state(self._groups) or not isinstance(raw, dict)
                or raw.get("do_remote_decode") is not True or raw.get("_p_side_truncated")
                or _prompt_tokens(request) <= 1):
            return
        prompt = _get(request, "prompt_token_ids")
        if prompt is not None:
            prompt.pop()
        elif _get(request, "prompt_embeds") is not None:
            request.prompt_embeds = request.prompt_embeds[:-1]
        all_ids = _get(request, "_all_token_ids")
        if all_ids is not None and all_ids is not prompt:
            all_ids.pop()
        request.num_prompt_tokens = int(_get(request, "num_prompt_tokens", 1)) - 1
        request.max_tokens = 1
        raw["_p_side_truncated"] = True

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self._truncate_for_state(request)
        params = self._params(request)
        if params is None:
            return 0, False
        count = self._loaded_prompt(request) - int(num_computed_tokens)
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        raw = _get(request, "kv_transfer_params")
        transfer = layerwise_transfer_id(raw)
        if (transfer is not None and self._settings.serves
                and str(_get(request, "request_id")) not in self._ended_transfers):
            # Layer-wise prefill leg: each step that writes its prompt is announced layer by
            # layer; build_connector_meta tells the workers which blocks and tokens.
            # A hybrid's every group (vLLM's KVCacheBlocks.get_block_ids(): one list per group).
            all_ids = (blocks.get_block_ids() if hasattr(blocks, "get_block_ids")
                       else (blocks,))
            groups = all_ids if self._groups is not None else all_ids[:1]
            self._layerwise[str(_get(request, "request_id"))] = (
                request, {"do_remote_decode": True, "transfer_id": transfer},
                [[int(b) for b in ids or ()] for ids in groups])
        if (self._settings.use_host_buffer and isinstance(raw, dict)
                and raw.get("do_remote_decode") is True and not raw.get("do_remote_prefill")):
            # Host-buffer mode, prefill side (as NixlConnector): its blocks are copied to the
            # host mirrors in the step that completes its prompt, before request_finished.
            ids = blocks.get_block_ids()[0] if hasattr(blocks, "get_block_ids") else blocks
            self._saves_pending[str(_get(request, "request_id"))] = (
                request, [int(b) for b in ids or ()])
            return
        if not isinstance(raw, dict) or not raw.get("do_remote_prefill"):
            return
        params = self._params(request)
        raw["do_remote_prefill"] = False  # one load per request, whatever happens next
        if params is None:
            return
        rid = str(_get(request, "request_id"))
        if self._groups is not None:
            # Hybrid: every group's blocks from the load's first token on (vLLM hands the
            # request's whole KVCacheBlocks: prefix hits, new blocks, a window's null blocks).
            prompt, ext = _prompt_tokens(request), max(int(num_external_tokens), 0)
            groups = (vllm_groups.group_block_ids(blocks.get_block_ids(), self._groups,
                                                  self._loaded_prompt(request) - ext)
                      if ext > 0 else [[] for _ in self._groups])
            self._scheduler.update_state_after_alloc_all_groups(rid, params, groups, ext, prompt)
            if ext > 0:
                self._awaited_next.append(rid)
                self._loading_ids.add(rid)
            return
        block_ids: list[int] = []
        if num_external_tokens > 0:
            ids = (blocks.get_unhashed_block_ids() if hasattr(blocks, "get_unhashed_block_ids")
                   else blocks)
            block_ids = [int(b) for b in ids]
        # The tokens the load brings: what lets the two instances use different block sizes.
        self._scheduler.update_state_after_alloc(rid, params, block_ids,
                                                 max(int(num_external_tokens), 0),
                                                 _prompt_tokens(request))
        if num_external_tokens > 0:
            self._awaited_next.append(rid)  # else: a full prefix hit only notifies the prefill side
            self._loading_ids.add(rid)
            self._load_blocks_next[rid] = block_ids

    def _saves_this_step(self, scheduler_output: Any) -> dict[str, list[int]]:
        """Host-buffer mode: the prefill requests whose prompt is complete after this step, with
        all their blocks. A request's later chunks add the blocks vLLM lists in
        scheduled_cached_reqs.new_block_ids; without a SchedulerOutput every pending request
        counts as complete (one-step prefill)."""
        saves: dict[str, list[int]] = {}
        if not self._saves_pending:
            return saves
        scheduled = _get(scheduler_output, "num_scheduled_tokens")
        cached = _get(scheduler_output, "scheduled_cached_reqs")
        new_ids: dict[str, list[int]] = {}
        if cached is not None:
            for rid, ids in zip(_get(cached, "req_ids") or (), _get(cached, "new_block_ids") or ()):
                if ids and isinstance(ids[0], (list, tuple)):
                    ids = ids[0]  # one list per KV cache group: the attention group
                new_ids[str(rid)] = [int(b) for b in ids or ()]
        for rid, (req, ids) in list(self._saves_pending.items()):
            ids.extend(new_ids.get(rid, ()))
            if isinstance(scheduled, dict):
                if rid not in scheduled:
                    continue
                count = _prompt_tokens(req)
                if int(_get(req, "num_computed_tokens", 0) or 0) + int(scheduled[rid]) < count:
                    continue  # a chunk short of the prompt's end
            saves[rid] = list(ids)
            del self._saves_pending[rid]
        return saves

    def _layerwise_this_step(self, scheduler_output: Any) -> dict[str, list[int]]:
        """Layer-wise prefill legs scheduled in this step: each one's blocks and token range go
        to kvferry's scheduler (Scheduler.request_scheduled) for the workers' announcements.
        Returns the blocks each writes in this step (host-buffer mode copies them). Without a
        SchedulerOutput every tracked request counts as writing its whole prompt now."""
        out: dict[str, list[int]] = {}
        if not self._layerwise:
            return out
        scheduled = _get(scheduler_output, "num_scheduled_tokens")
        cached = _get(scheduler_output, "scheduled_cached_reqs")
        new_ids: dict[str, list[list[int]]] = {}
        if cached is not None:
            for rid, ids in zip(_get(cached, "req_ids") or (), _get(cached, "new_block_ids") or ()):
                # One list per KV cache group (vLLM's tuple), or one list of a uniform model.
                per_group = ids if ids and isinstance(ids[0], (list, tuple)) else (ids,)
                new_ids[str(rid)] = [[int(b) for b in g or ()] for g in per_group]
        for rid, (req, params, ids) in self._layerwise.items():
            for mine, more in zip(ids, new_ids.get(rid, ())):
                mine.extend(more)
            count = _prompt_tokens(req)
            if isinstance(scheduled, dict):
                if rid not in scheduled:
                    continue
                computed, step = int(_get(req, "num_computed_tokens", 0) or 0), int(scheduled[rid])
            else:
                computed, step = 0, count
            if self._groups is not None:
                # The groups kvferry moves (a window's freed blocks as -1, a state group's state
                # block); the prompt is the truncated one with state groups (vLLM's rule).
                self._scheduler.request_scheduled_all_groups(
                    rid, params, vllm_groups.group_block_ids(ids, self._groups), computed, step,
                    count)
            else:
                self._scheduler.request_scheduled(rid, params, ids[0], computed, step, count)
            if computed < count:
                out[rid] = list(ids[0])
        return out

    def build_connector_meta(self, scheduler_output: Any = None) -> KvferryConnectorMetadata:
        awaited, self._awaited_next = self._awaited_next, []
        load_blocks, self._load_blocks_next = self._load_blocks_next, {}
        preempted = self._preempted_this_step(scheduler_output)
        saves = self._saves_this_step(scheduler_output)
        layerwise = self._layerwise_this_step(scheduler_output)
        return KvferryConnectorMetadata(self._scheduler.build_connector_meta(), tuple(awaited),
                                        load_blocks, saves, layerwise, preempted)

    def _preempted_this_step(self, scheduler_output: Any) -> tuple[str, ...]:
        """vLLM's preempted_req_ids of this step. vLLM freed their blocks and will recompute
        them: a layer-wise prefill leg's transfer ends now (kvferry's scheduler queues its
        TransferEnd, so its readers fail at once instead of at their progress deadline) and it
        is no longer announced or held; a host-buffer save waits for the recomputed prompt."""
        ids = _get(scheduler_output, "preempted_req_ids") or ()
        out = tuple(sorted(str(r) for r in ids)) if isinstance(ids, (set, frozenset, list, tuple)) else ()
        for rid in out:
            entry = self._layerwise.pop(rid, None)
            if entry is not None:
                self._ended_transfers.add(rid)
                self._scheduler.request_finished(rid, entry[1], "preempted", [])
        return out

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        return self._held(request, self._finished(request, [int(b) for b in block_ids], None))

    def _held(self, request: Any, result: tuple[bool, Optional[dict]]
              ) -> tuple[bool, Optional[dict]]:
        """Counts a request held for its readers (vLLM keeps its blocks) until finished_sending
        reports it (a drain waits for none to be left)."""
        if result[0]:
            self._held_ids.add(str(_get(request, "request_id")))
        return result

    def request_finished_all_groups(self, request: Any, block_ids: Any
                                    ) -> tuple[bool, Optional[dict]]:
        """vLLM's SupportsHMA hook (vllm/v1/core/sched/scheduler.py _connector_finished): once,
        when the request has finished in every group, with each group's block ids."""
        groups = list(block_ids or ())
        if self._groups is None:
            return self._held(request, self._finished(
                request, [int(b) for b in (groups[0] if groups else ())], None))
        return self._held(request, self._finished(
            request, [], vllm_groups.group_block_ids(groups, self._groups)))

    def _finished(self, request: Any, block_ids: list[int],
                  groups: Optional[list[list[int]]]) -> tuple[bool, Optional[dict]]:
        rid = str(_get(request, "request_id"))
        self._warned.discard(rid)
        if self._saves_pending.pop(rid, None) is not None:
            # Host-buffer mode: finished before the step completing its prompt, so its blocks
            # never reached the host mirrors; offering them would serve stale bytes.
            logger.warning("request %s finished before its prompt was complete; its KV is not "
                           "offered to a decode instance", rid)
            return False, None
        raw = _get(request, "kv_transfer_params")
        if not isinstance(raw, dict):
            return False, None
        status = _get(request, "status")
        reason = str(getattr(status, "name", status))
        if raw.get("do_remote_prefill"):
            # Finished before update_state_after_alloc (aborted while waiting): a load of no
            # blocks only tells the prefill side to free; vLLM waits for nothing.
            raw["do_remote_prefill"] = False
            params, _ = remote_prefill_params(dict(raw, do_remote_prefill=True))
            if params is not None and self._settings.reads:
                if groups is not None:
                    self._scheduler.request_finished_all_groups(rid, params, reason,
                                                                [[] for _ in groups])
                else:
                    self._scheduler.request_finished(rid, params, reason, [])
            return False, None
        if raw.get("do_remote_decode") is not True:
            return False, None
        self._layerwise.pop(rid, None)
        if rid in self._ended_transfers:
            # Its layer-wise transfer ended when vLLM preempted it; its readers have failed
            # (to recompute), so a hold would only wait for its lease.
            self._ended_transfers.discard(rid)
            return False, None
        params: dict = {"do_remote_decode": True}
        transfer = layerwise_transfer_id(raw)
        if transfer is not None:
            params["transfer_id"] = transfer  # held under it; readers confirm by it
        if groups is not None:
            return self._scheduler.request_finished_all_groups(rid, params, reason, groups)
        return self._scheduler.request_finished(rid, params, reason, block_ids)

    # ----------------------------------------------------------------- worker side

    def bind_connector_metadata(self, metadata: KvferryConnectorMetadata) -> None:
        """Binds the step's metadata and hands it to the native worker at once (its holds, its
        layer-wise saves and its loads; StartLoadKv never blocks), so that the step's save_kv_layer
        calls announce this step's requests whether vLLM calls start_load_kv before the forward
        or, as vLLM does since PR 53333 when no load is synchronous, after it."""
        self._connector_metadata = metadata
        self._applied = False
        self._apply_metadata()

    def _apply_metadata(self) -> None:
        md = self._connector_metadata
        if self._worker is None or md is None or self._applied:
            return
        self._applied = True
        self._awaited.update(getattr(md, "awaited", ()))
        if self._host_caches is not None:
            self._load_blocks.update(getattr(md, "load_blocks", {}))
        self._saved_layers = set()
        self._worker.start_load_kv(md.data)

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def handle_preemptions(self, preempted: Any = None) -> None:
        """vLLM calls it before each step: today with the step's connector metadata (every step),
        before with preempted_req_ids (a set, only when some were preempted). A preempted
        request's load still running here is stopped and reported (finished_recving, no
        recompute asked: vLLM recomputes a preempted request itself); prefill-side preemptions
        were handled by the scheduler (their layer-wise transfers ended). Never raises."""
        ids = getattr(preempted, "preempted", preempted)
        if self._worker is None or not isinstance(ids, (set, frozenset, list, tuple)):
            return
        for rid in ids:
            if rid in self._awaited:
                try:
                    self._worker.abort_load(str(rid), "the request was preempted by vLLM")
                except Exception as e:  # never into vLLM's step
                    logger.error("handle_preemptions: stopping the load of %s failed: %s: %s",
                                 rid, type(e).__name__, e)

    def build_connector_worker_meta(self) -> None:
        """Nothing flows worker -> scheduler besides get_finished's sets and the stats."""
        return None

    # Ranks on several hosts (a pipeline stage or a TP group per host). At startup EngineCore
    # asks every worker for get_handshake_metadata (vllm/v1/worker/gpu_worker.py
    # get_kv_connector_handshake_metadata, keyed by (pp_rank, tp_rank)) and hands them all to the
    # scheduler's set_xfer_handshake_metadata_pp_aware (vllm/v1/engine/core.py EngineCore
    # __init__; older vLLM: set_xfer_handshake_metadata, keyed by TP rank). The prefill
    # scheduler then names each rank's host in kv_transfer_params (remote_rank_hosts), and a
    # decode stage reads the host of the prefill stage that holds its layers.
    def get_handshake_metadata(self) -> Optional[KvferryHandshakeMetadata]:
        """Worker: where this worker listens, once its caches are registered; else None."""
        if self._worker is None:
            return None
        s = self._settings
        tp_size, tp_rank = s.worker_ranks()
        pp_size, pp_rank = s.pipeline_ranks()
        port = s.base_port + (s.dp_rank * pp_size + pp_rank) * tp_size + tp_rank
        return KvferryHandshakeMetadata(s.engine_id, s.host, port, pp_rank, tp_rank)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: Any) -> None:
        """Scheduler: every worker's KvferryHandshakeMetadata. kvferry's stages listen on their
        own ports (rule 7), so pp_rank > 0 is served, not refused as vLLM's base class does."""
        if self._scheduler is None:
            return
        s = self._settings
        hosts = rank_hosts(metadata, s.engine_id, s.host, s.base_port, s.dp_rank, s.pp_size,
                           s.tp_size)
        self._scheduler.set_rank_hosts(hosts)
        if hosts:
            logger.info("kvferry: this instance's ranks listen on %s (stage-major)", hosts)

    def set_xfer_handshake_metadata(self, metadata: Any) -> None:
        """Scheduler, older vLLM: the same, keyed by TP rank (stages collide; see rank_hosts)."""
        self.set_xfer_handshake_metadata_pp_aware(metadata)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Takes vLLM's {layer name: tensor} (or vllm-ascend's {layer name: tuple of parts}) and
        registers them; the geometry comes from shapes and strides (kvferry.vllm_layout)."""
        s = self._settings
        tp_size, tp_rank = s.worker_ranks()
        pp_size, pp_rank = s.pipeline_ranks()
        if self._groups is not None:
            self._register_groups(kv_caches, tp_size, tp_rank, pp_size, pp_rank)
            return
        prefer_heads_first = False
        try:  # pragma: no cover - with vLLM
            from vllm.platforms import current_platform  # type: ignore
            prefer_heads_first = bool(current_platform.is_cpu())
        except Exception:
            pass
        host = kv_caches
        if s.use_host_buffer and not all(is_host_tensor(c) for c in kv_caches.values()):
            # vLLM's host-buffer mode: kvferry registers host mirrors of the device caches.
            host = host_mirrors(kv_caches)
        reg = read_caches(host, s.block_size, s.total_kv_heads, tp_size, prefer_heads_first,
                          s.mla_split)
        first = first_layer(list(host), pp_size)
        # The model's depth, one rule for every PP size (so PP 1 pairs with PP 2): vLLM's
        # num_hidden_layers where this cache's layers fit in it, else 0 (its own end).
        depth = s.model_layers if s.model_layers >= first + len(reg.bases) else 0
        spec = _kvferry.CacheSpec.create(reg.kind, len(reg.bases), reg.parts, reg.num_blocks,
                                         reg.tokens_per_block, reg.dtype, reg.layout, tp_size,
                                         tp_rank, list(reg.fields), list(reg.block_strides),
                                         first, reg.blocks_per_id, depth)
        if reg.kind == "mha" and reg.local_heads != spec.local_heads(0):
            raise _kvferry.InvalidArgumentError(
                f"the cache tensors hold {reg.local_heads} KV heads per rank, but "
                f"{reg.parts[0][1]} model-wide heads over TP {tp_size} give "
                f"{spec.local_heads(0)} to rank {tp_rank}")
        worker = _kvferry.Worker(
            s.native_role, s.engine_id, tp_size, tp_rank, s.dp_rank, s.host, s.base_port,
            s.secret, s.transport, s.rank_table, s.server_id, s.visible_devices,
            s.transfer_timeout_ms, s.hold_lease_ms, s.failure_policy,
            transport_options=s.transport_options, pp_size=pp_size, pp_rank=pp_rank)
        try:
            worker.register_kv_caches(spec, reg.bases, reg.memory)
        except _kvferry.UnavailableError as e:
            if reg.memory.startswith("cuda"):
                message = cuda_unavailable_message(reg.memory, str(e))
            elif reg.memory.startswith("npu"):
                message = vllm_ascend.npu_unavailable_message(reg.memory, str(e))
            else:
                raise
            raise _kvferry.UnavailableError(message) from e
        self._worker = worker
        self._spec = spec
        self._registration = reg
        # kvferry's layer of each of vLLM's layer names: layers sharing a tensor share one.
        first: dict[tuple, int] = {}
        for name, cache in host.items():
            t = cache[0] if isinstance(cache, (tuple, list)) else cache
            info = tensor_info(t)
            self._layer_index[name] = first.setdefault((info.address, info.shape), len(first))
        if host is not kv_caches:
            self._device_caches, self._host_caches = dict(kv_caches), host

    def _register_groups(self, kv_caches: dict[str, Any], tp_size: int, tp_rank: int,
                         pp_size: int, pp_rank: int) -> None:
        """A hybrid model's caches, group by group (vLLM's KVCacheConfig.kv_cache_groups): each
        group's layers read as one cache of its own, with its sliding window; groups may share
        tensors (vLLM's hybrid allocator gives layer i of every group one tensor)."""
        s = self._settings
        groups = self._groups or []
        vllm_groups.refuse_unmovable(groups)
        if all(g.state is not None for g in groups):
            raise _kvferry.NotSupportedError(
                "every KV cache group is Mamba / linear-attention state; kvferry moves state "
                "groups beside at least one attention group")
        if pp_size > 1 or s.use_host_buffer:
            raise _kvferry.NotSupportedError(
                f"a hybrid model ({len(groups)} KV cache groups) with "
                f"{'pipeline parallelism' if pp_size > 1 else 'kv_buffer_device cpu'}: kvferry "
                "moves hybrid caches without pipeline stages and from device or host caches "
                "directly; run it with PP 1 and without host buffers")
        specs, bases, memory, first_reg = [], [], None, None
        for g in groups:
            caches = {n: kv_caches[n] for n in g.layer_names if n in kv_caches}
            if not caches:
                raise _kvferry.InvalidArgumentError(
                    f"KV cache group {g.index} names layers {list(g.layer_names)[:3]}, none of "
                    "which register_kv_caches was given")
            if g.state is not None:
                spec, group_bases, where = vllm_groups.state_cache(g, caches, tp_size, tp_rank)
                if memory is not None and where != memory:
                    raise _kvferry.InvalidArgumentError(
                        f"KV cache group {g.index} is in {where} memory and an earlier group in "
                        f"{memory}; a worker's caches are in one memory")
                memory = where
                specs.append(spec)
                bases.append(group_bases)
                continue
            reg = read_caches(caches, g.block_size, s.total_kv_heads, tp_size, False,
                              s.mla_split)
            if memory is not None and reg.memory != memory:
                raise _kvferry.InvalidArgumentError(
                    f"KV cache group {g.index} is in {reg.memory} memory and group "
                    f"{groups[0].index} in {memory}; a worker's caches are in one memory")
            memory = reg.memory
            specs.append(_kvferry.CacheSpec.create(
                reg.kind, len(reg.bases), reg.parts, reg.num_blocks, reg.tokens_per_block,
                reg.dtype, reg.layout, tp_size, tp_rank, list(reg.fields),
                list(reg.block_strides), 0, reg.blocks_per_id, 0, g.sliding_window))
            bases.append(reg.bases)
            first_reg = first_reg or reg
        worker = _kvferry.Worker(
            s.native_role, s.engine_id, tp_size, tp_rank, s.dp_rank, s.host, s.base_port,
            s.secret, s.transport, s.rank_table, s.server_id, s.visible_devices,
            s.transfer_timeout_ms, s.hold_lease_ms, s.failure_policy,
            transport_options=s.transport_options, pp_size=pp_size, pp_rank=pp_rank)
        worker.register_kv_cache_groups(specs, bases, memory or "host")
        # kvferry's layer index of each of vLLM's layer names: group 0's layers, then group 1's
        # (Worker.save_kv_layer); a state group's layers are saved at the step's end.
        offset = 0
        for g in groups:
            names = [n for n in g.layer_names if n in kv_caches]
            for i, name in enumerate(names):
                self._layer_index[name] = offset + i
                if g.state is not None:
                    cache = kv_caches[name]  # [conv, ssm]: the stream is the conv state's device's
                    self._state_layers.append(
                        (offset + i, name, cache[0] if isinstance(cache, (list, tuple)) else cache))
            offset += len(names)
        self._worker = worker
        self._spec = specs[0]
        self._registration = first_reg
        logger.info("kvferry: %d KV cache groups registered (%s)", len(specs),
                    ", ".join(f"{g.kind} of {len(g.layer_names)} layers"
                              + (f", window {g.sliding_window}" if g.sliding_window else "")
                              for g in groups))

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        """vLLM's block copy ops (copy_kv_blocks(src_caches, dst_caches, src_block_ids,
        dst_block_ids, direction), direction "d2h" or "h2d"). Used only in host-buffer mode
        (kv_buffer_device "cpu" with caches on a device); ignored otherwise, as NixlConnector
        does. Without it (never called, or called with None) blocks are copied with torch."""
        self._copy_blocks = copy_operation

    def _kernel_block_ids(self, ids: list[int]) -> list[int]:
        """vLLM's block ids in the tensors' (kernel) blocks, which may be smaller."""
        ratio = self._registration.kernel_blocks_per_block
        if ratio == 1:
            return list(ids)
        return [b * ratio + i for b in ids for i in range(ratio)]

    def _copy(self, src: dict, dst: dict, ids: list[int], direction: str) -> None:
        """Copies blocks `ids` between the device caches and their host mirrors: with vLLM's copy
        op when it handed one over, else with torch (kvferry.vllm_hostcopy; some vLLM versions
        call set_host_xfer_buffer_ops on some platforms only)."""
        kernel = self._kernel_block_ids(ids)
        if self._copy_blocks is None:
            if not self._torch_copy_logged:
                self._torch_copy_logged = True
                logger.info("host-buffer mode: vLLM handed over no block copy op "
                            "(set_host_xfer_buffer_ops was not called); kvferry copies blocks "
                            "between the device caches and the host buffers with torch")
            copy_blocks(src, dst, kernel, direction, self._registration)
            return
        self._copy_blocks(src, dst, kernel, kernel, direction)

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """The step's metadata went to the native worker when it was bound; this applies it only
        where bind_connector_metadata came before register_kv_caches."""
        self._apply_metadata()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """A no-op, by design: a decode request computes nothing while its KV loads (vLLM keeps
        it in WAITING_FOR_REMOTE_KVS until finished_recving, and kvferry reads every layer before
        reporting it), so no layer of it is ever waited for here."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Prefill, layer-wise (docs/layerwise.md): vLLM has written this layer's KV for the
        step; kvferry announces it to the decode workers subscribed to the step's layer-wise
        requests, which read it while the next layers compute. With CUDA caches the announcement
        waits for the work queued on the current stream so far, on a kvferry thread: this call
        never blocks. Host-buffer mode announces every layer in wait_for_save, after the step's
        blocks are copied to the host. Never raises into vLLM: a failure is logged once and the
        decode side falls back (its load fails by its deadline and is recomputed)."""
        md = self._connector_metadata
        if (self._worker is None or md is None or not getattr(md, "layerwise", None)
                or self._host_caches is not None):
            return
        layer = self._layer_index.get(layer_name)
        if layer is not None:  # else not a layer kvferry registered
            self._save_layer_once(layer, layer_name, kv_layer)

    def _save_layer_once(self, layer: int, name: str, tensor: Any) -> None:
        """Announces kvferry layer `layer` of this step once (layers sharing a tensor, or a state
        layer an engine saved itself, are not announced twice); never raises into vLLM's forward
        pass: a failure is logged once."""
        if layer in self._saved_layers:
            return
        self._saved_layers.add(layer)
        try:
            self._worker.save_kv_layer(layer, current_stream_handle(tensor))
        except Exception as e:
            if not self._save_warned:
                self._save_warned = True
                logger.error("save_kv_layer(%s): %s: %s; layer-wise announcements of this "
                             "worker may be missing (logged once)", name, type(e).__name__, e)

    def wait_for_save(self) -> None:
        """Whole-request: nothing is pushed. In host-buffer mode, as NixlConnector's
        save_kv_to_host: the blocks of each prefill request whose prompt completed in this step
        are copied device -> host (blocking) before the step ends, so before request_finished
        offers them, with vLLM's copy op or, when vLLM handed over none, with torch; layer-wise
        requests' blocks of this step are copied too, and then every layer is announced. A
        failing copy (a broken device) raises, as NixlConnector's does: offering the stale host
        copy would corrupt the decode side."""
        md = self._connector_metadata
        if (self._state_layers and md is not None and getattr(md, "layerwise", None)
                and self._worker is not None):
            self._save_state_layers()
        if self._host_caches is None or md is None:
            return
        for rid, ids in getattr(md, "saves", {}).items():
            if ids:
                self._copy(self._device_caches, self._host_caches, ids, "d2h")
        layerwise = getattr(md, "layerwise", None) or {}
        for rid, ids in layerwise.items():
            if ids and rid not in getattr(md, "saves", {}):
                self._copy(self._device_caches, self._host_caches, ids, "d2h")
        if layerwise and self._worker is not None:
            for layer in range(len(self._registration.bases)):
                self._worker.save_kv_layer(layer, 0)

    def _save_state_layers(self) -> None:
        """Layer-wise, a hybrid's state layers: written by this step's forward pass, which has
        queued its last kernels by the time vLLM calls wait_for_save; announced once each step
        (a layer an engine already saved, as vllm-ascend's GDN op does, is not saved again).
        The decode side reads a state only once written to the prompt's end."""
        for layer, name, tensor in self._state_layers:
            self._save_layer_once(layer, name, tensor)

    def get_finished(self, finished_req_ids: set[str] = frozenset()) -> tuple[Optional[set[str]], Optional[set[str]]]:
        if self._worker is None:
            return None, None
        for rid in finished_req_ids or ():
            if rid in self._awaited:  # vLLM finished it (aborted): stop its load early
                self._worker.abort_load(rid, "the request was finished by vLLM")
            self._finished_seen.add(rid)
        sending, receiving = self._worker.get_finished()
        errors = self._worker.take_load_errors()
        self._holds |= set(sending)
        sent = {r for r in self._holds if r in self._finished_seen}
        self._holds -= sent
        self._finished_seen -= sent
        # Only finished ids of held requests are kept; the rest were never sends.
        if len(self._finished_seen) > 100000:
            self._finished_seen.clear()
        recv = {r for r in receiving if r in self._awaited}
        self._awaited -= recv
        if self._host_caches is not None:
            self._sync_received_to_device(recv, errors)
        for e in errors:
            if e["code"] == "Cancelled":
                continue  # vLLM finished the request itself: nothing to recompute
            if e["request_id"] not in recv and e["request_id"] not in self._awaited:
                continue  # a notify-only load: no blocks of vLLM's were involved
            self._load_error_blocks.update(e["block_ids"])
        return (sent or None, recv or None)

    def _sync_received_to_device(self, recv: set[str], errors: list) -> None:
        """Host-buffer mode: each finished load's blocks go host -> device before the request
        is reported in finished_recving (NixlConnector's sync_recved_kv_to_device). A load vLLM
        finished itself (Cancelled) is skipped; a failing copy turns every block of the load
        into a load error, so vLLM recomputes or fails it by its policy; nothing raises."""
        cancelled = {e["request_id"] for e in errors if e["code"] == "Cancelled"}
        for rid in recv:
            ids = self._load_blocks.pop(rid, None)
            if not ids or rid in cancelled:
                continue
            try:
                self._copy(self._host_caches, self._device_caches, ids, "h2d")
            except Exception as e:  # never into vLLM: the blocks are recomputed instead
                logger.error("request %s: copying its loaded blocks host->device failed (%s: "
                             "%s); reporting them as load errors", rid, type(e).__name__, e)
                self._load_error_blocks.update(ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_error_blocks = self._load_error_blocks, set()
        return out

    def update_connector_output(self, connector_output: Any) -> None:
        """Scheduler, every step with the workers' output (vllm/v1/core/sched/scheduler.py
        _update_from_kv_xfer_finished): what ended reaches the native scheduler through vLLM's
        own finished sets and request_finished; here only a drain's bookkeeping: held requests
        and awaited loads leave with finished_sending and finished_recving, and a draining
        instance with none left reports itself drained (its etcd state; docs/fleet.md)."""
        self._held_ids.difference_update(
            str(r) for r in (_get(connector_output, "finished_sending") or ()))
        self._loading_ids.difference_update(
            str(r) for r in (_get(connector_output, "finished_recving") or ()))
        if self._draining.is_set() and not self._drained and not self._held_ids \
                and not self._loading_ids:
            self._drained = True
            logger.info("kvferry: drained: nothing held for readers and no load in flight; the "
                        "instance can be stopped")
            for r in self._registrations:
                try:
                    r.set_state("drained")
                except Exception as e:  # noqa: BLE001 - etcd away: the thread writes it later
                    logger.warning("kvferry: cannot report drained to etcd now: %s", e)

    def take_events(self) -> tuple:
        """Scheduler, every step (scheduler.py update_from_output): kvferry publishes no KV cache
        events (it caches nothing of its own)."""
        return ()

    def get_kv_connector_stats(self) -> Optional[KvferryConnectorStats]:
        """The worker's figures since the previous call (vLLM calls it every step), or None
        before registration and when nothing happened. Never raises."""
        if self._worker is None:
            return None
        stats = self._stats.take(self._worker)
        return None if stats.is_empty() else stats

    def stats(self) -> dict:
        return self._worker.stats() if self._worker is not None else {}

    def shutdown(self) -> None:
        """Stops the native worker and joins its threads (Worker.close); on the scheduler side,
        leaves the fleet (the instance's etcd keys are revoked). A second call does nothing."""
        registrations, self._registrations = self._registrations, []
        for r in registrations:
            r.close()
        worker, self._worker = self._worker, None
        close = getattr(worker, "close", None)
        if close is not None:
            close()

