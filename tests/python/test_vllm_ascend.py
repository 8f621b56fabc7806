"""kvferry.vllm on Ascend (issue 22 item 3), in one process: torch_npu tensors register as npu:N
memory, vllm-ascend's per-layer tuples are read with the right geometry or refused naming the
shape, the refusal without CANN names what a vllm-ascend user can do, host-buffer mode copies
NPU blocks with torch, and the LLM-DataDist connector's kv_transfer_config (kv_port, engine_id
"0" on both instances, the rank-table variable) works as it is. The multi-process cases (TP
2 -> 1 and 2 -> 2, the tutorial's config end to end, NPU memory of the fake CANN runtime) are
in test_vllm_harness.py."""
import ctypes
import json
import os
import re
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

import kvferry
import kvferry.vllm
import kvferry.vllm_ascend
import kvferry.vllm_layout
from kvferry.vllm_layout import CacheLayoutError
from common import free_port
from fake_devices import FakeNpuTensor
from test_vllm_adapter import (BS, DIM, HEADS, NB, Blocks, config, offer_and_load, poll,
                               refused_registration, request)

LORA, ROPE, INDEXER = 24, 8, 128
ALIGN = 2 << 20  # vllm-ascend allocates each part 2 MiB-aligned when a connector is configured


class NpuDevice(SimpleNamespace):
    """torch_npu's torch.device("npu:N"): type, index, str()."""

    def __str__(self):
        return f"{self.type}:{self.index}"


class NpuTensor:
    """A torch_npu tensor as the adapter reads one, without torch: device type "npu" and index,
    data_ptr() an address that is not host memory, shape, strides, dtype, element size."""

    def __init__(self, shape, address, dtype="torch.bfloat16", itemsize=2, strides=None,
                 index=0):
        self.shape, self.dtype, self.address = tuple(shape), dtype, address
        self.device, self._itemsize = NpuDevice(type="npu", index=index), itemsize
        if strides is None:  # contiguous
            strides, step = [], 1
            for n in reversed(self.shape):
                strides.insert(0, step)
                step *= n
        self._strides = tuple(strides)

    def data_ptr(self):
        return self.address

    def stride(self):
        return self._strides

    def element_size(self):
        return self._itemsize


def npu(shape, part=0, layer=0, **kw):
    """One part of a layer, in its own 2 MiB-aligned buffer."""
    return NpuTensor(shape, 0x7F0000000000 + layer * 8 * ALIGN + part * ALIGN, **kw)


def kv(heads=HEADS, nb=NB, bs=BS, layer=0, **kw):  # (k_cache, v_cache)
    return tuple(npu((nb, bs, heads, DIM), p, layer, **kw) for p in range(2))


def mla(layer=0, nb=NB, bs=BS, **kw):  # (nope_cache, rope_cache)
    return (npu((nb, bs, 1, LORA), 0, layer, **kw), npu((nb, bs, 1, ROPE), 1, layer, **kw))


def sfa(layer=0, **kw):  # DeepSeek sparse attention: (nope, rope, indexer_k)
    return mla(layer, **kw) + (npu((NB, BS, 1, INDEXER), 2, layer, **kw),)


