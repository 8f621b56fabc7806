"""Stand-in for sglang/srt/disaggregation/utils.py at alphabetc1/sglang d6a0fe41: the enums,
get_kv_class's dynamic branch, kv_to_page_indices / kv_to_page_num, MetadataBuffers (the
fork's nine aux tensors, host memory) and poll_and_all_reduce's MIN over the attention-TP ranks
(there a gloo all_reduce; here over the ranks' poll lists, which the stand-in scheduler gathers
from every rank in the same order each loop)."""
from enum import Enum
from typing import List

import numpy as np

FAKE_BOOTSTRAP_HOST = "2.2.2.2"


class DisaggregationMode(Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class TransferBackend(Enum):
    MOONCAKE = "mooncake"
    NIXL = "nixl"
    ASCEND = "ascend"
    FAKE = "fake"
    FILE = "file"
    DYNAMIC = "dynamic"


class KVClassType(Enum):
    KVARGS = "kvargs"
    MANAGER = "manager"
    SENDER = "sender"
    RECEIVER = "receiver"
    BOOTSTRAP_SERVER = "bootstrap_server"


def get_kv_class(transfer_backend: TransferBackend, class_type: KVClassType, server_args=None):
    if transfer_backend == TransferBackend.DYNAMIC:
        if server_args is None:
            raise ValueError("Dynamic transfer backend requires server_args to resolve extra "
                             "config.")
        from sglang.srt.disaggregation.backend_factory import DisaggBackendFactory
        return DisaggBackendFactory.get_kv_class(server_args, class_type)
    raise ValueError(f"Unsupported transfer backend: {transfer_backend}")


def poll_and_all_reduce(polls_per_rank: List[List[int]]) -> List[int]:
    counts = {len(p) for p in polls_per_rank}
    assert len(counts) == 1, f"every rank polls the same requests: {counts}"
    return [min(int(p[i]) for p in polls_per_rank) for i in range(counts.pop())]


def kv_to_page_indices(kv_indices: np.ndarray, page_size: int):
    if page_size == 1:
        return kv_indices
    return kv_indices[::page_size] // page_size


def kv_to_page_num(num_kv_indices: int, page_size: int):
    return (num_kv_indices + page_size - 1) // page_size


class MetadataBuffers:
    def __init__(self, size: int, hidden_size: int = 16, max_top_logprobs_num: int = 128):
        self.output_ids = np.zeros((size, 16), dtype=np.int32)
        self.cached_tokens = np.zeros((size, 16), dtype=np.int32)
        self.output_token_logprobs_val = np.zeros((size, 16), dtype=np.float32)
        self.output_token_logprobs_idx = np.zeros((size, 16), dtype=np.int32)
        self.output_top_logprobs_val = np.zeros((size, max_top_logprobs_num), dtype=np.float32)
        self.output_top_logprobs_idx = np.zeros((size, max_top_logprobs_num), dtype=np.int32)
        self.output_topk_p = np.zeros((size, 16), dtype=np.float32)
        self.output_topk_index = np.zeros((size, 16), dtype=np.int64)
        self.output_hidden_states = np.zeros((size, hidden_size), dtype=np.float32)

    def _all(self):
        return [self.output_ids, self.cached_tokens, self.output_token_logprobs_val,
                self.output_token_logprobs_idx, self.output_top_logprobs_val,
                self.output_top_logprobs_idx, self.output_topk_p, self.output_topk_index,
                self.output_hidden_states]

    def get_buf_infos(self):
        ptrs = [t.ctypes.data for t in self._all()]
        lens = [t.nbytes for t in self._all()]
        items = [t[0].nbytes for t in self._all()]
        return ptrs, lens, items
