"""Units that come back, with real processes killed with SIGKILL: a unit restarted under its id,
a second start under a live id, an API server restarted under its units, and ``serve up``
starting its own units again."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import subprocess
import sys
import time

import httpx
from tests.server.conftest import ServerProcess, metric, wait_until

BODY = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _unit(control: str, model, unit_id: str, role: str) -> subprocess.Popen:
    """``serve unit`` of one rank under ``unit_id`` (a unit on "another host")."""
    cmd = [sys.executable, "-m", "moeinfra.cli", "serve", "unit", "--server", control,
           "--model", str(model), "--role", role, "--ranks", "1", "--unit-id", unit_id,
           "--block-size", "16", "--num-kv-blocks", "256"]  # fmt: skip
    return subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
    )


def _control(srv: ServerProcess) -> str:
    """The control address the server bound (``--control`` is on port 0 unless given)."""
    return re.search(r"control (tcp://\S+?)\)", "".join(srv.log)).group(1)


def _units(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()["units"]


def _ready_pid(url: str, unit_id: str) -> int | None:
    """The rank pid of ``unit_id`` once the server has it ready and serves (else None)."""
    try:
        health = httpx.get(f"{url}/health", timeout=10)
    except httpx.HTTPError:
        return None
    unit = health.json()["units"].get(unit_id)
    if health.status_code != 200 or unit is None or not unit["ready"]:
        return None
    return unit["pids"][0]


def _complete(url: str, prompt: str = "hello world") -> str:
    answer = httpx.post(f"{url}/v1/completions", json={**BODY, "prompt": prompt}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_a_unit_restarted_under_its_id_serves_again_and_a_second_start_replaces_the_first(
    tiny_bpe,
):
    srv = ServerProcess(["--model", str(tiny_bpe), "--prefill-units", "0",
                         "--decode-units", "0"])  # fmt: skip
    control = _control(srv)
    prefill = _unit(control, tiny_bpe, "p", "prefill")
    decode = _unit(control, tiny_bpe, "d", "decode")
    restarted = second = None
    try:
        wait_until(lambda: _ready_pid(srv.url, "p") and _ready_pid(srv.url, "d"), timeout_s=120)
        expected = _complete(srv.url)
        decode.kill()
        decode.wait(30)
        restarted = _unit(control, tiny_bpe, "d", "decode")
        wait_until(lambda: _ready_pid(srv.url, "d") == restarted.pid, timeout_s=120)
        assert _complete(srv.url) == expected
        # a second unit given the same --unit-id: the newest start wins, the older one is told
        # why in one line and exits
        second = _unit(control, tiny_bpe, "d", "decode")
        wait_until(lambda: _ready_pid(srv.url, "d") == second.pid, timeout_s=120)
        assert restarted.wait(60) == 1
        said = restarted.stderr.read()  # its start-up line, then why it stops
        assert "Traceback" not in said
        assert "was started again" in said.splitlines()[-1] and "--unit-id" in said
        assert _complete(srv.url) == expected
        assert metric(srv.url, "moeinfra:unit_restarts_total", 'role="decode"') == 2
        assert sorted(_units(srv.url)) == ["d", "p"]
    finally:
        assert srv.stop() == 0, "".join(srv.log)
        _stop(*(p for p in (prefill, decode, restarted, second) if p is not None))


def test_an_api_server_restarted_under_its_units_serves_again_within_10_s(tiny_bpe):
    """The units re-announce themselves to the new server; the stream in flight at the crash
    ends at the client, and the unit drops it once the new server tells it to rejoin."""
    args = ["--model", str(tiny_bpe), "--prefill-units", "0", "--decode-units", "0"]
    srv = ServerProcess(args)
    control = _control(srv)
    args += ["--control", control]  # the restarted server binds the address the units know
    prefill = _unit(control, tiny_bpe, "p", "prefill")
    decode = _unit(control, tiny_bpe, "d", "decode")
    again = None
    try:
        wait_until(lambda: _ready_pid(srv.url, "p") and _ready_pid(srv.url, "d"), timeout_s=120)
        expected = _complete(srv.url)

        def stream() -> str:
            body = {**BODY, "prompt": "long", "max_tokens": 100_000, "stream": True}
            try:
                with httpx.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError as err:
                return type(err).__name__
            return "ended"

        with cf.ThreadPoolExecutor(1) as pool:
            running = pool.submit(stream)
            wait_until(lambda: metric(srv.url, "moeinfra:generation_tokens_total") > 5)
            srv.proc.send_signal(signal.SIGKILL)
            assert running.result(timeout=30) != "ended"  # the client is not left waiting
        srv.proc.wait(30)
        again = ServerProcess(args)
        began = time.monotonic()
        wait_until(lambda: _ready_pid(again.url, "p") and _ready_pid(again.url, "d"), 10.0)
        print(f"served again {time.monotonic() - began:.2f} s after the new server was ready")
        assert prefill.poll() is None and decode.poll() is None  # no unit restarted
        # the orphaned stream no longer runs on the decode unit
        wait_until(lambda: metric(again.url, "moeinfra:unit_running_requests") == 0)
        assert _complete(again.url) == expected
    finally:
        if again is not None:
            assert again.stop() == 0, "".join(again.log)
        srv.stop(signal.SIGKILL)
        _stop(prefill, decode)


def test_serve_up_starts_a_local_unit_that_died_again(tiny_bpe):
    srv = ServerProcess(["--model", str(tiny_bpe), "--block-size", "16", "--num-kv-blocks",
                         "256", "--prefill-ranks", "1", "--decode-ranks", "1"])  # fmt: skip
    try:
        expected = _complete(srv.url)
        decode_id = next(u for u, info in _units(srv.url).items() if info["role"] == "decode")
        victim = _ready_pid(srv.url, decode_id)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: _ready_pid(srv.url, decode_id) not in (None, victim), timeout_s=120)
        assert _complete(srv.url) == expected
        assert metric(srv.url, "moeinfra:unit_restarts_total", 'role="decode"') == 1
        events = httpx.get(f"{srv.url}/health").json()["events"]
        assert any(decode_id in e and "started again by serve up" in e for e in events)
    finally:
        assert srv.stop() == 0, "".join(srv.log)
