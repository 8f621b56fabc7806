"""kvferry as a vLLM KV connector.

Use it with vLLM's disaggregated serving by passing, on both instances::

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.vllm",
                           "kv_role": "kv_producer",          # kv_consumer on the decode side
                           "engine_id": "prefill-0",
                           "kv_connector_extra_config": {"base_port": 5557, "host": "10.0.0.1",
                                                         "secret": "...", "transport": "auto"}}'

The class has the method set of vLLM's KVConnectorBase_V1 and subclasses it when vLLM is
importable; without vLLM it works standalone (the tests drive it with plain objects and numpy
arrays). Settings come from kv_connector_extra_config, then from the reference connector's
environment variables (VLLM_ASCEND_LLMDD_RPC_IP, VLLM_ASCEND_LLMDD_RPC_PORT,
DISAGGREGATED_PREFILL_RANK_TABLE_PATH, ASCEND_RT_VISIBLE_DEVICES) and KVFERRY_SECRET.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from . import _kvferry

try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1 as _Base,
        KVConnectorMetadata as _MetaBase,
        KVConnectorRole as _Role,
    )
except Exception:  # vLLM absent: standalone
    _Base = object
    _MetaBase = object
    _Role = None

SCHEDULER = "scheduler"
WORKER = "worker"

_DTYPES = {
    "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32",
    "int8": "int8", "int32": "int32", "int64": "int64", "uint16": "bf16",
}


class KvferryConnectorMetadata(_MetaBase):  # type: ignore[misc, valid-type]
    """The scheduler's per-step metadata, as bytes (picklable, shipped to worker processes)."""

    def __init__(self, data: bytes = b""):
        self.data = data


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _role_name(role: Any) -> str:
    name = getattr(role, "name", role)
    name = str(name).lower()
    return SCHEDULER if "scheduler" in name else WORKER


class _Settings:
    """Everything the connector reads from vLLM's config and the environment."""

    def __init__(self, vllm_config: Any):
        ktc = _get(vllm_config, "kv_transfer_config")
        extra = dict(_get(ktc, "kv_connector_extra_config", {}) or {})
        self.kv_role = _get(ktc, "kv_role", "kv_producer")
        if self.kv_role not in ("kv_producer", "kv_consumer"):
            raise _kvferry.InvalidArgumentError(
                f"kv_role must be kv_producer (prefill) or kv_consumer (decode), found {self.kv_role!r}")
        self.engine_id = str(_get(ktc, "engine_id", "") or extra.get("engine_id", "kvferry-0"))
        parallel = _get(vllm_config, "parallel_config")
        self.tp_size = int(extra.get("tp_size", _get(parallel, "tensor_parallel_size", 1)))
        self.dp_rank = int(extra.get("dp_rank", _get(parallel, "data_parallel_rank_local", 0) or 0))
        self.tp_rank = int(extra.get("tp_rank", 0))
        self.host = extra.get("host", os.environ.get("VLLM_ASCEND_LLMDD_RPC_IP", "127.0.0.1"))
        self.base_port = int(extra.get("base_port", os.environ.get("VLLM_ASCEND_LLMDD_RPC_PORT", 5557)))
        self.secret = extra.get("secret", os.environ.get("KVFERRY_SECRET", ""))
        self.transport = extra.get("transport", "auto")
        # Prefill side: prctl(PR_SET_PTRACER_ANY), so shm works under Yama ptrace_scope=1; it lets
        # every same-user process ptrace this one (docs/transport.md).
        self.shm_permit_any_tracer = str(extra.get("shm_permit_any_tracer", False)).lower() in (
            "1", "true", "yes")
        self.rank_table = extra.get("rank_table_path",
                                    os.environ.get("DISAGGREGATED_PREFILL_RANK_TABLE_PATH", ""))
        self.visible_devices = extra.get("visible_devices",
                                         os.environ.get("ASCEND_RT_VISIBLE_DEVICES", ""))
        self.server_id = extra.get("server_id", self.host)
        self.hold_lease_ms = int(extra.get("hold_lease_ms", 120000))
        self.transfer_timeout_ms = int(extra.get("transfer_timeout_ms", 30000))
        self.failure_policy = extra.get("kv_load_failure_policy", "recompute")
        self.num_kv_heads = extra.get("num_kv_heads")  # model-wide; else local heads * tp_size
        self.layout = extra.get("block_layout", "token_major")
        cache = _get(vllm_config, "cache_config")
        self.block_size = int(extra.get("block_size", _get(cache, "block_size", 16)))


def _array_info(a: Any) -> tuple[int, tuple[int, ...], str]:
    """(address, shape, dtype name) of a torch tensor or numpy array."""
    if hasattr(a, "data_ptr"):  # torch
        dtype = str(a.dtype).replace("torch.", "")
        return int(a.data_ptr()), tuple(int(x) for x in a.shape), _DTYPES.get(dtype, dtype)
    dtype = str(a.dtype)
    return int(a.ctypes.data), tuple(int(x) for x in a.shape), _DTYPES.get(dtype, dtype)


