"""Shared shape and expected values of the Python tests' caches."""
import numpy as np

LAYERS, HEADS, DIM, TOKENS, BLOCKS = 2, 4, 8, 4, 32


def expected_block(layer: int, part: int, block: int) -> np.ndarray:
    t, h, d = np.meshgrid(np.arange(TOKENS), np.arange(HEADS), np.arange(DIM), indexing="ij")
    return (layer * 1_000_000 + part * 100_000 + block * 1000 + t * 100 + h * 10 + d).astype(np.int32)


def free_port(count: int = 1) -> int:
    import socket
    import random
    for _ in range(200):
        # Below Linux's ephemeral range (32768-60999 by default), where outgoing connections
        # take their ports at any moment; the C++ tests pick theirs the same way
        # (src/common/ports.cc).
        base = random.randint(20000, 32000 - count)
        ok = True
        for i in range(count):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", base + i))
            except OSError:
                ok = False
            finally:
                s.close()
        if ok:
            return base
    raise RuntimeError("no free port")
