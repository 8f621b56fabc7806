"""Shared shape and expected values of the Python tests' caches."""
import numpy as np

LAYERS, HEADS, DIM, TOKENS, BLOCKS = 2, 4, 8, 4, 32


def expected_block(layer: int, part: int, block: int) -> np.ndarray:
    t, h, d = np.meshgrid(np.arange(TOKENS), np.arange(HEADS), np.arange(DIM), indexing="ij")
    return (layer * 1_000_000 + part * 100_000 + block * 1000 + t * 100 + h * 10 + d).astype(np.int32)


# Ports free_port handed out in this process. Two calls made before either port is taken (`pport,
# dport = free_port(), free_port()`) could return the same one, and the second listener then
# failed with "Address already in use" (seen once in a full run): never hand out one twice.
_HANDED_OUT: set[int] = set()


def free_port(count: int = 1) -> int:
    import socket
    import random
    for _ in range(200):
        # Below the range the C++ tests pick from in parallel ([10000, the ephemeral range),
        # src/common/ports.cc) and below Linux's ephemeral range, where outgoing connections take
        # ports at any moment: a port found free here is not then taken by another test's
        # listener or by a connection.
        base = random.randint(2000, 10000 - count)
        ok = not any(base + i in _HANDED_OUT for i in range(count))
        for i in range(count if ok else 0):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", base + i))
            except OSError:
                ok = False
            finally:
                s.close()
        if ok:
            _HANDED_OUT.update(range(base, base + count))
            return base
    raise RuntimeError("no free port")


class SilentPeer:
    """A loopback port that accepts TCP and never speaks ZMTP: a handshake with it cannot finish
    (a load waits on it until aborted or timed out). A context manager; `port` is where."""

    def __enter__(self) -> "SilentPeer":
        import socket
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(8)
        self.port = self._socket.getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        self._socket.close()
