"""An asyncio client of kvferry serve's control socket (docs/control.md), for the proxy tests.

A ZeroMQ DEALER socket; every request is two frames, a 60-byte authentication header and one
JSON object, signed with HMAC-SHA-256 under the instance's secret; every reply is verified
against the nonce of the request it names and routed to it. Every call has a deadline.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import struct
import time
from typing import Any, Optional

import zmq
import zmq.asyncio

LABEL = b"kvferry-sc-v1"
HEADER_BYTES = 60
ZERO_NONCE = bytes(16)


def sign(secret: bytes, kind: int, body: bytes, bound: bytes = ZERO_NONCE) -> tuple[bytes, bytes]:
    """(header, nonce) for a message of `kind` (0 request, 1 reply) whose MAC binds `bound`."""
    nonce = os.urandom(16)
    signed = struct.pack("<BBHQ", 1, kind, 0, int(time.time() * 1000)) + nonce
    mac = hmac.new(secret, LABEL + signed + bound + body, hashlib.sha256).digest()
    return signed + mac, nonce


def verify(secret: bytes, header: bytes, body: bytes, bound: bytes) -> bool:
    if len(header) != HEADER_BYTES or header[0] != 1 or header[1] != 1:
        return False
    mac = hmac.new(secret, LABEL + header[:28] + bound + body, hashlib.sha256).digest()
    return hmac.compare_digest(mac, header[28:])


class ControlError(RuntimeError):
    pass


class ControlClient:
    def __init__(self, endpoint: str, secret: str = "",
                 context: Optional[zmq.asyncio.Context] = None):
        self.secret = secret.encode()
        self.context = context or zmq.asyncio.Context.instance()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.pending: dict[bytes, asyncio.Future] = {}
        self.dropped = 0
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            if len(frames) != 2:
                self.dropped += 1
                continue
            header, body = frames
            try:
                reply = json.loads(body)
                bound = bytes.fromhex(reply.get("request_nonce", ""))
            except ValueError:
                self.dropped += 1
                continue
            future = self.pending.get(bound)
            if future is None or not verify(self.secret, header, body, bound):
                self.dropped += 1
                continue
            del self.pending[bound]
            if not future.done():
                future.set_result(reply)

    def _send(self, message: dict[str, Any]) -> bytes:
        body = json.dumps(message).encode()
        header, nonce = sign(self.secret, 0, body)
        self.socket.send_multipart([header, body])
        return nonce

    async def request(self, message: dict[str, Any], timeout: float) -> dict:
        future = asyncio.get_running_loop().create_future()
        nonce = self._send(message)
        self.pending[nonce] = future
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise ControlError(f"no answer to {message.get('op')} "
                               f"{message.get('request_id', '')} within {timeout} s") from None
        finally:
            self.pending.pop(nonce, None)

    async def generate(self, request_id: str, prompt: list[int], params: Optional[dict],
                       timeout: float) -> dict:
        return await self.request({"op": "generate", "request_id": request_id,
                                   "prompt": prompt, "kv_transfer_params": params}, timeout)

    def abort(self, request_id: str) -> None:
        """Answered only by the request's own generate reply (or a refusal, dropped here)."""
        self._send({"op": "abort", "request_id": request_id})

    async def stats(self, timeout: float = 5.0) -> dict:
        return await self.request({"op": "stats"}, timeout)

    def close(self) -> None:
        self._reader.cancel()
        self.socket.close(0)
