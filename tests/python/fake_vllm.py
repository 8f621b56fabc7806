"""A stand-in for one vLLM instance behind kvferry-proxy: the subset of vLLM's OpenAI API the
proxy uses, with `kvferry serve` doing the engine's work (and so kvferry's KV transfer) behind it.

    fake_vllm.py --role prefill|decode --cli KVFERRY [--serve-arg=--hold-lease-ms=60000 ...]

starts `kvferry serve` (a child that exits with this process), connects to its control socket
(docs/control.md; KVFERRY_SECRET from the environment) and serves, on 127.0.0.1:--port (0: any):

- POST /v1/completions, /v1/chat/completions, streamed or not, as vLLM answers them: a JSON
  completion with ``kv_transfer_params`` at the top level (the connector's, from the engine's
  answer), or server-sent events (``data: {chunk}`` ... ``data: [DONE]``; like Starlette, the
  response starts before the engine has the request). The prompt is the token id list given, or
  the text's UTF-8 bytes (chat: "role: content" lines) each as one token: trivial and
  deterministic. ``kv_transfer_params`` go to the engine as they came.
- As vLLM, a client that disconnects aborts its request in the engine.
- Every answer carries ``kvferry``: the engine's answer (ok, code, error, verified_bytes,
  loaded_blocks, prefix_hit_blocks, recomputed_blocks) and ``prompt_tokens``; a stream carries it
  in its last chunk. A decode engine verifies every byte of the KV it got (verified_bytes).
- GET /health (200), /v1/models.

Prints ``READY <url> <json>`` once serving, the JSON naming the engine's control endpoint, its
/metrics URL and its connector endpoint (the control ``stats`` reply's "connector").
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from typing import Any, Optional

from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_control import ControlClient, ControlError  # noqa: E402

ENGINE_TIMEOUT_S = 60.0


def tokens_of(endpoint: str, body: dict) -> list[int]:
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str):
            return list(prompt.encode())
        raise ValueError(f"prompt: expected a string or a token list, found {prompt!r}")
    lines = []
    for m in body.get("messages") or []:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        lines.append(f"{m.get('role')}: {content}")
    return list("\n".join(lines).encode())


def token_text(prompt: list[int], i: int) -> str:
    return f" t{(sum(prompt) + i) % 997}"


class _LossWatch(asyncio.Protocol):
    """Sits between a connection's transport and aiohttp's protocol and reports the connection's
    loss at once, as uvicorn tells vLLM (its http.disconnect message); aiohttp 3.8 itself only
    fails the request body's reader, which a handler that has read its body never sees."""

    def __init__(self, inner: asyncio.Protocol):
        self.inner = inner
        self.lost = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        self.inner.connection_lost(exc)


async def client_gone(request: web.Request) -> None:
    """Returns as soon as the client's connection is lost."""
    transport = request.transport
    if transport is None or transport.is_closing():
        return
    watch = transport.get_protocol()
    if not isinstance(watch, _LossWatch):  # one per connection, kept for its next requests
        watch = _LossWatch(watch)
        transport.set_protocol(watch)
    await asyncio.shield(watch.lost)


async def send(out: web.StreamResponse, data: bytes, last: bool = False) -> bool:
    """Writes a stream's bytes; False when the client has gone."""
    try:
        await out.write(data)
        if last:
            await out.write_eof()
    except ConnectionResetError:
        return False
    return True


