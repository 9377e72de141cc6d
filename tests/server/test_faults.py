"""Faults as users meet them: SIGTERM with a request running, a unit killed mid-stream."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import socket

import httpx
from tests.server.conftest import ServerProcess, fake_router, metric, wait_until

from moeinfra.engine import LLM, SamplingParams
from moeinfra.server.messages import Abort, Add, Bye

SMALL = ["--block-size", "16", "--num-kv-blocks", "256", "--prefill-ranks", "1"]


def _stream(url: str, body: dict) -> tuple[list[dict], bool]:
    """Events of a streamed completion and whether it ended with [DONE]."""
    events, done = [], False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events, done


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _leave_unanswered(url: str, body: dict) -> None:
    """Send a non-streamed request and hang up before its answer."""
    host, port = url.split("//")[1].split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        wait_until(lambda: metric(url, "moeinfra:requests_in_flight") >= 1)


def test_sigterm_drains_running_requests_then_everything_exits(tiny_bpe):
    """A streamed request runs to its end; a non-streamed one whose client hung up is aborted
    and its handler freed (it does not hold the drain for ``--drain-timeout``)."""
    srv = ServerProcess(["--model", str(tiny_bpe), *SMALL, "--decode-ranks", "2",
                         "--drain-timeout", "300s"])  # fmt: skip
    port = int(srv.url.rsplit(":", 1)[1])
    children = srv.children()
    assert len(children) >= 4  # prefill unit, decode unit and its two ranks
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 150, "ignore_eos": True}
    _leave_unanswered(srv.url, {**body, "max_tokens": 1500})
    wait_until(lambda: metric(srv.url, "moeinfra:requests_total", 'finish_reason="abort"') >= 1)
    with cf.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_stream, srv.url, {**body, "stream": True})
        wait_until(
            lambda: (
                metric(srv.url, "moeinfra:generation_tokens_total") >= 0
                and metric(srv.url, "moeinfra:requests_in_flight") == 1
            )
        )
        srv.proc.send_signal(signal.SIGTERM)
        events, done = running.result(timeout=120)
    assert done and events[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events)  # it really ran to the end
    assert srv.proc.wait(60) == 0, "".join(srv.log)

    def gone() -> bool:  # (a unit's multiprocessing helper may take a moment after its unit)
        return not [pid for pid in children if _running(pid)]

    wait_until(gone, timeout_s=10)
    with socket.socket() as s:  # nobody listens on the port: a new server can take it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_a_killed_decode_unit_fails_or_retries_its_requests_and_the_rest_go_on(tiny_bpe):
    srv = ServerProcess(["--model", str(tiny_bpe), *SMALL, "--decode-ranks", "1",
                         "--decode-units", "2"])  # fmt: skip
    try:
        prompts = ["hello world", "KV cache", "The decode unit", "Prefill and decode"]
        # the streams run four times longer than the plain requests: they are still decoding
        # when the unit is killed, however long the plain ones took to reach decode
        with LLM(tiny_bpe, block_size=16, num_kv_blocks=256) as llm:
            expected, expected_stream = (
                [
                    r.outputs[0].text
                    for r in llm.generate(
                        prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                    )
                ]
                for n in (200, 800)
            )
        body = {"model": "tiny", "max_tokens": 200, "temperature": 0, "ignore_eos": True}

        def plain(p):
            return httpx.post(f"{srv.url}/v1/completions", json={**body, "prompt": p}, timeout=120)

        def decoding_per_unit() -> list[float]:
            health = httpx.get(f"{srv.url}/health").json()["units"]
            return [
                metric(srv.url, "moeinfra:unit_running_requests", f'unit="{u}"')
                for u, info in health.items()
                if info["role"] == "decode"
            ]

        with cf.ThreadPoolExecutor(8) as pool:
            streams = [
                pool.submit(
                    _stream, srv.url, {**body, "max_tokens": 800, "prompt": p, "stream": True}
                )
                for p in prompts
            ]
            # the streams first, until both decode units hold one: whichever unit is killed
            # then holds a stream (the plain requests could otherwise all sit on the victim)
            wait_until(lambda: (n := decoding_per_unit()) and min(n) >= 1 and sum(n) >= 4)
            whole = [pool.submit(plain, p) for p in prompts]
            wait_until(
                lambda: (
                    metric(srv.url, "moeinfra:generation_tokens_total") >= 0
                    and metric(srv.url, "moeinfra:unit_running_requests", 'role="decode"') >= 6
                )
            )
            health = httpx.get(f"{srv.url}/health").json()["units"]
            victim = max(
                (u for u, info in health.items() if info["role"] == "decode"),
                key=lambda u: metric(srv.url, "moeinfra:unit_running_requests", f'unit="{u}"'),
            )
            os.kill(health[victim]["pids"][0], signal.SIGKILL)
            results = [f.result(timeout=120) for f in streams]
            answers = [f.result(timeout=120) for f in whole]
        # non-streaming requests had shown the client nothing: retried on the other unit, whole
        assert [a.status_code for a in answers] == [200] * 4
        assert [a.json()["choices"][0]["text"] for a in answers] == expected
        # streams on the dead unit end with an error event; the others finish
        failed = [ev for ev, done in results if not done]
        assert failed, "the killed unit held no stream"
        assert all("error" in ev[-1] for ev in failed)
        for (ev, done), text in zip(results, expected_stream, strict=True):
            if done:
                assert "".join(e["choices"][0]["text"] for e in ev if e.get("choices")) == text
        # the server goes on (with the unit it has left until serve up has started the killed
        # one again: a race with the retried requests), and nothing is left in flight
        wait_until(lambda: metric(srv.url, "moeinfra:unit_restarts_total", 'role="decode"') == 1)
        assert metric(srv.url, "moeinfra:units_alive", 'role="decode"') >= 1
        assert plain("hello world").json()["choices"][0]["text"] == expected[0]
        wait_until(lambda: metric(srv.url, "moeinfra:requests_in_flight") == 0)
        wait_until(lambda: metric(srv.url, "moeinfra:kv_blocks_used", 'role="decode"') == 0)
    finally:
        assert srv.stop() == 0, "".join(srv.log)


def test_a_unit_saying_goodbye_on_its_own_loses_its_requests():
    """A failing rank says "bye" and exits: its requests must end (error or retry), not hang."""
    import asyncio as aio

    from moeinfra.server.router import Tracked

    async def scenario():
        router = fake_router({"p0": ("prefill", 0.0), "d0": ("decode", 0.0)})
        prefill, decode = router.units["p0"].ranks[0], router.units["d0"].ranks[0]
        tracked = Tracked("r1", [1, 2, 3], SamplingParams(), 0)
        tracked.prefill, tracked.decode = prefill, decode
        router.requests["r1"] = tracked
        router._on_message(b"p0/0", Bye(0))
        assert not router.units["p0"].alive
        first = await aio.wait_for(tracked.events.get(), 1.0)
        return first, await aio.wait_for(tracked.events.get(), 1.0)

    restart, error = aio.run(scenario())
    # untouched by the client: retried, and with no other prefill unit it ends with an error
    assert restart[0] == "restart" and error[0] == "error" and "p0" in error[2]


def test_a_drained_unit_saying_goodbye_is_not_a_loss():
    router = fake_router({"p0": ("prefill", 0.0)})
    router.drain("p0")
    router._on_message(b"p0/0", Bye(0))
    assert not router.units["p0"].alive and not any("stopped" in n for n in router.notes)


def test_a_unit_silent_past_the_unit_timeout_is_lost_and_a_reporting_one_is_kept():
    import asyncio as aio
    import time

    async def scenario():
        router = fake_router({"quiet": ("decode", 0.0), "talking": ("decode", 0.0)})
        router.unit_timeout_s = 1.0
        now = time.monotonic()
        router.units["quiet"].last_seen = now - 1.5
        router.units["talking"].last_seen = now - 0.5
        watch = aio.create_task(router._watch_loop())
        await aio.sleep(0.3)
        watch.cancel()
        return router

    router = aio.run(scenario())
    assert router.units["talking"].ready and router.units["talking"].alive
    assert not router.units["quiet"].alive
    assert any("quiet" in n and "stopped reporting" in n for n in router.notes)


def test_an_output_of_the_attempt_a_retry_replaced_is_not_taken_for_the_retrys():
    """A decode unit dies while a request's first token is on its way from the prefill rank: the
    retry goes to the same prefill rank under a new id, and the old attempt's late token is
    dropped (and stopped there), not shown as the retry's."""
    from moeinfra.engine.outputs import StepOutput
    from moeinfra.server.router import Tracked

    router = fake_router({"p0": ("prefill", 0.0), "d0": ("decode", 0.0), "d1": ("decode", 0.0)})
    sent = []
    router._send = lambda rank, message: sent.append((rank.unit.unit_id, message))
    tracked = Tracked("cmpl-1", [1, 2, 3], SamplingParams(max_tokens=4), 0)
    router.submit(tracked)
    prefill, first_decode = tracked.prefill, tracked.decode
    assert sent[-1][0] == "p0" and sent[-1][1] == Add(
        "cmpl-1", [1, 2, 3], tracked.params, first_decode.kv_address
    )
    router.unit_lost(first_decode.unit, "exited")
    assert tracked.decode is not first_decode and tracked.prefill is prefill
    assert ("p0", Abort("cmpl-1")) in sent
    retry_id = sent[-1][1].request_id
    assert isinstance(sent[-1][1], Add) and retry_id != "cmpl-1"
    assert tracked.events.get_nowait() == ("restart", "cmpl-1")
    router._output(prefill, StepOutput("cmpl-1", [7], "x", False))  # the old attempt's token
    assert tracked.events.empty() and sent[-1] == ("p0", Abort("cmpl-1"))
    router._output(prefill, StepOutput(retry_id, [8], "y", False))
    out = tracked.events.get_nowait()
    assert (out.request_id, out.new_token_ids) == ("cmpl-1", [8])
    assert tracked.generated == 1


