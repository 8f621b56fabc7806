"""A prefill worker in its own Python process, for test_kvferry.py.

Usage: prefill_peer.py BASE_PORT. Prints one JSON line with the kv_transfer_params of a held
request, then "freed <id>" when its hold ends; exits when stdin closes.
"""
import json
import sys
import time

import numpy as np

import kvferry
from common import BLOCKS, TOKENS, HEADS, DIM, LAYERS, expected_block

base_port = int(sys.argv[1])
spec = kvferry.CacheSpec.mha(LAYERS, HEADS, DIM, BLOCKS, TOKENS, "int32")
caches = [[np.empty((BLOCKS, TOKENS, HEADS, DIM), dtype=np.int32) for _ in range(2)]
          for _ in range(LAYERS)]
for l in range(LAYERS):
    for p in range(2):
        for b in range(BLOCKS):
            caches[l][p][b] = expected_block(l, p, b)
worker = kvferry.Worker("kv_producer", "py-prefill", base_port=base_port, hold_lease_ms=60000)
worker.register_kv_caches(spec, [[c.ctypes.data for c in layer] for layer in caches])
scheduler = kvferry.Scheduler("prefill", "py-prefill", base_port=base_port)
for req, blocks in (("req-1", [3, 4, 5, 9]), ("req-2", [10, 11])):
    delay, params = scheduler.request_finished(req, {"do_remote_decode": True}, "length", blocks)
    assert delay
    worker.start_load_kv(scheduler.build_connector_meta())
    print(json.dumps(params), flush=True)

import select  # noqa: E402

while True:
    sending, _ = worker.get_finished()
    for rid in sorted(sending):
        print("freed", rid, flush=True)
    if select.select([sys.stdin], [], [], 0.01)[0] and not sys.stdin.readline():
        break
    time.sleep(0.01)