class KvferryConnector(_Base):  # type: ignore[misc, valid-type]
    """vLLM KV connector backed by kvferry. One instance per role per process."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        if _Base is not object:  # pragma: no cover - with vLLM
            try:
                super().__init__(vllm_config, role, kv_cache_config)
            except TypeError:
                super().__init__(vllm_config, role)
        self._settings = _Settings(vllm_config)
        self._role = _role_name(role)
        self._connector_metadata: Optional[KvferryConnectorMetadata] = None
        self._scheduler: Optional[_kvferry.Scheduler] = None
        self._worker: Optional[_kvferry.Worker] = None
        s = self._settings
        if self._role == SCHEDULER:
            self._scheduler = _kvferry.Scheduler(
                "prefill" if s.kv_role == "kv_producer" else "decode", s.engine_id, s.host,
                s.base_port, s.dp_rank, s.tp_size, s.hold_lease_ms)

    # ----------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = _get(request, "kv_transfer_params") or {}
        prompt = _get(request, "num_prompt_tokens")
        if prompt is None:
            prompt = len(_get(request, "prompt_token_ids", []) or [])
        return self._scheduler.get_num_new_matched_tokens(dict(params), int(prompt), int(num_computed_tokens))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = _get(request, "kv_transfer_params")
        if not params or not params.get("do_remote_prefill"):
            return
        if hasattr(blocks, "get_unhashed_block_ids"):
            block_ids = list(blocks.get_unhashed_block_ids()) if num_external_tokens > 0 else []
        else:
            block_ids = list(blocks) if num_external_tokens > 0 else []
        self._scheduler.update_state_after_alloc(_get(request, "request_id"), params, block_ids)

    def build_connector_meta(self, scheduler_output: Any = None) -> KvferryConnectorMetadata:
        return KvferryConnectorMetadata(self._scheduler.build_connector_meta())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        status = _get(request, "status")
        reason = getattr(status, "name", str(status))
        params = _get(request, "kv_transfer_params") or {}
        return self._scheduler.request_finished(_get(request, "request_id"), dict(params), reason,
                                                list(block_ids))

    # ----------------------------------------------------------------- worker side

    def bind_connector_metadata(self, metadata: KvferryConnectorMetadata) -> None:
        self._connector_metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Takes {layer name: (K, V) | (latent, rope) | (latent, rope, indexer)} of torch tensors
        or numpy arrays shaped [num_blocks, block_size, heads, head_dim] (MHA) or
        [num_blocks, block_size, dim] (MLA parts)."""
        s = self._settings
        names = list(kv_caches.keys())
        first = kv_caches[names[0]]
        parts = [_array_info(t) for t in first]
        _, shape0, dtype = parts[0]
        num_blocks, block_size = shape0[0], shape0[1]
        if len(parts) == 3:
            spec = _kvferry.CacheSpec.sparse_mla(len(names), parts[0][1][-1], parts[1][1][-1],
                                                 parts[2][1][-1], num_blocks, block_size, dtype,
                                                 s.tp_size, s.tp_rank)
        elif len(parts) == 2 and parts[0][1][-1] != parts[1][1][-1]:
            spec = _kvferry.CacheSpec.mla(len(names), parts[0][1][-1], parts[1][1][-1], num_blocks,
                                          block_size, dtype, s.tp_size, s.tp_rank)
        elif len(parts) == 2:
            local_heads = shape0[2] if len(shape0) == 4 else 1
            heads = int(s.num_kv_heads) if s.num_kv_heads else local_heads * s.tp_size
            spec = _kvferry.CacheSpec.mha(len(names), heads, shape0[-1], num_blocks, block_size,
                                          dtype, s.tp_size, s.tp_rank, s.layout)
        else:
            raise _kvferry.InvalidArgumentError(
                f"layer {names[0]} has {len(parts)} cache parts; expected 2 (K/V or MLA) or 3 (sparse MLA)")
        bases = [[_array_info(t)[0] for t in kv_caches[n]] for n in names]
        self._worker = _kvferry.Worker(
            "prefill" if s.kv_role == "kv_producer" else "decode", s.engine_id, s.tp_size,
            s.tp_rank, s.dp_rank, s.host, s.base_port, s.secret, s.transport, s.rank_table,
            s.server_id, s.visible_devices, s.transfer_timeout_ms, s.hold_lease_ms,
            s.failure_policy, shm_permit_any_tracer=s.shm_permit_any_tracer)
        self._worker.register_kv_caches(spec, bases)
        self._spec = spec
        self._load_error_blocks: set[int] = set()

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        if self._worker is not None and self._connector_metadata is not None:
            self._worker.start_load_kv(self._connector_metadata.data)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole requests, finished before the request is scheduled: nothing to wait."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Pull-based: the decode side reads held blocks; nothing to push per layer."""

    def wait_for_save(self) -> None:
        """Nothing is pushed, so nothing to wait for."""

    def get_finished(self, finished_req_ids: set[str] = frozenset()) -> tuple[Optional[set[str]], Optional[set[str]]]:
        sending, receiving = self._worker.get_finished()
        for e in self._worker.take_load_errors():
            self._load_error_blocks.update(e["block_ids"])
        return (sending or None, receiving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        for e in self._worker.take_load_errors():
            self._load_error_blocks.update(e["block_ids"])
        out, self._load_error_blocks = self._load_error_blocks, set()
        return out

    def stats(self) -> dict:
        return self._worker.stats() if self._worker is not None else {}

    def shutdown(self) -> None:
        self._worker = None
