"""SGLang's PD schedulers as kvferry's SGLang tests drive them: a stand-in written from
alphabetc1/sglang d6a0fe41 (docs/notes/sglang_interface.md), every rank of a server in this
process. What each piece follows:

- Server.__init__: disaggregation/prefill.py PrefillBootstrapQueue._init_kv_manager and
  decode.py DecodePreallocQueue._init_kv_manager (KVArgs field by field; the classes through
  utils.get_kv_class(TransferBackend.DYNAMIC, ..., server_args)); the bootstrap server as
  managers/disagg_service.py start_disagg_service builds it (prefill only).
- Prefill.add / pop_bootstrapped / send_kv_chunk / process_inflight: prefill.py
  PrefillBootstrapQueue.add, .pop_bootstrapped, SchedulerDisaggregationPrefillMixin.send_kv_chunk
  (a non-last chunk holds back its partial page; the last sets the aux row first) and
  .process_disagg_prefill_inflight_queue (Success or Failed end it; any other state after init is
  kept, Bootstrapping asserts).
- Decode.add / update_handshake_waiters / pop_preallocated / pop_transferred: decode.py
  DecodePreallocQueue.add (receiver built with prefill_dp_rank), ._update_handshake_waiters
  (Bootstrapping / WaitingForInput / Failed, anything else a ValueError), .pop_preallocated
  (pages, then init(page indices, aux index, None)), DecodeTransferQueue.pop_transferred (Success
  reads the aux row and calls clear()).
- Every poll goes through utils.poll_and_all_reduce over all attention-TP ranks, in the same
  order every loop; abort calls the sender's / receiver's abort as Scheduler.abort_request does.
"""
from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Optional

import numpy as np
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.utils import (DisaggregationMode, KVClassType, MetadataBuffers,
                                             TransferBackend, get_kv_class, kv_to_page_indices,
                                             kv_to_page_num, poll_and_all_reduce)

LAYERS, HEAD_DIM, MLA_ROW = 3, 8, 24


def kv_value(room: int, layer: int, part: int, token: int, width: int) -> np.ndarray:
    """The model-wide row (all heads) prefill writes for a token: any decode rank checks its
    slice of it."""
    base = (room * 7919 + layer * 131 + part * 17 + token * 3) % 1000
    return (np.arange(width, dtype=np.float32) + base).astype(np.float16)


def state_value(room: int, tensor: int, rank: int, width: int, dtype) -> np.ndarray:
    """A Mamba state slot's contents as prefill leaves it after the prompt."""
    return (np.arange(width) + (room * 31 + tensor * 7 + rank * 3) % 500).astype(dtype)


def server_args(port: int, bootstrap_port: int, tp: int, page_size: int, **cfg) -> SimpleNamespace:
    extra = dict({"backend_name": "kvferry", "module_path": "kvferry.sglang",
                  "class_name": "KvferryProvider", "memory": "host", "transport": "tcp",
                  "hold_lease_ms": 3000, "progress_timeout_s": 2, "waiting_timeout_s": 20,
                  "base_port": port}, **cfg)
    return SimpleNamespace(
        host="127.0.0.1", port=port, tp_size=tp, dp_size=1, pp_size=1,
        enable_dp_attention=False, page_size=page_size, dist_init_addr=None,
        disaggregation_bootstrap_port=bootstrap_port,
        disaggregation_transfer_backend="dynamic",
        disaggregation_transfer_backend_extra_config=json.dumps(extra))