def test_decode_tokens_that_overtake_the_first_token_wait_for_it():
    """The decode rank's tokens travel on another connection than the prefill rank's first token
    and can arrive before it (seen under load: an answer starting with its second and third
    tokens). The router holds them until the first token arrives, then passes them on in order."""
    from moeinfra.engine.outputs import StepOutput
    from moeinfra.server.router import Tracked

    router = fake_router({"p0": ("prefill", 0.0), "d0": ("decode", 0.0)})
    router._send = lambda rank, message: None
    tracked = Tracked("cmpl-2", [1, 2, 3], SamplingParams(max_tokens=3), 0)
    router.submit(tracked)
    router._output(tracked.decode, StepOutput("cmpl-2", [9], "b", False))
    router._output(tracked.decode, StepOutput("cmpl-2", [10], "c", True, "length"))
    assert tracked.events.empty() and "cmpl-2" in router.requests
    router._output(tracked.prefill, StepOutput("cmpl-2", [8], "a", False))
    texts = [tracked.events.get_nowait().new_text for _ in range(3)]
    assert texts == ["a", "b", "c"] and tracked.events.empty()
    assert "cmpl-2" not in router.requests and tracked.generated == 3


def test_a_hand_off_the_decode_rank_does_not_take_fails_its_request_in_time():
    """The prefill rank's first token is in, the KV never reaches the decode rank (a wrong
    address, a stalled host): the request ends with an error naming the decode unit, and a
    request whose hand-off the decode rank took is left alone."""
    import asyncio as aio

    from moeinfra.engine.outputs import StepOutput
    from moeinfra.server.messages import Received
    from moeinfra.server.router import Tracked

    async def scenario():
        router = fake_router({"p0": ("prefill", 0.0), "d0": ("decode", 0.0)})
        router._send = lambda rank, message: None
        router.kv_transfer_timeout_s = 0.3
        lost, taken = (Tracked(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), 0) for i in (1, 2))
        for tracked in (lost, taken):
            router.submit(tracked)
            router._output(tracked.prefill, StepOutput(tracked.request_id, [8], "a", False))
        router._on_message(b"d0/0", Received("r2"))
        watch = aio.create_task(router._watch_loop())
        await aio.sleep(0.6)
        watch.cancel()
        return router, lost, taken

    router, lost, taken = aio.run(scenario())
    events = []
    while not lost.events.empty():
        events.append(lost.events.get_nowait())
    assert events[-1][0] == "error" and "d0" in events[-1][2]
    assert "--kv-transfer-timeout" in events[-1][2] and "r1" not in router.requests
    assert "r2" in router.requests and taken.handoff_deadline is None


def test_a_stalled_decode_unit_fails_a_hand_off_at_the_kv_transfer_timeout(tiny_bpe):
    """The decode unit is stopped (SIGSTOP): the request does not wait for the unit timeout
    (10 s) or forever; it fails after --kv-transfer-timeout with the reason."""
    srv = ServerProcess(["--model", str(tiny_bpe), *SMALL, "--decode-ranks", "1",
                         "--kv-transfer-timeout", "1s"])  # fmt: skip
    decode_pid = None
    try:
        health = httpx.get(f"{srv.url}/health").json()["units"]
        decode_pid = next(u["pids"][0] for u in health.values() if u["role"] == "decode")
        os.kill(decode_pid, signal.SIGSTOP)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 8}
        answer = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code >= 500
        message = answer.json()["error"]["message"]
        assert "did not complete within 1 s" in message and "--kv-transfer-timeout" in message
    finally:
        if decode_pid is not None:
            os.kill(decode_pid, signal.SIGCONT)
        assert srv.stop() == 0, "".join(srv.log)
