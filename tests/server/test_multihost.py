"""A unit whose ranks span hosts (``serve unit --nproc-per-node/--node-rank/--master-addr``), run
here as two processes that meet only at the unit's rendezvous address, as two hosts would; every
socket under a shared secret (``--secret-file``), as across real hosts. A rank killed on one
"host" restarts the whole unit on both (torch's elastic agent), which rejoins the server."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
from tests.server.conftest import ServerProcess, metric, wait_until

from moeinfra.engine import LLM, SamplingParams


def _free_port() -> int:
    """A port free now for the unit's rendezvous, which node 0 binds and node 1 must know
    beforehand (it may be taken in between: ``serve unit`` does not say a port it picked)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unit(control: str, model, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "moeinfra.cli", "serve", "unit", "--server", control,
           "--model", str(model), "--block-size", "16", "--num-kv-blocks", "256", *args]  # fmt: skip
    return subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
    )


def test_a_decode_unit_spanning_two_hosts_serves_as_one_engine_and_restarts_as_one(
    tiny_bpe, tmp_path
):
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    srv = ServerProcess(["--model", str(tiny_bpe), "--prefill-units", "0", "--decode-units", "0",
                         "--secret-file", str(secret)])  # fmt: skip
    control = re.search(r"control (tcp://\S+?)\)", "".join(srv.log)).group(1)  # it bound port 0
    meet = ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    span = ["--role", "decode", "--ranks", "2", "--nproc-per-node", "1", "--unit-id", "decode-x",
            "--max-restarts", "1"]  # fmt: skip
    held = ["--secret-file", str(secret)]
    units = [
        _unit(control, tiny_bpe, "--role", "prefill", "--ranks", "1", *held),
        _unit(control, tiny_bpe, *span, "--node-rank", "0", *meet, *held),
        _unit(control, tiny_bpe, *span, "--node-rank", "1", *meet, *held),
    ]
    try:

        def ready() -> bool:
            health = httpx.get(f"{srv.url}/health").json()["units"]
            return len(health) == 2 and all(u["ready"] for u in health.values())

        wait_until(ready, timeout_s=120)
        unit = httpx.get(f"{srv.url}/health").json()["units"]["decode-x"]
        assert unit["role"] == "decode" and len(unit["pids"]) == 2  # a rank from each "host"
        prompts = ["hello world", "KV cache", "The decode unit", "Prefill and decode"]
        with LLM(tiny_bpe, block_size=16, num_kv_blocks=256) as llm:
            expected = [
                r.outputs[0].text
                for r in llm.generate(
                    prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
                )
            ]
        body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "ignore_eos": True}

        def answers() -> list[str]:
            return [
                httpx.post(
                    f"{srv.url}/v1/completions", json={**body, "prompt": p}, timeout=120
                ).json()["choices"][0]["text"]
                for p in prompts
            ]

        assert answers() == expected
        # one "host"'s rank dies: the other host's rank does not sit in its next collective until
        # the 120 s timeout; both start again and the unit rejoins under its id
        killed = time.monotonic()
        os.kill(unit["pids"][1], signal.SIGKILL)

        def restarted() -> bool:
            health = httpx.get(f"{srv.url}/health").json()
            now = health["units"].get("decode-x")
            return (
                health["status"] == "ok"
                and now is not None
                and now["ready"]
                and not set(now["pids"]) & set(unit["pids"])
            )

        wait_until(restarted, timeout_s=90)
        print(f"the unit served again {time.monotonic() - killed:.1f} s after a rank was killed")
        assert time.monotonic() - killed < 60
        assert metric(srv.url, "moeinfra:unit_restarts_total", 'role="decode"') == 1
        assert answers() == expected
    finally:
        assert srv.stop() == 0, "".join(srv.log)
        for unit in units:  # the server's drain tells every unit to stop, joined ones too
            try:
                code = unit.wait(60)
            except subprocess.TimeoutExpired:
                unit.kill()
                code = unit.wait()
            assert code == 0, unit.stderr.read()
