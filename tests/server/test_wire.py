"""Every socket carries typed messages (never pickle): junk, foreign and pickled frames are dropped,
counted and logged, the server goes on; with ``--secret-file`` only peers holding the secret get a
frame through (CurveZMQ), and a socket bound beyond loopback needs one."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import time

import httpx
import pytest
import zmq
from tests.server.conftest import ServerProcess, metric, wait_until

from moeinfra.engine.params import SamplingParams
from moeinfra.server.messages import (
    Add,
    BadFrame,
    Hello,
    KVHeader,
    Outputs,
    State,
    decode_kv_header,
    decode_to_rank,
    decode_to_router,
    encode,
)


class _Planted:
    """Unpickling this creates a folder: the proof a receiver unpickled what it got."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_messages_round_trip_and_junk_is_refused_without_running_it(tmp_path):
    params = SamplingParams(max_tokens=3, logit_bias={5: 1.0}, stop=["x"], seed=7)
    add = Add("r1", [1, 2, 3], params, "tcp://h:1")
    assert decode_to_rank(encode(add)) == add
    state = State(running=2, steps=[(1, 16, 0, 136, 1, 0.01, 1.7e9)], expert_gpu_load=[[1.0, 2.0]])
    assert decode_to_router(encode(state)) == state
    planted = tmp_path / "unpickled"
    for junk in (
        os.urandom(20),
        pickle.dumps(_Planted(planted)),
        encode({"type": "nonsense"}),
        encode(Outputs([])) + b"tail",
        # a well-formed add whose parameters the engine refuses
        encode(
            {"type": "add", "request_id": "r", "prompt_ids": [1], "params": {"temperature": -1}}
        ),
    ):
        with pytest.raises(BadFrame):
            decode_to_rank(junk)
        with pytest.raises(BadFrame):
            decode_to_router(junk)
        with pytest.raises(BadFrame):
            decode_kv_header(junk)
    assert not planted.exists()
    with pytest.raises(BadFrame):  # a header missing its block checksums
        decode_kv_header(encode({"request_id": "r", "prompt_ids": [1]}))
    header = KVHeader("r", [1], [2], params, 0, [], (1, 1, 4), "torch.float32", 16, [0])
    assert decode_kv_header(encode(header)) == header


def _control_address(server) -> str:
    return re.search(r"control (tcp://\S+)\)", "".join(server.log)).group(1)


def _sock(kind: int, address: str, keys=None):
    from moeinfra.server.secret import connect_securely

    ctx = zmq.Context.instance()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        connect_securely(sock, keys)
    sock.connect(address)
    return sock


