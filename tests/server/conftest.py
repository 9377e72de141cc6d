"""A live server (``moeinfra serve up`` in a subprocess) on the tiny checkpoint, and its helpers."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest

from moeinfra.engine.tiny import init_tiny
from moeinfra.server.process import ServerProcess as _ServerProcess
from moeinfra.server.router import RankState, Router


class ServerProcess(_ServerProcess):
    """The library's server process, plus the pids below it."""

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


def fake_router(units: dict[str, tuple[str, float]]) -> Router:
    """A router (not started) with ready units ``{id: (role, work done so far)}``, 4 slots each."""
    router = Router("tcp://127.0.0.1:0", "digest")
    for unit_id, (role, work) in units.items():
        unit = router.expect_unit(unit_id, role, 1)
        rank = RankState(unit, 0, f"{unit_id}/0".encode(), None, 4)
        if role == "decode":
            rank.occupancy_s = work * 4  # running requests x seconds over 4 slots
        else:
            rank.busy_s = work
        unit.ranks.append(rank)
    return router


def disaggregated(path, cache_dir, *extra: str) -> ServerProcess:
    """``serve up`` with one prefill and one decode rank, an on-disk cache in ``cache_dir`` and
    4-token blocks (``extra``: more options)."""
    return ServerProcess(
        [
            "--model", str(path),
            "--prefill-ranks", "1", "--decode-ranks", "1",
            "--kv-cache-dir", str(cache_dir),
            "--block-size", "4", "--num-kv-blocks", "256",
            *extra,
        ]
    )  # fmt: skip


def greedy_completion(server, prompt: str, max_tokens: int):
    """The server's greedy completion of ``prompt`` (EOS ignored), through the openai client."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    return client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
