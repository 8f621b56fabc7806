"""Stand-in for sglang/srt/disaggregation/base/conn.py at alphabetc1/sglang d6a0fe41 (the
dynamic-backend fork; unchanged from its base 3619ec61): KVArgs as a bare annotated class, KVPoll's
int constants, the abstract bases with the fork's signatures. Written for kvferry's tests from
that file; SGLang cannot be installed here (no PyPI)."""
from abc import ABC, abstractmethod
from typing import List, Optional


class KVArgs:  # a plain class: reading a field nobody set raises AttributeError, as in SGLang
    engine_rank: int
    kv_data_ptrs: List[int]
    kv_data_lens: List[int]
    kv_item_lens: List[int]
    aux_data_ptrs: List[int]
    aux_data_lens: List[int]
    aux_item_lens: List[int]
    state_data_ptrs: List[int]
    state_data_lens: List[int]
    state_item_lens: List[int]
    state_type: str
    ib_device: str
    ib_traffic_class: str
    gpu_id: int
    decode_tp_size: int
    kv_head_num: int
    page_size: int
    prefill_pp_size: int
    pp_rank: int
    prefill_start_layer: int
    system_dp_rank: int


class KVPoll:
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class BaseKVManager(ABC):
    @abstractmethod
    def __init__(self, args: KVArgs, disaggregation_mode, server_args,
                 is_mla_backend: Optional[bool] = False): ...


class BaseKVSender(ABC):
    @abstractmethod
    def __init__(self, mgr: BaseKVManager, bootstrap_addr: str, bootstrap_room: int,
                 dest_tp_ranks: List[int], pp_rank: int): ...

    @abstractmethod
    def init(self, num_kv_indices: int, aux_index: Optional[int] = None): ...

    @abstractmethod
    def send(self, kv_indices, state_indices: Optional[List[int]] = None): ...

    @abstractmethod
    def poll(self) -> KVPoll: ...

    @abstractmethod
    def failure_exception(self): ...


class BaseKVReceiver(ABC):
    @abstractmethod
    def __init__(self, mgr: BaseKVManager, bootstrap_addr: str,
                 bootstrap_room: Optional[int] = None): ...

    @abstractmethod
    def init(self, kv_indices, aux_index: Optional[int] = None,
             state_indices: Optional[List[int]] = None): ...

    @abstractmethod
    def poll(self) -> KVPoll: ...

    @abstractmethod
    def failure_exception(self): ...

    def clear(self): pass

    def abort(self): pass


class BaseKVBootstrapServer(ABC):
    @abstractmethod
    def __init__(self, host: str, port: int): ...
