"""A real etcd (Debian's etcd-server) on the loopback for the fleet tests: started on free ports
with a data directory of its own, stopped, and started again on the same ports and data (etcd
down and back). Every wait has a deadline."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from typing import Optional

from common import free_port

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def available() -> bool:
    return os.access(ETCD, os.X_OK)


class EtcdServer:
    def __init__(self, extra_hosts: tuple[str, ...] = ()) -> None:
        """`extra_hosts`: more addresses etcd listens on for clients (a veth's, for a client in a
        network namespace), beside 127.0.0.1."""
        self.dir = tempfile.mkdtemp(prefix="kvferry-etcd-")
        self.client_port, self.peer_port = free_port(), free_port()
        self.extra_hosts = extra_hosts
        self.proc: Optional[subprocess.Popen] = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def url(self, prefix: str) -> str:
        return f"etcd://127.0.0.1:{self.client_port}{prefix}"

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [ETCD, "--name", "kvferry-test", "--data-dir", os.path.join(self.dir, "data"),
             "--listen-client-urls", ",".join(
                 [self.base] + [f"http://{h}:{self.client_port}" for h in self.extra_hosts]),
             "--advertise-client-urls", self.base,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvferry-test={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, "log"), "ab"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see "
                                   f"{self.dir}/log")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"etcd did not answer /health within {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
