"""Prefill and decode instances (fake_vllm.py over `kvferry serve`) behind kvferry-proxy, for the
proxy tests: start, talk to, inspect, kill, stop. Every wait has a deadline."""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import aiohttp

from common import free_port
from serve_control import ControlClient

HERE = Path(__file__).resolve().parent
CLI = os.environ.get("KVFERRY_CLI", "")
SECRET = "proxy-test-secret"
# The model every instance runs: 2 layers, K and V, 2 heads of 16 bf16 values, 16 tokens a block.
MODEL = ["--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--tokens-per-block", "16",
         "--dtype", "bf16"]
TOKENS_PER_BLOCK = 16
TOKEN_BYTES = 2 * 2 * 2 * 16 * 2  # layers * (K, V) * heads * dim * 2 bytes (bf16)


def proxy_command() -> list[str]:
    """The installed kvferry-proxy command when the wheel test names it, else the module."""
    installed = os.environ.get("KVFERRY_PROXY", "")
    return [installed] if installed else [sys.executable, "-m", "kvferry.proxy"]


def read_ready(proc: subprocess.Popen, what: str, timeout: float = 30.0) -> str:
    """The process's READY line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("READY "):
                return line.strip()
    raise RuntimeError(f"{what} printed no READY line within {timeout} s")


@dataclass
class Instance:
    role: str
    index: int
    proc: subprocess.Popen
    url: str
    control: str
    engine_metrics: str  # kvferry serve's GET /metrics
    connector: dict

    @property
    def name(self) -> str:
        return f"{self.role[0]}{self.index}"

    def kill(self) -> None:
        """SIGKILL: the fake server dies at once; its kvferry serve exits with its stdin."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


@dataclass
class Cluster:
    prefill: int = 1
    decode: int = 1
    serve_args: list[str] = field(default_factory=list)
    prefill_serve_args: list[str] = field(default_factory=list)
    decode_token_delay_ms: float = 0.0
    decode_queue_ms: float = 0.0  # how long a decode request waits before its engine takes it
    decode_num_blocks: int = 1024  # blocks of each decode engine (prefill engines have 1024)
    proxy_args: list[str] = field(default_factory=list)
    # False: the proxy is not given the instances (they join through etcd or the admin API).
    static: bool = True
    # etcd://...: every instance's kvferry serve registers itself there (--register).
    register: str = ""
    proxy_env: dict = field(default_factory=dict)
    instances: list[Instance] = field(default_factory=list)
    proxy: Optional[subprocess.Popen] = None
    url: str = ""

    def start(self) -> "Cluster":
        if not CLI:
            raise RuntimeError("KVFERRY_CLI (the kvferry binary) is not set; ctest sets it")
        env = dict(os.environ, KVFERRY_SECRET=SECRET, KVFERRY_LOG_LEVEL="warn")
        starting = []
        for role, count in (("prefill", self.prefill), ("decode", self.decode)):
            for i in range(count):
                blocks = 1024 if role == "prefill" else self.decode_num_blocks
                serve = MODEL + ["--num-blocks", str(blocks)] + self.serve_args + (
                    self.prefill_serve_args if role == "prefill" else [])
                cmd = [sys.executable, str(HERE / "fake_vllm.py"), "--role", role, "--cli", CLI,
                       "--base-port", str(free_port()),
                       "--token-delay-ms", str(self.decode_token_delay_ms)]
                if role == "decode":
                    cmd += ["--queue-ms", str(self.decode_queue_ms)]
                if self.register:
                    cmd += ["--register", self.register, "--name", f"{role[0]}{i}"]
                cmd += [f"--serve-arg={a}" for a in serve]
                starting.append((role, i, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                                           text=True, env=env)))
        for role, i, proc in starting:
            line = read_ready(proc, f"fake {role} instance {i}")
            _, url, info = line.split(" ", 2)
            info = json.loads(info)
            self.instances.append(Instance(role, i, proc, url, info["control"],
                                           info["metrics"], info["connector"]))
        cmd = proxy_command() + ["--port", "0", "--health-interval-s", "0.2",
                                 "--health-timeout-s", "0.5", "--health-failures", "2"]
        for inst in self.instances if self.static else []:
            spec = f"{inst.url},name={inst.name}"
            if inst.role == "prefill":
                c = inst.connector
                spec += (f",engine_id={c['engine_id']},kv_host={c['host']},kv_port={c['port']},"
                         f"tp_size={c['tp_size']}")
            cmd += [f"--{inst.role}", spec]
        self.proxy = subprocess.Popen(cmd + self.proxy_args, stdout=subprocess.PIPE, text=True,
                                      env=dict(os.environ, **self.proxy_env))
        self.url = read_ready(self.proxy, "kvferry-proxy").split(" ", 1)[1]
        return self

    def stop(self) -> None:
        for proc in [self.proxy] + [i.proc for i in self.instances]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in [self.proxy] + [i.proc for i in self.instances]:
            if proc is not None:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)

    def __enter__(self) -> "Cluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def of(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.role == role]

    # ------------------------------------------------------------ engine state

    async def stats(self, instances: Optional[list[Instance]] = None) -> dict[str, dict]:
        out = {}
        for inst in instances if instances is not None else self.instances:
            if inst.proc.poll() is not None:
                continue
            client = ControlClient(inst.control, SECRET)
            try:
                out[inst.name] = await client.stats(timeout=5)
            finally:
                client.close()
        return out

    async def wait_nothing_held(self, timeout: float) -> float:
        """Seconds until every live instance holds nothing, loads nothing and uses no block."""
        start = time.monotonic()
        last: dict = {}
        while time.monotonic() - start < timeout:
            last = await self.stats()
            if all(s["holds"] == 0 and s["loads_outstanding"] == 0 and s["used_blocks"] == 0
                   for s in last.values()):
                return time.monotonic() - start
            await asyncio.sleep(0.05)
        raise AssertionError(f"still held after {timeout} s: " + json.dumps(
            {n: {k: s[k] for k in ("holds", "loads_outstanding", "used_blocks")}
             for n, s in last.items()}))

    async def holds_ended(self, session: aiohttp.ClientSession, reason: str) -> int:
        """Prefill holds that ended for `reason` (readers, abort, lease_expired), over the live
        prefill instances (their kvferry_holds_ended_total)."""
        total = 0
        for inst in self.of("prefill"):
            if inst.proc.poll() is not None:
                continue
            async with session.get(inst.engine_metrics, timeout=aiohttp.ClientTimeout(10)) as r:
                total += int(metric(await r.text(), "kvferry_holds_ended_total", reason=reason))
        return total

    async def holds_ended_by_lease(self, session: aiohttp.ClientSession) -> int:
        return await self.holds_ended(session, "lease_expired")

    async def metrics(self, session: aiohttp.ClientSession) -> str:
        async with session.get(self.url + "/metrics", timeout=aiohttp.ClientTimeout(10)) as r:
            assert r.status == 200
            return await r.text()