class Rank:
    def __init__(self, server: "Server", tp_rank: int):
        s = server
        self.tp_rank = tp_rank
        tokens = (s.pages + 1) * s.page_size  # SGLang's pools keep one padding page
        if s.mla:
            self.bufs = [np.zeros((tokens, 1, MLA_ROW), np.float16) for _ in range(LAYERS)]
        else:
            self.heads = max(s.model_heads // s.tp, 1)
            self.bufs = [np.zeros((tokens, self.heads, HEAD_DIM), np.float16)
                         for _ in range(2 * LAYERS)]
        self.meta = MetadataBuffers(64)
        # Mamba (SGLang's HybridLinearKVPool / MambaPool): per layer a conv and a temporal state
        # tensor, one request's state per slot; get_state_buf_infos lists them flat.
        self.states = ([np.zeros((16, 2 * 8 // s.tp), np.float16) for _ in range(LAYERS)]
                       + [np.zeros((16, 4 * 8 // s.tp), np.float32) for _ in range(LAYERS)]
                       if s.mamba else [])
        self.free_slots = list(range(16))
        args = get_kv_class(TransferBackend.DYNAMIC, KVClassType.KVARGS, s.args)()
        args.engine_rank = tp_rank
        args.kv_data_ptrs = [b.ctypes.data for b in self.bufs]
        args.kv_data_lens = [b.nbytes for b in self.bufs]
        args.kv_item_lens = [b[0].nbytes * s.page_size for b in self.bufs]
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        args.state_data_ptrs = [t.ctypes.data for t in self.states]
        args.state_data_lens = [t.nbytes for t in self.states]
        args.state_item_lens = [t[0].nbytes for t in self.states]
        args.state_type = "mamba" if s.mamba else "none"
        args.ib_device = None
        args.gpu_id = tp_rank
        args.pp_rank = 0
        args.system_dp_rank = 0
        if s.mode == DisaggregationMode.PREFILL:
            args.decode_tp_size = 1
            args.prefill_pp_size = 1
            if not s.mla:
                args.kv_head_num = self.heads
            args.page_size = s.page_size
            args.prefill_start_layer = 0
        else:
            args.decode_tp_size = s.tp
            args.prefill_pp_size = 1
        manager_class = get_kv_class(TransferBackend.DYNAMIC, KVClassType.MANAGER, s.args)
        self.mgr = manager_class(args, s.mode, s.args, s.mla)
        self.free_pages = list(range(1, s.pages + 1))  # page 0 is SGLang's padding page
        self.free_meta = list(range(64))


class Req:
    def __init__(self, rid: str, room: int, prompt: int, host: str, bootstrap_port: int):
        self.rid, self.bootstrap_room, self.prompt = rid, room, prompt
        self.bootstrap_host, self.bootstrap_port = host, bootstrap_port
        self.senders: list = []  # one per rank (req.disagg_kv_sender on each rank's scheduler)
        self.pages: list[list[int]] = []
        self.meta_index: list[int] = []
        self.state_slot: list[int] = []  # Mamba: the request's state slot on each rank
        self.start_send_idx = 0
        self.finished: Optional[str] = None  # "ok", or the abort message
        self.first_token: Optional[int] = None


class Server:
    def __init__(self, mode: str, tp: int, port: int, bootstrap_port: int, mla: bool = False,
                 model_heads: int = 4, page_size: int = 4, pages: int = 64, mamba: bool = False,
                 start_bootstrap: bool = True, **cfg):
        self.mamba = mamba
        self.mode = (DisaggregationMode.PREFILL if mode == "prefill"
                     else DisaggregationMode.DECODE)
        self.tp, self.mla, self.model_heads, self.page_size, self.pages = (
            tp, mla, model_heads, page_size, pages)
        self.args = server_args(port, bootstrap_port, tp, page_size, **cfg)
        self.bootstrap = None
        if self.mode == DisaggregationMode.PREFILL and start_bootstrap:
            cls = get_kv_class(TransferBackend.DYNAMIC, KVClassType.BOOTSTRAP_SERVER, self.args)
            self.bootstrap = cls(host="127.0.0.1", port=bootstrap_port)
        self.ranks = [Rank(self, r) for r in range(tp)]
        self.queue: list[Req] = []      # prefill bootstrap queue / decode prealloc queue
        self.running: list[Req] = []    # prefill: prefilling; decode: transfer queue
        self.inflight: list[Req] = []   # prefill: inflight queue
        self.done: list[Req] = []

    def close(self) -> None:
        for r in self.ranks:
            r.mgr.close()
        if self.bootstrap is not None:
            self.bootstrap.close()

    def _all_reduce(self, reqs: list[Req]) -> list[int]:
        return poll_and_all_reduce([[int(req.senders[i].poll()) for req in reqs]
                                    for i in range(self.tp)])

    def _end(self, req: Req, outcome: str) -> None:
        req.finished = outcome
        self.done.append(req)
        for i, rank in enumerate(self.ranks):
            if req.pages:
                rank.free_pages.extend(req.pages[i])
            if req.meta_index:
                rank.free_meta.append(req.meta_index[i])
            if req.state_slot:
                rank.free_slots.append(req.state_slot[i])
        req.pages, req.meta_index, req.state_slot = [], [], []

    def _fail(self, req: Req, what: str) -> None:
        """SGLang's Failed branch runs on every rank (the all-reduced poll is the same
        everywhere): each rank calls failure_exception() and prepares the abort with its text."""
        messages = []
        for sender in req.senders:
            try:
                sender.failure_exception()
                raise AssertionError("failure_exception() must raise")
            except AssertionError:
                raise
            except Exception as e:  # noqa: BLE001 - SGLang appends str(e) to its message
                messages.append(f"{what} failed for request {req.rid} with exception {e}")
        self._end(req, messages[0])

    def abort(self, req: Req) -> None:
        """Scheduler.abort_request: the sender's abort (if it has one) / the receiver's."""
        for s in req.senders:
            if hasattr(s, "abort"):
                s.abort()


class Prefill(Server):
    def __init__(self, *a, chunk_tokens: int = 8, **kw):
        super().__init__("prefill", *a, **kw)
        self.chunk = chunk_tokens

    def add(self, req: Req) -> None:
        cls = get_kv_class(TransferBackend.DYNAMIC, KVClassType.SENDER, self.args)
        req.senders = [cls(mgr=r.mgr, bootstrap_addr=f"{req.bootstrap_host}:{req.bootstrap_port}",
                           bootstrap_room=req.bootstrap_room, dest_tp_ranks=[r.tp_rank],
                           pp_rank=0) for r in self.ranks]
        self.queue.append(req)

    def pop_bootstrapped(self) -> None:
        if not self.queue:
            return
        polls = self._all_reduce(self.queue)
        keep = []
        for req, poll in zip(self.queue, polls):
            if poll == KVPoll.Bootstrapping:
                keep.append(req)
            elif poll == KVPoll.Failed:
                self._fail(req, "Prefill bootstrap")
            else:
                num_pages = kv_to_page_num(req.prompt, self.page_size)
                req.meta_index = [r.free_meta.pop(0) for r in self.ranks]
                req.pages = [[r.free_pages.pop(0) for _ in range(num_pages)] for r in self.ranks]
                if self.mamba:
                    req.state_slot = [r.free_slots.pop() for r in self.ranks]
                for s, idx in zip(req.senders, req.meta_index):
                    s.init(num_pages, idx)
                self.running.append(req)
        self.queue = keep

    def _write(self, req: Req, start: int, end: int) -> None:
        """The forward pass of tokens [start, end): every layer's rows on every rank."""
        for i, rank in enumerate(self.ranks):
            for t in range(start, end):
                page, off = req.pages[i][t // self.page_size], t % self.page_size
                slot = page * self.page_size + off
                for layer in range(LAYERS):
                    if self.mla:
                        rank.bufs[layer][slot, 0] = kv_value(req.bootstrap_room, layer, 0, t,
                                                             MLA_ROW)
                        continue
                    for part in (0, 1):
                        full = kv_value(req.bootstrap_room, layer, part, t,
                                        self.model_heads * HEAD_DIM).reshape(-1, HEAD_DIM)
                        h0 = (i * rank.heads) % self.model_heads
                        rank.bufs[part * LAYERS + layer][slot] = full[h0:h0 + rank.heads]

    def send_kv_chunk(self, req: Req, last_chunk: bool, end: int) -> None:
        start = req.start_send_idx
        if not last_chunk:
            end -= end % self.page_size  # the partial page waits for the next chunk
        req.start_send_idx = end
        for i, (rank, sender) in enumerate(zip(self.ranks, req.senders)):
            if last_chunk:  # MetadataBuffers.set_buf(req): the first output token
                rank.meta.output_ids[req.meta_index[i], 0] = 1000 + req.bootstrap_room % 1000
                rank.meta.cached_tokens[req.meta_index[i], 0] = req.prompt
            kv = np.arange(start, end, dtype=np.int64)
            slots = np.array([req.pages[i][t // self.page_size] * self.page_size
                              + t % self.page_size for t in kv], dtype=np.int64)
            pages = kv_to_page_indices(slots, self.page_size)
            state_indices = None
            if last_chunk and self.mamba:  # the state as of the prompt's end, one slot
                slot = req.state_slot[i]
                for n, t in enumerate(rank.states):
                    t[slot] = state_value(req.bootstrap_room, n, i, t.shape[1], t.dtype)
                state_indices = [np.array([slot], dtype=np.int64)]
            if len(pages) == 0:
                continue
            sender.send(pages, state_indices)

    def step(self) -> None:
        """One event loop: bootstrapped requests join, each running request computes one chunk
        and sends it; then the inflight queue is polled."""
        self.pop_bootstrapped()
        still = []
        for req in self.running:
            done = getattr(req, "computed", 0)
            end = min(done + self.chunk, req.prompt)
            self._write(req, done, end)
            req.computed = end
            last = end == req.prompt
            self.send_kv_chunk(req, last, end)
            (self.inflight if last else still).append(req)
        self.running = still
        self.process_inflight()

    def process_inflight(self) -> None:
        if not self.inflight:
            return
        polls = self._all_reduce(self.inflight)
        keep = []
        for req, poll in zip(self.inflight, polls):
            if poll in (KVPoll.WaitingForInput, KVPoll.Transferring):
                keep.append(req)
            elif poll == KVPoll.Success:
                for s in req.senders:
                    if hasattr(s, "clear"):
                        s.clear()
                self._end(req, "ok")
            elif poll == KVPoll.Failed:
                self._fail(req, "Prefill transfer")
            else:
                raise AssertionError(f"Unexpected polling state {poll=}")
        self.inflight = keep


class Decode(Server):
    def __init__(self, *a, **kw):
        super().__init__("decode", *a, **kw)
        self.waiting: dict[int, bool] = {}

    def add(self, req: Req, prefill_dp_rank: Optional[int] = None) -> None:
        cls = get_kv_class(TransferBackend.DYNAMIC, KVClassType.RECEIVER, self.args)
        req.senders = [cls(mgr=r.mgr, bootstrap_addr=f"{req.bootstrap_host}:{req.bootstrap_port}",
                           bootstrap_room=req.bootstrap_room, prefill_dp_rank=prefill_dp_rank)
                       for r in self.ranks]
        self.waiting[id(req)] = False
        self.queue.append(req)

    def update_handshake_waiters(self) -> None:
        if not self.queue or all(self.waiting[id(r)] for r in self.queue):
            return
        polls = self._all_reduce(self.queue)
        for req, poll in zip(list(self.queue), polls):
            if poll == KVPoll.Bootstrapping:
                pass
            elif poll == KVPoll.WaitingForInput:
                self.waiting[id(req)] = True
            elif poll == KVPoll.Failed:
                self.queue.remove(req)
                self._fail(req, "Decode handshake")
            else:
                raise ValueError(f"Unexpected poll case: {poll}")

    def pop_preallocated(self) -> None:
        self.update_handshake_waiters()
        keep = []
        for req in self.queue:
            if req.finished is not None:
                continue
            if not self.waiting[id(req)]:
                keep.append(req)
                continue
            n = kv_to_page_num(req.prompt, self.page_size)
            req.pages = [[r.free_pages.pop(0) for _ in range(n)] for r in self.ranks]
            req.meta_index = [r.free_meta.pop(0) for r in self.ranks]
            if self.mamba:
                req.state_slot = [r.free_slots.pop(0) for r in self.ranks]
            for i, (rank, recv) in enumerate(zip(self.ranks, req.senders)):
                slots = np.array([req.pages[i][t // self.page_size] * self.page_size
                                  + t % self.page_size for t in range(req.prompt)], np.int64)
                state = [np.array([req.state_slot[i]])] if self.mamba else None
                recv.init(kv_to_page_indices(slots, self.page_size), req.meta_index[i], state)
            self.running.append(req)
        self.queue = keep

    def pop_transferred(self) -> None:
        if not self.running:
            return
        polls = self._all_reduce(self.running)
        keep = []
        for req, poll in zip(self.running, polls):
            if poll == KVPoll.Failed:
                self._fail(req, "Decode transfer")
            elif poll == KVPoll.Success:
                req.first_token = [int(r.meta.output_ids[req.meta_index[i], 0])
                                   for i, r in enumerate(self.ranks)]
                req.checked = [self.check(req, i) for i in range(self.tp)]
                for recv in req.senders:
                    recv.clear()
                self._end(req, "ok")
            elif poll in (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring):
                keep.append(req)
            else:
                raise ValueError(f"Unexpected poll case: {poll}")
        self.running = keep

    def step(self) -> None:
        self.pop_preallocated()
        self.pop_transferred()

    def check(self, req: Req, i: int) -> int:
        """Every row of every layer this rank holds for the request, against what prefill wrote:
        the count of rows checked (a mismatch raises)."""
        rank, rows = self.ranks[i], 0
        for n, t in enumerate(rank.states):
            want = state_value(req.bootstrap_room, n, i, t.shape[1], t.dtype)
            assert np.array_equal(t[req.state_slot[i]], want), (req.rid, i, "state", n)
        for t in range(req.prompt):
            slot = req.pages[i][t // self.page_size] * self.page_size + t % self.page_size
            for layer in range(LAYERS):
                if self.mla:
                    want = kv_value(req.bootstrap_room, layer, 0, t, MLA_ROW)
                    got = rank.bufs[layer][slot, 0]
                    assert np.array_equal(got, want), (req.rid, i, layer, t)
                    rows += 1
                    continue
                for part in (0, 1):
                    full = kv_value(req.bootstrap_room, layer, part, t,
                                    self.model_heads * HEAD_DIM).reshape(-1, HEAD_DIM)
                    h0 = (i * rank.heads) % self.model_heads
                    got = rank.bufs[part * LAYERS + layer][slot]
                    assert np.array_equal(got, full[h0:h0 + rank.heads]), (req.rid, i, layer,
                                                                           part, t)
                    rows += 1
        return rows


def run(servers: list, until, what: str, timeout: float = 30.0) -> None:
    """Both servers' event loops until `until()` (bounded)."""
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        for s in servers:
            s.step()
        time.sleep(0.002)