class FakeVllm:
    def __init__(self, args: argparse.Namespace, control: ControlClient, connector: dict):
        self.args, self.control, self.connector = args, control, connector

    async def _engine(self, request: web.Request, rid: str, prompt: list[int],
                      params: Any) -> Optional[dict]:
        """The engine's answer, or None when the client left first (the request is aborted
        in the engine, and its answer awaited so it is known to have ended). With --queue-ms
        the request first waits that long, as in a vLLM whose running batch is full; a client
        that leaves meanwhile ends it as vLLM ends a waiting request: the engine gets it and
        its abort together (its connector is told the request finished before it was loaded)."""
        gone = asyncio.ensure_future(client_gone(request))
        try:
            if self.args.queue_ms:
                await asyncio.wait({gone}, timeout=self.args.queue_ms / 1000)
            work = asyncio.ensure_future(self.control.generate(rid, prompt, params,
                                                               ENGINE_TIMEOUT_S))
            if not gone.done():
                await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
            self.control.abort(rid)
            try:
                await asyncio.wait_for(asyncio.shield(work), ENGINE_TIMEOUT_S)
            except (asyncio.TimeoutError, ControlError):
                pass
            return None
        finally:
            gone.cancel()

    async def completion(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        body = await request.json()
        try:
            prompt = tokens_of(endpoint, body)
        except ValueError as e:
            return web.json_response({"error": {"message": str(e), "code": 400}}, status=400)
        rid = f"{request.headers.get('X-Request-Id', 'req')}-{uuid.uuid4().hex[:8]}"
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        params = body.get("kv_transfer_params")
        kind = "chat.completion" if endpoint == "chat" else "text_completion"
        base = {"id": rid, "created": int(time.time()), "model": self.args.model}
        stream = bool(body.get("stream"))
        out: Optional[web.StreamResponse] = None
        if stream:  # as Starlette: the response starts before the engine has the request
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
        try:
            reply = await self._engine(request, rid, prompt, params)
        except ControlError as e:
            reply = {"ok": False, "code": "Timeout", "error": str(e)}
        if reply is None:
            return out or web.Response(status=499)
        info = {k: reply.get(k) for k in ("ok", "code", "error", "verified_bytes",
                                          "loaded_blocks", "prefix_hit_blocks",
                                          "recomputed_blocks", "aborted")}
        info["prompt_tokens"] = len(prompt)
        if not reply.get("ok"):
            error = {"error": {"message": reply.get("error", ""), "code": 500}, "kvferry": info}
            if out is None:
                return web.json_response(error, status=500)
            await send(out, f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode(), True)
            return out
        texts = [token_text(prompt, i) for i in range(max_tokens)]
        if out is None:
            choice = ({"index": 0, "message": {"role": "assistant", "content": "".join(texts)},
                       "finish_reason": "length"} if endpoint == "chat" else
                      {"index": 0, "text": "".join(texts), "finish_reason": "length"})
            return web.json_response(dict(base, object=kind, choices=[choice],
                                          usage={"prompt_tokens": len(prompt),
                                                 "completion_tokens": max_tokens},
                                          kv_transfer_params=reply.get("kv_transfer_params")
                                          or None, kvferry=info))
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            choice = ({"index": 0, "delta": {"content": text}} if endpoint == "chat" else
                      {"index": 0, "text": text})
            choice["finish_reason"] = "length" if last else None
            chunk = dict(base, object=kind + ".chunk", choices=[choice])
            if last:
                chunk["kvferry"] = info
            if not await send(out, f"data: {json.dumps(chunk)}\n\n".encode()):
                return out  # the client left mid-stream: vLLM stops generating
            if self.args.token_delay_ms and not last:
                await asyncio.sleep(self.args.token_delay_ms / 1000)
        await send(out, b"data: [DONE]\n\n", True)
        return out

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.args.model,
                                                              "object": "model"}]})


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--cli", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--base-port", type=int, required=True)
    p.add_argument("--serve-arg", action="append", default=[])
    p.add_argument("--token-delay-ms", type=float, default=0.0)
    p.add_argument("--queue-ms", type=float, default=0.0)
    p.add_argument("--model", default="fake-model")
    # etcd://HOST:PORT/PREFIX: kvferry serve registers this server there (--register, with this
    # server's URL and --name), as a fleet's instances do (docs/fleet.md).
    p.add_argument("--register", default="")
    p.add_argument("--name", default="")
    args = p.parse_args()
    # The server's socket is bound before kvferry serve starts, so the URL it registers is this
    # server's own: a port picked free and bound later can be taken in between by another test's
    # process (CI: "address already in use" on the port kvferry serve had registered).
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", args.port))
    listener.listen(128)
    args.port = listener.getsockname()[1]
    register = []
    if args.register:
        register = ["--register", args.register, "--register-name", args.name,
                    "--register-url", f"http://127.0.0.1:{args.port}", "--register-ttl-s", "3"]
    serve = subprocess.Popen([args.cli, "serve", "--role", args.role, "--control-port", "0",
                              "--base-port", str(args.base_port), "--metrics-port", "0",
                              "--exit-on-stdin-eof", *register, *args.serve_arg],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready, metrics = serve.stdout.readline().strip(), serve.stdout.readline().strip()
    if not ready.startswith("READY ") or not metrics.startswith("METRICS "):
        sys.exit(f"fake_vllm: kvferry serve did not start: {ready!r} {metrics!r}")
    endpoint = ready.split(" ", 1)[1]
    control = ControlClient(endpoint, os.environ.get("KVFERRY_SECRET", ""))
    stats = await control.stats(timeout=10)
    fake = FakeVllm(args, control, stats.get("connector", {}))
    app = web.Application()
    app.router.add_post("/v1/completions", lambda r: fake.completion(r, "completions"))
    app.router.add_post("/v1/chat/completions", lambda r: fake.completion(r, "chat"))
    app.router.add_get("/health", fake.health)
    app.router.add_get("/v1/models", fake.models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.SockSite(runner, listener)
    await site.start()
    port = runner.addresses[0][1]
    print(f"READY http://127.0.0.1:{port} "
          + json.dumps({"control": endpoint, "metrics": metrics.split(" ", 1)[1],
                        "connector": fake.connector}), flush=True)
    try:
        await asyncio.Event().wait()  # until killed; kvferry serve exits with our stdin
    finally:
        control.close()
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
