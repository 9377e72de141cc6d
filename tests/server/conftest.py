"""A live server (``moeinfra serve up`` in a subprocess) on the tiny checkpoint, and its helpers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from moeinfra.engine.tiny import init_tiny

READY = re.compile(r"ready at (http://[^/\s]+)/v1")


class ServerProcess:
    """``moeinfra serve up --port 0 ARGS``; ``url`` once ready. Its stderr is kept in ``log``."""

    def __init__(self, args: list[str], timeout_s: float = 180.0) -> None:
        cmd = [sys.executable, "-m", "moeinfra.cli", "serve", "up", "--port", "0", *args]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        self._ready = threading.Event()
        self.url = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout_s) or self.url is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.log))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            match = READY.search(line)
            if match:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()

    def children(self) -> list[int]:
        """pids of every process below the server."""
        out = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout
        parent = {}
        for line in out.splitlines()[1:]:
            pid, ppid = map(int, line.split())
            parent[pid] = ppid
        found, frontier = [], [self.proc.pid]
        while frontier:
            p = frontier.pop()
            kids = [c for c, pp in parent.items() if pp == p]
            found += kids
            frontier += kids
        return found

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def wait_until(check, timeout_s: float = 20.0, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"condition not met in {timeout_s} s")


def metric(url: str, name: str, labels: str = "") -> float:
    """Sum of a Prometheus sample's values (lines starting ``name`` with ``labels`` inside)."""
    text = httpx.get(f"{url}/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and labels in line and not line.startswith("#"):
            head = line.split(" ")[0]
            if head == name or head.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="session")
def tiny_bpe(tmp_path_factory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("server-ckpt") / "tiny", tokenizer="bpe")


@pytest.fixture(scope="module")
def server(tiny_bpe, tmp_path_factory):
    """One prefill and one decode unit of one rank each, an on-disk KV cache, small limits."""
    cache = tmp_path_factory.mktemp("kvdisk")
    srv = ServerProcess(
        [
            "--model", str(tiny_bpe),
            "--prefill-ranks", "1", "--decode-ranks", "1",
            "--kv-cache-dir", str(cache),
            "--block-size", "16", "--num-kv-blocks", "256",
            "--max-num-seqs", "8", "--max-queue", "4",
        ]
    )  # fmt: skip
    srv.cache_dir = cache
    yield srv
    assert srv.stop() == 0, "".join(srv.log)
