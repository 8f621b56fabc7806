"""What a hybrid (gpt-oss-like) cache moves, against every layer as full attention (issue 29).

Measured through kvferry's native API with two workers over tcp on loopback: 24 layers, 12 of
full attention and 12 with a 128-token sliding window, 8 KV heads x 64 dims fp16, 16-token
blocks, an 8192-token prompt, all of it loaded (no prefix hit).

Run: PYTHONPATH=build/python /usr/bin/python3 scripts/hybrid_bytes.py
"""
import socket
import time

import numpy as np

from kvferry import _kvferry as k

BS, HEADS, DIM, NB, PROMPT, WINDOW, LAYERS = 16, 8, 64, 530, 8192, 128, 12


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec(window):
    return k.CacheSpec.create("mha", LAYERS, [("k", HEADS, DIM), ("v", HEADS, DIM)], NB, BS,
                              "fp16", sliding_window=window)


def caches(fill):
    """[group][layer][part] arrays; the prefill's filled, the decode's zero."""
    return [[[np.full(NB * BS * HEADS * DIM, (g * 1000 + l * 10 + p) if fill else 0, np.uint16)
              for p in range(2)] for l in range(LAYERS)] for g in range(2)]


def bases(c):
    return [[[a.ctypes.data for a in layer] for layer in group] for group in c]


def main():
    specs = [spec(0), spec(WINDOW)]
    prefill_caches, decode_caches = caches(True), caches(False)
    pport, dport = free_port(), free_port()
    prefill = k.Worker("prefill", "p", base_port=pport, transport="tcp")
    decode = k.Worker("decode", "d", base_port=dport, transport="tcp")
    prefill.register_kv_cache_groups(specs, bases(prefill_caches))
    decode.register_kv_cache_groups(specs, bases(decode_caches))
    blocks = PROMPT // BS
    # As vLLM leaves them: a window group holds its last blocks, null (-1) before.
    remote = [list(range(1, blocks + 1)), [-1] * (blocks - 8) + list(range(blocks + 1, blocks + 9))]
    local = [list(range(1, blocks + 1)), [-1] * (blocks - 9) + list(range(blocks + 1, blocks + 10))]
    p_sched = k.Scheduler("prefill", "p", base_port=pport)
    _, params = p_sched.request_finished_all_groups("r", {"do_remote_decode": True},
                                                    "FINISHED_LENGTH_CAPPED", remote)
    prefill.start_load_kv(p_sched.build_connector_meta())
    d_sched = k.Scheduler("decode", "d")
    d_sched.update_state_after_alloc_all_groups("r", dict(params), local, PROMPT, PROMPT)
    start = time.monotonic()
    decode.start_load_kv(d_sched.build_connector_meta())
    while "r" not in decode.get_finished()[1]:
        time.sleep(0.001)
    elapsed = time.monotonic() - start
    errors = decode.take_load_errors()
    assert not errors, errors
    moved = decode.stats()["bytes_read"]
    block = BS * HEADS * DIM * 2
    fallback = 2 * LAYERS * 2 * blocks * block
    bound = LAYERS * 2 * (blocks + WINDOW // BS + 1) * block
    print(f"moved {moved} bytes ({moved / 2**20:.1f} MiB) in {elapsed * 1000:.0f} ms; every "
          f"layer as full attention: {fallback} bytes ({fallback / 2**20:.1f} MiB); ratio "
          f"{moved / fallback:.3f}; bound (the full layers' {PROMPT} tokens and the window's "
          f"{WINDOW} tokens and one block): {bound} bytes")
    assert moved <= bound


if __name__ == "__main__":
    main()