def _answers(server) -> bool:
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.fixture(scope="module")
def secret(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "secret"
    path.write_text(os.urandom(32).hex())
    return path


def test_junk_on_the_control_and_kv_sockets_is_dropped_and_the_server_goes_on(tiny_bpe, tmp_path):
    planted = tmp_path / "unpickled"
    srv = ServerProcess(["--model", str(tiny_bpe), "--prefill-ranks", "1", "--decode-ranks", "1",
                         "--block-size", "16", "--num-kv-blocks", "128"])  # fmt: skip
    try:
        control = _sock(zmq.DEALER, _control_address(srv))
        control.send(os.urandom(20))
        control.send(pickle.dumps(_Planted(planted)))
        control.send_multipart([b"three", b"frames", b"here"])
        # typed but foreign: outputs of a rank the server never met, a hello missing its fields
        control.send(encode(Outputs([])))
        control.send(encode({"type": "hello", "unit": "u"}))
        wait_until(lambda: metric(srv.url, "moeinfra:dropped_frames_total", "control") >= 4)
        assert _answers(srv) and not planted.exists()
        decode = next(
            u for u in httpx.get(f"{srv.url}/health").json()["units"].values()
            if u["role"] == "decode"
        )  # fmt: skip
        kv = _sock(zmq.PUSH, decode["kv_addresses"][0])
        kv.send(pickle.dumps(_Planted(planted)))
        kv.send_multipart([os.urandom(30), os.urandom(64)])
        wait_until(lambda: metric(srv.url, "moeinfra:dropped_frames_total", "unit") >= 2)
        assert _answers(srv) and not planted.exists()
        assert httpx.get(f"{srv.url}/health").status_code == 200
        control.close()
        kv.close()
    finally:
        assert srv.stop() == 0, "".join(srv.log)
    log = "".join(srv.log)
    assert log.count("dropped a frame on the control socket") == 1  # logged once, then counted
    assert log.count("dropped a frame on its KV socket") == 1


def test_with_a_secret_only_peers_that_hold_it_get_through(tiny_bpe, secret, tmp_path):
    from moeinfra.server.secret import CurveKeys, read_secret

    srv = ServerProcess(["--model", str(tiny_bpe), "--colocated-units", "1",
                         "--prefill-units", "0", "--decode-units", "0", "--colocated-ranks", "1",
                         "--block-size", "16", "--num-kv-blocks", "128",
                         "--secret-file", str(secret)])  # fmt: skip
    try:
        assert _answers(srv)  # its own units hold the secret
        address = _control_address(srv)
        hello = Hello("intruder", 0, 1, "decode", "x", max_num_seqs=1)
        for keys in (None, CurveKeys.from_secret(b"another secret, 16+ bytes")):
            peer = _sock(zmq.DEALER, address, keys)
            peer.send(encode(hello))
            time.sleep(0.5)
            peer.close()
        wait_until(lambda: metric(srv.url, "moeinfra:refused_peers_total") >= 2)
        units = httpx.get(f"{srv.url}/health").json()["units"]
        assert "intruder" not in units and len(units) == 1
        # with the secret a peer gets through: it is taken as a unit (that is what it proves)
        peer = _sock(zmq.DEALER, address, read_secret(secret))
        peer.send(encode(Hello("holder", 0, 1, "decode", "x", max_num_seqs=1)))
        assert decode_to_rank(peer.recv())  # told to stop: it serves another model
        peer.close()
        assert _answers(srv)
    finally:
        assert srv.stop() == 0, "".join(srv.log)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["serve", "up", "--control", "tcp://0.0.0.0:0"], "--control=tcp://0.0.0.0:0"),
        (["serve", "up", "--kv-host", "10.1.2.3", "--prefill-units", "1"], "--kv-host=10.1.2.3"),
        (["serve", "unit", "--server", "tcp://127.0.0.1:1", "--role", "decode",
          "--kv-host", "0.0.0.0"], "--kv-host=0.0.0.0"),
        (["serve", "up", "--secret-file", "/nonexistent/secret"], "--secret-file"),
    ],
)  # fmt: skip
def test_a_socket_beyond_loopback_needs_a_secret(args, names, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in r.stderr


def test_a_short_secret_is_refused(tmp_path):
    from moeinfra.errors import InputError
    from moeinfra.server.secret import check_exposure, is_loopback, read_secret

    short = tmp_path / "s"
    short.write_text("tooshort\n")
    with pytest.raises(InputError, match="holds 8 bytes, at least 16"):
        read_secret(short)
    assert is_loopback("tcp://127.0.0.1:5") and is_loopback("tcp://[::1]:5")
    assert is_loopback("localhost") and not is_loopback("tcp://*:5")
    check_exposure({"--control": "tcp://0.0.0.0:1"}, None, insecure=True)  # the operator's call


def test_a_decode_unit_on_another_host_advertises_its_routable_address():
    """Without --kv-host a decode unit binds the address it reaches the server from, never a
    loopback that prefill ranks elsewhere would take for their own (then, beyond loopback, it
    needs the secret); an unreachable server is one line naming --server and --kv-host."""
    from moeinfra.errors import InputError
    from moeinfra.server.unit import address_toward

    assert address_toward("tcp://127.0.0.1:5557") == "127.0.0.1"
    with pytest.raises(InputError, match="--server=tcp://no-such-host.invalid:1.*--kv-host"):
        address_toward("tcp://no-such-host.invalid:1")
    r = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "serve", "unit", "--server", "tcp://10.255.0.1:5557",
         "--role", "decode"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "--kv-host" in r.stderr and "127.0.0.1" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