PACKED = LORA + 2 * ROPE + 4 * (LORA // 8)  # sparse C8: nope int8, rope bf16, fp32 scales


def read(caches, tp=1, heads=HEADS, block_size=BS, split=None):
    return kvferry.vllm_layout.read_caches(caches, block_size, heads, tp, False, split)


def layers(make, n=2, **kw):
    return {f"model.layers.{i}.self_attn.attn": make(layer=i, **kw) for i in range(n)}


# ------------------------------------------------------------------- shapes and geometry

def test_mha_pair_is_token_major_npu_memory_with_each_part_its_own_buffer():
    caches = layers(kv)
    reg = read(caches)
    assert (reg.kind, reg.layout, reg.memory, reg.dtype) == ("mha", "token_major", "npu:0", "bf16")
    assert reg.parts == [("k", HEADS, DIM), ("v", HEADS, DIM)]
    assert (reg.local_heads, reg.num_blocks, reg.tokens_per_block) == (HEADS, NB, BS)
    assert reg.bases == [[t.address for t in c] for c in caches.values()]
    assert all(b % ALIGN == 0 for layer in reg.bases for b in layer)
    assert reg.block_strides == () and reg.kernel_blocks_per_block == 1


def test_mha_pair_under_tp_holds_this_ranks_heads_of_the_models():
    reg = read(layers(kv, heads=HEADS // 2), tp=2)
    assert reg.parts == [("k", HEADS, DIM), ("v", HEADS, DIM)] and reg.local_heads == HEADS // 2


def test_mha_pair_with_kernel_blocks_smaller_than_vllms():
    # vllm-ascend's hybrid blocks: get_kv_cache_shape(num_blocks * chunk, kernel block size, ...)
    reg = read(layers(kv, nb=2 * NB, bs=BS // 2))
    assert (reg.layout, reg.num_blocks, reg.tokens_per_block) == ("token_major", NB, BS)
    assert reg.kernel_blocks_per_block == 2


def test_int8_pair_of_rows_is_the_mha_pair_it_flattens():
    # additional_config kv_cache_dtype "int8": get_bsh_kv_cache_shape, (nb, bs, heads * head).
    bsh = read({"l0": tuple(npu((NB, BS, HEADS * DIM), p, dtype="torch.int8", itemsize=1)
                            for p in range(2))})
    flat = read({"l0": kv(dtype="torch.int8", itemsize=1)})
    assert (bsh.kind, bsh.layout, bsh.parts, bsh.local_heads) == (
        "mha", "token_major", [("k:fp8", HEADS, DIM), ("v:fp8", HEADS, DIM)], HEADS)
    assert (bsh.parts, bsh.num_blocks, bsh.local_heads) == (flat.parts, flat.num_blocks,
                                                            flat.local_heads)


def test_mla_pair_has_the_models_widths_replicated():
    reg = read(layers(mla), heads=1, split=(LORA, ROPE))
    assert (reg.kind, reg.layout, reg.memory) == ("mla", "token_major", "npu:0")
    assert reg.parts == [("latent", 1, LORA), ("rope", 1, ROPE)]
    assert (reg.local_heads, reg.num_blocks, reg.fields) == (1, NB, ())


def test_sparse_attention_adds_the_indexer_keys():
    reg = read(layers(sfa), heads=1, split=(LORA, ROPE))
    assert (reg.kind, reg.layout) == ("sparse_mla", "token_major")
    assert reg.parts == [("latent", 1, LORA), ("rope", 1, ROPE), ("indexer", 1, INDEXER)]
    assert len(reg.bases[0]) == 3


def test_one_part_layers_are_one_replicated_row_per_token():
    # (k_cache,): sparse C8's packed row (nope bytes, rope and scales), int8.
    packed = read({"l0": (npu((NB, BS, 1, PACKED), dtype="torch.int8", itemsize=1),)},
                  heads=1, split=(LORA, ROPE))
    assert (packed.kind, packed.layout, packed.parts, packed.fields) == (
        "mla_fused", "token_major", [("packed:fp8", 1, PACKED)], (LORA, PACKED - LORA))
    # A row of exactly kv_lora_rank + qk_rope_head_dim is vLLM's fused MLA row.
    fused = read({"l0": (npu((NB, BS, 1, LORA + ROPE)),)}, heads=1, split=(LORA, ROPE))
    assert (fused.kind, fused.parts, fused.fields) == (
        "mla_fused", [("latent_rope", 1, LORA + ROPE)], (LORA, ROPE))


@pytest.mark.parametrize("caches, split, words", [
    ({"l0": mla()}, (LORA + 8, ROPE), "kv_lora_rank 32"),
    ({"l0": (npu((NB, BS, 2, DIM)), npu((NB, BS, 4, DIM), 1))}, None, "one shape"),
    ({"l0": (npu((NB, BS, HEADS, DIM, 2)), npu((NB, BS, HEADS, DIM, 2), 1))}, None,
     "must be (num_blocks, block_size, heads, dim)"),
    ({"l0": (npu((NB, BS, HEADS, DIM), strides=(BS * HEADS * DIM * 2, HEADS * DIM * 2, DIM, 1)),
             npu((NB, BS, HEADS, DIM), 1))}, None, "contiguous"),
    ({"l0": mla() + (npu((NB, BS, 2, INDEXER), 2),)}, (LORA, ROPE), "dim 2 is 2, not 1"),
    ({"l0": kv() + kv()}, None, "4 parts per layer"),
    ({"l0": (npu((NB, BS, 1, PACKED)),)}, None, "kv_lora_rank"),
    ({"l0": (npu((NB, BS, 1, LORA - 1)),)}, (LORA, ROPE), "not above the model's kv_lora_rank"),
    ({"l0": kv(heads=3)}, None, f"this rank's {HEADS} KV heads"),
    ({"l0": kv(nb=NB, bs=3)}, None, "or a divisor"),
    ({"l0": (npu((NB, BS, 1, LORA)), npu((NB + 1, BS, 1, ROPE), 1))}, (LORA, ROPE),
     "block count differs"),
], ids=["mla_widths_not_the_models", "k_and_v_of_different_heads", "five_dims", "strided_part",
        "indexer_with_two_heads", "four_parts", "one_part_without_model_split",
        "one_part_narrower_than_lora", "heads_not_the_models", "block_size_not_a_divisor",
        "block_counts_differ"])
def test_wrong_shapes_are_refused_naming_what_was_found(caches, split, words):
    with pytest.raises(CacheLayoutError, match=re.escape(words)) as e:
        read(caches, heads=HEADS if split is None else 1, split=split)
    assert "shape (" in str(e.value) and "npu:0" in str(e.value), str(e.value)


def test_int8_rows_without_the_models_head_count_are_refused():
    caches = {"l0": tuple(npu((NB, BS, HEADS * DIM), p, dtype="torch.int8", itemsize=1)
                          for p in range(2))}
    with pytest.raises(CacheLayoutError, match="KV head count"):
        kvferry.vllm_layout.read_caches(caches, BS, None, 1, False, None)


def test_npu_tensors_in_a_private_format_are_refused_in_device_mode(monkeypatch):
    # vllm-ascend casts caches to FRACTAL_NZ (ACL format 29) on some SoCs: not laid out as the
    # strides say. torch_npu.get_npu_format tells; host-buffer mode (torch copies) is the way.
    formats = {}
    fake = types.ModuleType("torch_npu")
    fake.get_npu_format = lambda t: formats.get(id(t), 2)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    caches = layers(kv)
    assert read(caches).memory == "npu:0"  # ND: accepted
    formats[id(caches["model.layers.1.self_attn.attn"][1])] = 29
    with pytest.raises(CacheLayoutError, match="ACL format 29") as e:
        read(caches)
    assert '"kv_buffer_device": "cpu"' in str(e.value)


# ------------------------------------------------------------------- without CANN

def _cann_loads():
    if os.environ.get("KVFERRY_ACL_LIBRARY"):
        return True
    try:
        ctypes.CDLL("libascendcl.so")
    except OSError:
        return False
    return True


def test_npu_refusal_without_cann_names_what_a_vllm_ascend_user_can_do():
    if _cann_loads():
        pytest.skip("SKIPPED: libascendcl.so loads here (or KVFERRY_ACL_LIBRARY is set), so the "
                    "no-CANN refusal cannot happen (test_npu_refusal_is_rewritten still runs)")
    cfg = config("kv_producer", free_port(), buffer_device="npu")
    w = kvferry.vllm.KvferryConnector(cfg, "WORKER")
    with pytest.raises(kvferry.UnavailableError) as e:
        w.register_kv_caches(layers(kv))
    message = str(e.value)
    assert "npu:0" in message and "libascendcl.so" in message, message  # what was found
    assert "set_env.sh" in message and "ASCEND_RT_VISIBLE_DEVICES" in message, message
    assert '"kv_buffer_device": "cpu" instead of "npu"' in message, message
    assert "keep the KV cache in host memory" not in message, message  # the CLI's wording


@pytest.mark.parametrize("native", [
    "region 0: no NPU runtime: libascendcl.so (Huawei CANN's ACL runtime) could not be loaded. "
    "Tried libascendcl.so: cannot open shared object file (a bare name is looked for in "
    "LD_LIBRARY_PATH, which is empty). To use NPU memory, install CANN and source its "
    "set_env.sh before starting the process, or keep the KV cache in host memory "
    "(kv_buffer_device \"cpu\")",
    "region 0: no NPU device: the ACL runtime (libascendcl.so) reports 0 devices "
    "(ASCEND_RT_VISIBLE_DEVICES applies)",
], ids=["no_cann", "no_device"])
def test_npu_refusal_is_rewritten_for_vllm_ascend_users(monkeypatch, native):
    message = refused_registration(monkeypatch, layers(kv), "npu:0", native)
    assert native.split(": ", 2)[2][:40] in message, message  # what was found, kept
    assert "CANN is installed" in message and '"kv_buffer_device": "cpu"' in message
    assert "To use NPU memory" not in message


# ------------------------------------------------------------------- the seed's config

def seed_config(role, kv_port="20001", buffer_device="npu", engine_id="0"):
    """vllm-ascend's tutorial kv_transfer_config for its LLM-DataDist connector, the connector's
    name and module path changed; nothing else (no extra config)."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector="KvferryConnector", kv_connector_module_path="kvferry.vllm",
            kv_buffer_device=buffer_device, kv_role=role, kv_parallel_size=1, kv_port=kv_port,
            engine_id=engine_id),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
        cache_config=SimpleNamespace(block_size=BS),
        model_config=SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: HEADS))


def settings(cfg):
    return kvferry.vllm.KvferryConnector(cfg, "SCHEDULER")._settings


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("VLLM_ASCEND_LLMDD_RPC_PORT", "VLLM_ASCEND_LLMDD_RPC_IP", "VLLM_HOST_IP",
                 "DISAGGREGATED_PREFILL_RANK_TABLE_PATH", "ASCEND_RT_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_kv_port_is_the_base_port_after_base_port_and_the_references_variable(clean_env):
    assert settings(seed_config("kv_producer", "20001")).base_port == 20001  # quoted, as there
    assert settings(seed_config("kv_producer", 20002)).base_port == 20002
    assert settings(seed_config("kv_producer", None)).base_port == 5557
    cfg = seed_config("kv_producer", "20001")
    cfg.kv_transfer_config.kv_connector_extra_config = {"base_port": 6000}
    assert settings(cfg).base_port == 6000
    # The tutorial runs both instances on one host with one kv_port and each its own
    # VLLM_ASCEND_LLMDD_RPC_PORT, where the reference listens.
    clean_env.setenv("VLLM_ASCEND_LLMDD_RPC_PORT", "5959")
    assert settings(seed_config("kv_producer", "20001")).base_port == 5959
    clean_env.setenv("VLLM_ASCEND_LLMDD_RPC_PORT", "59x9")
    with pytest.raises(kvferry.InvalidArgumentError, match="VLLM_ASCEND_LLMDD_RPC_PORT"):
        settings(seed_config("kv_producer"))
    clean_env.delenv("VLLM_ASCEND_LLMDD_RPC_PORT")
    for bad in ("2000l", "70000", True):
        with pytest.raises(kvferry.InvalidArgumentError, match="kv_port"):
            settings(seed_config("kv_producer", bad))


def test_each_role_has_its_own_engine_id_inside_kvferry(clean_env):
    assert settings(seed_config("kv_producer")).engine_id == "0"  # what params and proxies name
    assert settings(seed_config("kv_consumer")).engine_id == "0@decode"
    with pytest.raises(kvferry.InvalidArgumentError, match="engine_id"):
        settings(seed_config("kv_consumer", engine_id="x" * 1020))


def test_the_rank_table_is_searched_by_vllms_host_address(clean_env, tmp_path):
    # The reference matches the table's server_id against vLLM's get_ip(); kvferry's host is a
    # bind address (127.0.0.1 by default), so it asks vLLM too.
    clean_env.setenv("DISAGGREGATED_PREFILL_RANK_TABLE_PATH", str(tmp_path / "t.json"))
    utils = types.ModuleType("vllm.utils")
    utils.get_ip = lambda: "10.1.2.3"
    clean_env.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    clean_env.setitem(sys.modules, "vllm.utils", utils)
    assert settings(seed_config("kv_producer")).server_id == "10.1.2.3"
    clean_env.delitem(sys.modules, "vllm.utils")
    clean_env.setenv("VLLM_HOST_IP", "10.4.5.6")  # vLLM's variable, without vLLM
    assert settings(seed_config("kv_producer")).server_id == "10.4.5.6"
    cfg = seed_config("kv_producer")
    cfg.kv_transfer_config.kv_connector_extra_config = {"server_id": "node-7"}
    assert settings(cfg).server_id == "node-7"
    clean_env.delenv("DISAGGREGATED_PREFILL_RANK_TABLE_PATH")
    assert settings(seed_config("kv_producer")).server_id == "127.0.0.1"  # no table: the host


def write_rank_table(path):
    def entry(device):
        return {"server_id": "127.0.0.1", "device_id": str(device), "device_ip": "127.0.0.1",
                "cluster_id": str(device + 1)}
    path.write_text(json.dumps({"version": "1.0", "server_count": "1", "status": "completed",
                                "prefill_device_list": [entry(0)],
                                "decode_device_list": [entry(1), entry(2)]}))
    return str(path)


def seed_instance(monkeypatch, role, port, visible, table):
    """One instance of the tutorial on this host: its own VLLM_ASCEND_LLMDD_RPC_PORT and
    devices, read when its connectors are made; kv_buffer_device "cpu" (host-buffer mode: no
    CANN here)."""
    monkeypatch.setenv("VLLM_ASCEND_LLMDD_RPC_PORT", str(port))
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", visible)
    monkeypatch.setenv("DISAGGREGATED_PREFILL_RANK_TABLE_PATH", table)
    cfg = seed_config(role, buffer_device="cpu")
    return (kvferry.vllm.KvferryConnector(cfg, "SCHEDULER"),
            kvferry.vllm.KvferryConnector(cfg, "WORKER"))


MHA_PARTS = ((NB, BS, HEADS, DIM), (NB, BS, HEADS, DIM))


def npu_caches(torch, seed, shapes=MHA_PARTS, dtype=np.float16, layers_=2):
    """vllm-ascend caches on the "NPU": a tuple of parts of `shapes` per layer, random bytes in
    torch tensors kvferry never sees; returns them and the arrays by (layer, part)."""
    out, raw = {}, {}
    rng = np.random.default_rng(seed)
    for i in range(layers_):
        parts = []
        for p, shape in enumerate(shapes):
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            a = rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape)
            raw[(i, p)] = a
            parts.append(FakeNpuTensor(torch.from_numpy(a), 0x7F0000000000 + i * 8 * ALIGN
                                       + p * ALIGN))
        out[f"model.layers.{i}.self_attn.attn"] = tuple(parts)
    return out, raw


def check_loaded(p_raw, d_raw, d_before, remote, local):
    """Every decode NPU tensor holds the prefill's blocks in `local` and is untouched elsewhere."""
    for (layer, part), got in d_raw.items():
        for b in range(got.shape[0]):
            want = (p_raw[(layer, part)][remote[local.index(b)]] if b in local
                    else d_before[(layer, part)][b])
            np.testing.assert_array_equal(got[b], want)


def test_the_tutorials_config_with_engine_id_0_on_both_sides_moves_bytes(clean_env, tmp_path):
    torch = pytest.importorskip("torch", reason="Debian's python3-torch (make deps) is absent")
    table = write_rank_table(tmp_path / "ranktable.json")
    pport, dport = free_port(), free_port()
    p_sched, p_work = seed_instance(clean_env, "kv_producer", pport, "0", table)
    d_sched, d_work = seed_instance(clean_env, "kv_consumer", dport, "1", table)
    p_dev, p_raw = npu_caches(torch, 1)
    d_dev, d_raw = npu_caches(torch, 2)
    d_before = {k: v.copy() for k, v in d_raw.items()}
    p_work.register_kv_caches(p_dev)
    d_work.register_kv_caches(d_dev)
    remote, local = [12, 13, 3], [5, 6, 7]
    preq = request("r-0", {"do_remote_decode": True}, 3 * BS, "RUNNING")
    p_sched.update_state_after_alloc(preq, Blocks(remote), 0)
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    p_work.start_load_kv(None)
    p_work.wait_for_save()  # NPU -> host with torch: vllm-ascend hands over no copy op
    sides = {"kv_producer": (p_sched, p_work), "kv_consumer": (d_sched, d_work)}
    params = offer_and_load(sides, preq, remote, local, "d-0")
    assert (params["remote_engine_id"], params["remote_port"]) == ("0", pport)
    assert d_work.get_block_ids_with_load_errors() == set()
    check_loaded(p_raw, d_raw, d_before, remote, local)
    assert poll(lambda: p_work.get_finished({"r-0"})[0], "the release") == {"r-0"}


@pytest.mark.parametrize("shapes, dtype", [
    (((NB, BS, 1, LORA), (NB, BS, 1, ROPE)), np.float16),
    (((NB, BS, 1, LORA), (NB, BS, 1, ROPE), (NB, BS, 1, INDEXER)), np.float16),
    (((NB, BS, 1, PACKED),), np.int8),
    (((NB, BS, HEADS * DIM), (NB, BS, HEADS * DIM)), np.int8),
], ids=["mla", "sparse_mla", "packed_one_part", "int8_rows"])
def test_host_buffer_mode_moves_npu_tuples_copied_with_torch(shapes, dtype):
    # kv_buffer_device "cpu", no copy op from vllm-ascend: torch copies each part's blocks on
    # the NPU (index tensors made there, or the fake device refuses them) to the host mirrors
    # and back; every byte of the decode side's NPU tensors checked.
    torch = pytest.importorskip("torch", reason="Debian's python3-torch (make deps) is absent")
    mla_ = None if shapes[0][-1] == HEADS * DIM else (LORA, ROPE)
    sides = {}
    for role in ("kv_producer", "kv_consumer"):
        cfg = config(role, free_port(), buffer_device="cpu", mla=mla_)
        sides[role] = (kvferry.vllm.KvferryConnector(cfg, "SCHEDULER"),
                       kvferry.vllm.KvferryConnector(cfg, "WORKER"))
    (p_sched, p_work), (_, d_work) = sides["kv_producer"], sides["kv_consumer"]
    p_dev, p_raw = npu_caches(torch, 3, shapes, dtype)
    d_dev, d_raw = npu_caches(torch, 4, shapes, dtype)
    d_before = {k: v.copy() for k, v in d_raw.items()}
    p_work.register_kv_caches(p_dev)
    d_work.register_kv_caches(d_dev)
    assert d_work._registration.memory == "host"  # the mirrors, not the NPU tensors
    remote, local = [9, 2], [4, 11]
    preq = request("r-t", {"do_remote_decode": True}, 2 * BS, "RUNNING")
    p_sched.update_state_after_alloc(preq, Blocks(remote), 0)
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    p_work.wait_for_save()
    offer_and_load(sides, preq, remote, local, "d-t")
    assert d_work.get_block_ids_with_load_errors() == set()
    check_loaded(p_raw, d_raw, d_before, remote, local)


def test_a_decode_worker_is_never_taken_for_a_prefill_one_of_the_same_engine_id(clean_env,
                                                                                tmp_path):
    """Regression: with engine_id "0" on both roles (the tutorial's), a decode instance whose
    load names the port of another decode instance (a misconfigured proxy) passed the handshake
    ("engine 0") and read that instance's cache into its blocks; only the confirmation after
    the reads failed the load. Now a decode worker answers as "0@decode": the handshake refuses
    it before any byte moves, and the blocks are reported for recompute."""
    table = write_rank_table(tmp_path / "ranktable.json")
    pport, aport, bport = free_port(), free_port(), free_port()
    p_sched, p_work = seed_instance(clean_env, "kv_producer", pport, "0", table)
    a_sched, a_work = seed_instance(clean_env, "kv_consumer", aport, "1", table)
    _, b_work = seed_instance(clean_env, "kv_consumer", bport, "2", table)
    caches = {}  # every instance's (K, V) per layer, host memory; decode a's hold 0 and 1
    for name, work, fill in (("p", p_work, 7), ("a", a_work, 0), ("b", b_work, 2)):
        caches[name] = {f"l{i}": tuple(np.full((NB, BS, HEADS, DIM), fill + i, np.float16)
                                       for _ in range(2)) for i in range(2)}
        work.register_kv_caches(caches[name])
    preq = request("r-m", {"do_remote_decode": True}, 2 * BS, "FINISHED_LENGTH_CAPPED")
    delay, params = p_sched.request_finished(preq, [3, 4])
    assert delay
    misdirected = dict(params, remote_port=bport)  # decode instance b, engine_id "0" too
    dreq = request("d-m", misdirected, 2 * BS)
    assert a_sched.get_num_new_matched_tokens(dreq, 0) == (2 * BS, True)
    a_sched.update_state_after_alloc(dreq, Blocks([8, 9]), 2 * BS)
    a_work.bind_connector_metadata(a_sched.build_connector_meta(None))
    a_work.start_load_kv(None)
    assert poll(lambda: a_work.get_finished(set())[1], "the refused load") == {"d-m"}
    assert a_work.get_block_ids_with_load_errors() == {8, 9}
    for i in range(2):  # decode a's cache is as it was: b's bytes never landed
        for part in caches["a"][f"l{i}"]:
            assert (part == i).all()
