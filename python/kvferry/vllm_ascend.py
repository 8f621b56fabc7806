"""What the vLLM adapter reads the way vllm-ascend's LLM-DataDist connector does.

kvferry replaces that connector (vllm_ascend.distributed.llmdatadist_c_mgr_connector) in a
deployment written for it when only ``kv_connector`` and ``kv_connector_module_path`` change
(README, "vLLM on Ascend"). Its tutorial's ``--kv-transfer-config``::

    {"kv_connector": "LLMDataDistCMgrConnector", "kv_buffer_device": "npu",
     "kv_role": "kv_producer", "kv_parallel_size": 1, "kv_port": "20001", "engine_id": "0",
     "kv_connector_module_path": "vllm_ascend.distributed.llmdatadist_c_mgr_connector"}

with ``engine_id`` "0" and the same ``kv_port`` on the decode instance, and its environment:
``DISAGGREGATED_PREFILL_RANK_TABLE_PATH``, ``VLLM_ASCEND_LLMDD_RPC_PORT`` (different on two
instances of one host), ``ASCEND_RT_VISIBLE_DEVICES``. This module maps them: the listening base
port, an engine id per role, the server id a rank table is searched by, and the refusal of NPU
caches where CANN's runtime cannot be opened.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional

from . import _kvferry

DEFAULT_BASE_PORT = 5557  # the reference's VLLM_ASCEND_LLMDD_RPC_PORT default
DECODE_ID_SUFFIX = "@decode"
_MAX_ID_BYTES = 1024  # the wire format's bound on engine ids


def _port(value: Any, source: str) -> int:
    """A port number from an int or a string of digits (vLLM's tutorials quote kv_port)."""
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or not 1 <= int(text) <= 65535:
        raise _kvferry.InvalidArgumentError(
            f"{source} must be a port number (1..65535), found {value!r}")
    return int(text)


def base_port(extra: Mapping[str, Any], kv_port: Any,
              environ: Mapping[str, str] = os.environ) -> int:
    """The port TP rank 0 of DP rank 0 listens on (worker r of DP rank d: base + d * tp + r).
    In order: kv_connector_extra_config's base_port; VLLM_ASCEND_LLMDD_RPC_PORT, where the
    reference listens (its tutorial gives two instances of one host different values and the
    same kv_port, so this comes before kv_port); KVTransferConfig's kv_port (vLLM's default
    14579 when unset there); 5557."""
    if extra.get("base_port") is not None:
        return _port(extra["base_port"], "kv_connector_extra_config.base_port")
    if environ.get("VLLM_ASCEND_LLMDD_RPC_PORT"):
        return _port(environ["VLLM_ASCEND_LLMDD_RPC_PORT"], "VLLM_ASCEND_LLMDD_RPC_PORT")
    if kv_port is not None and kv_port != "":
        return _port(kv_port, "kv_transfer_config.kv_port")
    return DEFAULT_BASE_PORT


def internal_engine_id(engine_id: str, native_role: str) -> str:
    """kvferry's id of this instance. Prefill: the configured engine_id, as kv_transfer_params
    (remote_engine_id) and a layer-wise proxy name it. Decode: engine_id + "@decode", so that
    an instance of each role may share an engine_id (the reference's tutorial gives both "0")
    and a decode worker is never taken for a prefill one: a handshake checks the engine a
    request names, and a decode worker's id never equals a prefill's. Both (kv_both): the
    engine_id, as prefill, since decode instances read from it by that name."""
    internal = engine_id if native_role in ("prefill", "both") else engine_id + DECODE_ID_SUFFIX
    if not engine_id or len(internal.encode()) > _MAX_ID_BYTES:
        raise _kvferry.InvalidArgumentError(
            f"engine_id must be a non-empty string of at most "
            f"{_MAX_ID_BYTES - len(DECODE_ID_SUFFIX)} bytes, found {engine_id!r:.80}")
    return internal


def vllm_host_ip(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """This host's address as vLLM reports it (vllm.utils get_ip: VLLM_HOST_IP, else the
    outbound interface's address), which the reference matches against the rank table's
    server_id; VLLM_HOST_IP where vLLM is not importable; None without either."""
    for module in ("vllm.utils.network_utils", "vllm.utils"):
        try:  # pragma: no cover - with vLLM
            get_ip = getattr(__import__(module, fromlist=["get_ip"]), "get_ip")
            return str(get_ip())
        except Exception:
            continue
    return environ.get("VLLM_HOST_IP") or None


def server_id(extra: Mapping[str, Any], rank_table: str, host: str) -> str:
    """The server id this worker's rank-table entry is found by: kv_connector_extra_config's
    server_id; with a rank table, this host's address as vLLM reports it (the reference's
    get_ip()), since the table lists hosts by address and `host` is a bind address (127.0.0.1
    by default); else `host`."""
    if extra.get("server_id"):
        return str(extra["server_id"])
    if rank_table:
        return vllm_host_ip() or host
    return host


def npu_unavailable_message(memory: str, native: str) -> str:
    """The refusal of NPU caches kvferry cannot open (no CANN runtime, no device), in a
    vllm-ascend user's terms: what was found, then the two ways out they have."""
    found = re.sub(r"[.;]\s*(To use NPU memory, )?install CANN and source its set_env\.sh.*$",
                   "", native.strip(), flags=re.S)
    return (f"register_kv_caches: the KV caches are {memory} memory, which kvferry moves itself "
            f"through CANN's ACL runtime (libascendcl.so), and that failed: {found}. Either run "
            "this vLLM worker where CANN is installed and its set_env.sh sourced before vLLM "
            "starts (libascendcl.so on LD_LIBRARY_PATH) and the NPU is visible "
            "(ASCEND_RT_VISIBLE_DEVICES naming it; npu-smi info lists it), or set "
            "\"kv_buffer_device\": \"cpu\" instead of \"npu\" in --kv-transfer-config on both "
            "instances (host-buffer mode: kvferry moves host copies of the caches and torch "
            "copies the blocks to and from the NPU)")