def bodies(n: int, seed: int) -> list[dict]:
    """A mix of completions and chat, streamed or not, token lists and text, 20 to 600 tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(20, 600)
        stream = rng.random() < 0.5
        kind = i % 3
        if kind == 0:
            body = {"prompt": [rng.randint(1, 50000) for _ in range(length)]}
        elif kind == 1:
            body = {"prompt": "".join(rng.choice("abcdefgh ") for _ in range(length))}
        else:
            body = {"messages": [{"role": "user",
                                  "content": "".join(rng.choice("xyz ") for _ in range(length))}]}
        body.update(model="fake-model", max_tokens=rng.randint(1, 8), stream=stream)
        out.append(body)
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels` (0 when none)."""
    from prometheus_client.parser import text_string_to_metric_families
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def expected_blocks(prompt_tokens: int) -> int:
    return math.ceil(prompt_tokens / TOKENS_PER_BLOCK)


def check_verified(info: dict) -> None:
    """Every byte of the request's KV arrived and was checked by the decode engine."""
    assert info["ok"] and info["code"] == "OK", info
    blocks = expected_blocks(info["prompt_tokens"])
    assert info["recomputed_blocks"] == 0, info
    assert info["loaded_blocks"] + info["prefix_hit_blocks"] == blocks, info
    assert info["verified_bytes"] == info["prompt_tokens"] * TOKEN_BYTES, info


async def post(session: aiohttp.ClientSession, url: str, body: dict, timeout: float = 60.0
               ) -> tuple[int, Any]:
    """(status, answer): the JSON answer, or for a stream the list of its events (JSON, or the
    string "[DONE]")."""
    endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with session.post(url + endpoint, json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if not body.get("stream") or r.status != 200:
            return r.status, await r.json(content_type=None)
        events: list[Any] = []
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
        return r.status, events


def answer_info(answer: Any) -> dict:
    """The kvferry info of an answer (a stream's last chunk carries it)."""
    if isinstance(answer, dict):
        return answer["kvferry"]
    chunks = [e for e in answer if isinstance(e, dict)]
    assert answer[-1] == "[DONE]", answer[-3:]
    return chunks[-1]["kvferry"]


def answer_text(answer: Any) -> str:
    if isinstance(answer, dict):
        c = answer["choices"][0]
        return c.get("text") or c["message"]["content"]
    return "".join(e["choices"][0].get("text") or e["choices"][0]["delta"]["content"]
                   for e in answer if isinstance(e, dict) and "choices" in e)
