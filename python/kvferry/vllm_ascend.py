"""What the vLLM adapter reads the way vllm-ascend's LLM-DataDist and Mooncake connectors do.

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

vllm-ascend removed that connector (PR 4780, December 2025); its users now configure
``MooncakeConnectorV1``, ``MooncakeLayerwiseConnector`` or ``MooncakeHybridConnector``
(vllm_ascend/distributed/kv_transfer/kv_p2p/). Their tutorials' config::

    {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": "30000",
     "kv_connector_extra_config": {"prefill": {"dp_size": 1, "tp_size": 1},
                                   "decode": {"dp_size": 1, "tp_size": 1}}}

works here too with only ``kv_connector`` and ``kv_connector_module_path`` changed: an extra config
with "prefill" or "decode" is read as theirs (`mooncake_placement`). Then the base port is kv_port
and the address vLLM's get_ip(), as there, and the LLM-DataDist variables are refused rather
than silently overriding them; each worker listens on Mooncake's handshake port (kv_port +
dp_rank * tp * pp + pp_rank * tp + tp_rank, which is kvferry's own arithmetic), and the entry of
this instance's role must describe its parallel sizes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from . import _kvferry

DEFAULT_BASE_PORT = 5557  # the reference's VLLM_ASCEND_LLMDD_RPC_PORT default
VLLM_DEFAULT_KV_PORT = 14579  # vLLM's KVTransferConfig.kv_port default, which Mooncake's uses
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
    """The port TP rank 0 of DP rank 0 listens on (worker r of pipeline stage s of DP rank d:
    base + (d * pp + s) * tp + r). In order: kv_connector_extra_config's base_port;
    VLLM_ASCEND_LLMDD_RPC_PORT, where the LLM-DataDist reference listens (its tutorial gives two
    instances of one host different values and the same kv_port, so this comes before kv_port);
    KVTransferConfig's kv_port (vLLM's default 14579 when unset there); 5557. A Mooncake
    connector's config (`is_mooncake`) takes kv_port, as the Mooncake connectors do, and refuses
    VLLM_ASCEND_LLMDD_RPC_PORT (`refuse_llmdd_variable`)."""
    if extra.get("base_port") is not None:
        return _port(extra["base_port"], "kv_connector_extra_config.base_port")
    if is_mooncake(extra):
        refuse_llmdd_variable("VLLM_ASCEND_LLMDD_RPC_PORT", environ)
        if kv_port is None or kv_port == "":
            return VLLM_DEFAULT_KV_PORT
        return _port(kv_port, "kv_transfer_config.kv_port")
    if environ.get("VLLM_ASCEND_LLMDD_RPC_PORT"):
        return _port(environ["VLLM_ASCEND_LLMDD_RPC_PORT"], "VLLM_ASCEND_LLMDD_RPC_PORT")
    if kv_port is not None and kv_port != "":
        return _port(kv_port, "kv_transfer_config.kv_port")
    return DEFAULT_BASE_PORT


def listen_host(extra: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> str:
    """The address workers listen on and kv_transfer_params advertise: kv_connector_extra_config's
    host; for the LLM-DataDist config VLLM_ASCEND_LLMDD_RPC_IP, else 127.0.0.1; for a Mooncake
    connector's config this host's address as vLLM's get_ip() gives it (VLLM_HOST_IP, else the
    outbound interface), where the Mooncake connectors listen and which they advertise as
    remote_host, else 127.0.0.1 (VLLM_ASCEND_LLMDD_RPC_IP refused). KVFERRY_HOST in a worker's
    environment overrides them all, and "host": "auto" is this host's address as vLLM's get_ip()
    gives it: where an instance's ranks run on several hosts, each listens on its own
    (the scheduler learns them from vLLM's handshake metadata, KvferryConnector.
    set_xfer_handshake_metadata_pp_aware)."""
    if environ.get("KVFERRY_HOST"):
        return environ["KVFERRY_HOST"]
    if str(extra.get("host", "")) == "auto":
        ip = vllm_host_ip(environ)
        if not ip:
            raise _kvferry.InvalidArgumentError(
                'kv_connector_extra_config "host": "auto" asks for this host\'s address as '
                "vLLM's get_ip() gives it, but vLLM is not importable and VLLM_HOST_IP is not "
                "set; set VLLM_HOST_IP or KVFERRY_HOST, or name the host")
        return ip
    if extra.get("host") is not None:
        return str(extra["host"])
    if is_mooncake(extra):
        refuse_llmdd_variable("VLLM_ASCEND_LLMDD_RPC_IP", environ)
        return vllm_host_ip(environ) or "127.0.0.1"
    return environ.get("VLLM_ASCEND_LLMDD_RPC_IP") or "127.0.0.1"


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


# ------------------------------------------------------------------- Mooncake connectors' config

# What vllm-ascend's Mooncake connectors read from kv_connector_extra_config["prefill"] and
# ["decode"] (MooncakeConnectorWorker._get_prefill_decode_size in mooncake_connector.py and
# mooncake_hybrid_connector.py; ascend_config.py and utils.check_kv_extra_config read tp_size
# and dp_size): dp_size and tp_size required, pp_size 1 by default, pp_layer_partition (prefill).
_SIDE_KEYS = ("dp_size", "tp_size", "pp_size", "pp_layer_partition")
_MAX_TP = 256  # kvferry's kMaxTpSize (cache_spec.h), for TP and PP sizes alike
_MAX_DP = 65535  # a DP rank's block of ports must fit below port 65535 anyway
# Top-level keys of their tutorials that mean nothing to kvferry pass through unread:
# use_ascend_direct (read by no connector since vllm-ascend PR 4547; kvferry picks its own
# transport), tls_config (MooncakeLayerwiseConnector's client of the layer-wise proxy's
# metaserver, which kvferry never calls), ascend_local_comm_res_path (read by vllm-ascend itself,
# utils.setup_ascend_local_comm_res, for any connector).


@dataclass(frozen=True)
class MooncakeSide:
    """One role's entry of a Mooncake connector's extra config: that instance's DP, TP and PP
    sizes, as its vLLM runs it."""

    dp_size: int
    tp_size: int
    pp_size: int


@dataclass(frozen=True)
class MooncakePlacement:
    """Both roles' entries ("prefill", "decode"), which every instance's config carries."""

    prefill: MooncakeSide
    decode: MooncakeSide


def is_mooncake(extra: Mapping[str, Any]) -> bool:
    """Whether kv_connector_extra_config is a Mooncake connector's: it has "prefill" or
    "decode" (their workers assert both; the LLM-DataDist connector and kvferry have neither)."""
    return "prefill" in extra or "decode" in extra


def refuse_llmdd_variable(name: str, environ: Mapping[str, str] = os.environ) -> None:
    """With a Mooncake connector's config, a variable only the LLM-DataDist connector read would
    silently move where kvferry listens (the Mooncake connectors ignore it): refused."""
    if environ.get(name):
        setting = "base_port" if name.endswith("PORT") else "host"
        where = "kv_port" if name.endswith("PORT") else "vLLM's get_ip() (VLLM_HOST_IP)"
        raise _kvferry.InvalidArgumentError(
            f"{name} is set ({environ[name]!r}), but kv_connector_extra_config is a Mooncake "
            f"connector's (it has \"prefill\"/\"decode\"), which never reads {name}: kvferry "
            f"listens where the Mooncake connectors do, {where}. Unset {name} (it belonged to "
            f"the LLM-DataDist connector vllm-ascend removed), or set kv_connector_extra_config "
            f"\"{setting}\" to choose the {'port' if setting == 'base_port' else 'address'}")


def _size(value: Any, where: str, bound: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
        raise _kvferry.InvalidArgumentError(
            f"kv_connector_extra_config.{where} must be an integer 1..{bound}, found {value!r}")
    return value


def _side(extra: Mapping[str, Any], name: str) -> MooncakeSide:
    entry = extra.get(name)
    if not isinstance(entry, Mapping):
        raise _kvferry.InvalidArgumentError(
            f"kv_connector_extra_config has \"{'decode' if name == 'prefill' else 'prefill'}\" "
            f"but \"{name}\" is {entry!r}: a Mooncake connector's config describes both roles, "
            f"each {{\"dp_size\": N, \"tp_size\": N}} (pp_size optional), as vllm-ascend's "
            "tutorials write it")
    unknown = sorted(str(k) for k in entry if k not in _SIDE_KEYS)
    if unknown:
        raise _kvferry.InvalidArgumentError(
            f"kv_connector_extra_config.{name} has {', '.join(map(repr, unknown))}, which kvferry "
            f"does not know; the Mooncake connectors read {', '.join(_SIDE_KEYS)} there. Remove "
            "it, or tell kvferry's maintainers what it means")
    for key in ("dp_size", "tp_size"):
        if key not in entry:
            raise _kvferry.InvalidArgumentError(
                f"kv_connector_extra_config.{name} has no {key}; the Mooncake connectors require "
                f"dp_size and tp_size in both \"prefill\" and \"decode\" (found "
                f"{dict(entry)!r})")
    return MooncakeSide(_size(entry["dp_size"], f"{name}.dp_size", _MAX_DP),
                        _size(entry["tp_size"], f"{name}.tp_size", _MAX_TP),
                        _size(entry.get("pp_size", 1), f"{name}.pp_size", _MAX_TP))


def mooncake_placement(extra: Mapping[str, Any]) -> Optional[MooncakePlacement]:
    """Both roles' entries of a Mooncake connector's extra config, checked; None for any other
    config. Refused, saying what to change: an entry missing or not an object, dp_size or
    tp_size missing, sizes that are not positive integers, keys the Mooncake connectors do not
    read. Pipeline sizes may differ (Mooncake's decode, pp_size 1, reads every stage of a
    pipelined prefill; kvferry reads each decode stage's layers from the prefill stages holding
    them, whatever the two sizes). pp_layer_partition is ignored: kvferry reads each stage's
    layers from vLLM's layer names, and a layer no prefill stage holds fails the load before any
    byte moves."""
    if not is_mooncake(extra):
        return None
    return MooncakePlacement(_side(extra, "prefill"), _side(extra, "decode"))


def check_mooncake_placement(placement: MooncakePlacement, native_role: str, tp_size: int,
                             dp_size: Optional[int], pp_size: int,
                             context_parallel: tuple[Optional[int], Optional[int]] = (1, 1)
                             ) -> None:
    """The entry of this instance's role ("prefill" for kv_producer, "decode" for kv_consumer,
    both for kv_both) must describe this instance, as vllm-ascend's check_kv_extra_config
    requires of TP and DP sizes: the Mooncake connectors size their pulls from these entries,
    and a decode instance's reads follow the prefill's. dp_size None: not known (no vLLM
    parallel config), not checked. `context_parallel`: vLLM's prefill and decode
    context-parallel sizes, which must be 1 (None: not known): the Mooncake connectors' ports
    count PCP ranks too (kv_port + dp_rank * tp * pp * pcp + ...), and kvferry moves no
    context-parallel caches."""
    for name, size in zip(("prefill_context_parallel_size", "decode_context_parallel_size"),
                          context_parallel):
        if size is not None and size != 1:
            raise _kvferry.InvalidArgumentError(
                f"vLLM's {name} is {size}; kvferry moves caches of context-parallel size 1 only "
                "(each rank's blocks hold every token of its heads), and the Mooncake "
                "connectors' ports for it are not kvferry's. Run this instance without context "
                "parallelism")
    names = {"prefill": ("prefill",), "decode": ("decode",), "both": ("prefill", "decode")}
    for name in names[native_role]:
        side: MooncakeSide = getattr(placement, name)
        for key, want in (("tp_size", tp_size), ("dp_size", dp_size), ("pp_size", pp_size)):
            if want is not None and getattr(side, key) != want:
                what = {"tp_size": "tensor", "dp_size": "data", "pp_size": "pipeline"}[key]
                raise _kvferry.InvalidArgumentError(
                    f"kv_connector_extra_config.{name}.{key} is {getattr(side, key)}, but this "
                    f"{name} instance runs {what}-parallel size {want}: the \"{name}\" entry "
                    f"must describe the {name} instances. Set it to {want} in every instance's "
                    "config (or run vLLM with the size it says)")
