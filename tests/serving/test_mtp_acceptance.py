"""MTP acceptance fed to the serving model: a number, or the first-draft acceptance that a server's
``/metrics`` counted (a saved file or a URL); ``serve model --mtp-acceptance`` on decode, a one-line
error on prefill and on bad sources."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading

import pytest
from prometheus_client import generate_latest

from moeinfra.cli.main import main
from moeinfra.errors import InputError
from moeinfra.server.messages import State
from moeinfra.server.metrics import ServerMetrics
from moeinfra.serving.mtp_acceptance import (
    MtpAcceptance,
    acceptance_from_metrics,
    read_mtp_acceptance,
)


def metrics_text(drafts: int, accepted_per_pos: list[int], draft_tokens: int | None = None) -> str:
    """What ``GET /metrics`` serves after a decode unit reported these totals, in two reports (the
    server adds the increments), rendered by prometheus_client as the server renders it."""
    m = ServerMetrics()
    half = State(
        spec_num_drafts=drafts // 2,
        spec_num_draft_tokens=(draft_tokens or drafts * len(accepted_per_pos)) // 2,
        spec_num_accepted_tokens=sum(accepted_per_pos) // 2,
        spec_accepted_per_pos=[a // 2 for a in accepted_per_pos],
    )
    full = State(
        spec_num_drafts=drafts,
        spec_num_draft_tokens=draft_tokens or drafts * len(accepted_per_pos),
        spec_num_accepted_tokens=sum(accepted_per_pos),
        spec_accepted_per_pos=accepted_per_pos,
    )
    m.rank_counters(State(), half)
    m.rank_counters(half, full)
    m.ttft.observe(0.2)  # other metrics beside them
    return generate_latest(m.registry).decode()


def serve(*args: str, monkeypatch, capsys) -> tuple[int, str, str]:
    """``moeinfra serve ARGS`` in this process, through the console script's entry point."""
    monkeypatch.setattr(sys, "argv", ["moeinfra", "serve", *args])
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


def test_first_draft_acceptance_from_the_servers_own_metrics():
    # two drafts per round: 1,000 rounds, 350 first drafts and 140 second ones accepted
    got = acceptance_from_metrics(metrics_text(1000, [350, 140]), "m.txt")
    assert got.acceptance == pytest.approx(0.35)
    assert got.drafts == 1000 and got.accepted_per_position == (350, 140)
    assert got.per_position == pytest.approx((0.35, 0.14))
    assert got.measured and got.source == "m.txt"
    # not the all-positions rate (490 of 2,000 draft tokens)
    assert got.acceptance != pytest.approx(490 / 2000)
    assert got.to_dict()["verification_rounds_with_drafts"] == 1000
    assert "350 of 1,000 first drafts accepted (m.txt)" in got.describe()


def test_vllm_counters_with_engine_labels_are_summed():
    text = "\n".join(
        [
            "# TYPE vllm:spec_decode_num_drafts counter",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 600.0',
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 400.0',
            "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 500.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",position="0"} 330.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 100.0',
            "",
        ]
    )
    got = acceptance_from_metrics(text, "vllm.txt")
    assert got.acceptance == pytest.approx(0.83) and got.accepted_per_position == (830, 100)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no moeinfra:spec_decode_num_drafts counters"),
        (metrics_text(0, [0]), "0 verification rounds with drafts"),
        (metrics_text(100, [0]), "measured acceptance 0 (0 of 100 first drafts accepted)"),
        (metrics_text(100, [100]), "measured acceptance 1 (100 of 100"),
        ('{"prompt": "x", "num_draft_tokens": 3}\n', "not a Prometheus text exposition"),
        (
            "# TYPE moeinfra:spec_decode_num_drafts counter\n"
            "moeinfra:spec_decode_num_drafts_total 5.0\n",
            'no spec_decode_num_accepted_tokens_per_pos{position="0"}',
        ),
    ],
)
def test_unusable_metrics_are_one_line_naming_the_option_and_source(text, message):
    with pytest.raises(InputError) as err:
        acceptance_from_metrics(text, "m.txt", "--mtp-acceptance")
    assert str(err.value).startswith("--mtp-acceptance=m.txt: ")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_number_a_file_and_bad_values(tmp_path):
    assert read_mtp_acceptance("0.85") == MtpAcceptance(0.85)
    assert read_mtp_acceptance(0.0) == MtpAcceptance(0.0)
    saved = tmp_path / "m.txt"
    saved.write_text(metrics_text(200, [70]))
    got = read_mtp_acceptance(str(saved))
    assert got.acceptance == pytest.approx(0.35) and got.source == str(saved)
    for bad, message in [
        ("1", "--mtp-acceptance=1 must be a number in [0, 1)"),
        ("-0.1", "--mtp-acceptance=-0.1 must be"),
        ("nan", "--mtp-acceptance=nan must be"),
        (str(tmp_path / "missing.txt"), "missing.txt: no such file"),
        (str(tmp_path), "is a folder"),
    ]:
        with pytest.raises(InputError) as err:
            read_mtp_acceptance(bad, "--mtp-acceptance")
        assert message in str(err.value), str(err.value)


class _Metrics(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path != "/metrics":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_url():
    """A server on a free local port answering ``GET /metrics`` with 1,000 rounds, 420 accepted."""
    _Metrics.body = metrics_text(1000, [420, 150]).encode()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.timeout(60)
def test_a_url_of_a_running_server(metrics_url):
    for url in (f"{metrics_url}/metrics", metrics_url, metrics_url + "/"):
        got = read_mtp_acceptance(url, "--mtp-acceptance", timeout_s=10)
        assert got.acceptance == pytest.approx(0.42) and got.drafts == 1000
    with pytest.raises(InputError, match=r"--mtp-acceptance=.*/nope: HTTP 404"):
        read_mtp_acceptance(f"{metrics_url}/nope", "--mtp-acceptance", timeout_s=10)


@pytest.mark.timeout(60)
def test_a_url_nothing_answers_is_one_line():
    import socket

    with socket.socket() as s:  # a free port, closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(InputError, match=r"--mtp-acceptance=http://127\.0\.0\.1:\d+/metrics: "):
        read_mtp_acceptance(f"http://127.0.0.1:{port}", "--mtp-acceptance", timeout_s=5)


def decode(monkeypatch, capsys, *args: str) -> dict:
    code, out, err = serve(
        "model", "--phase", "decode", "--batch", "1", *args, "--json",
        monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    return json.loads(out)


def test_serve_model_counts_one_plus_acceptance_tokens_a_step(monkeypatch, capsys, tmp_path):
    off = decode(monkeypatch, capsys)
    deepseek = decode(monkeypatch, capsys, "--mtp-acceptance", "0.85")
    alias = decode(monkeypatch, capsys, "--mtp", "0.85")
    saved = tmp_path / "metrics.txt"
    saved.write_text(metrics_text(2000, [700, 280]))  # the tiny trained model's 35%
    measured = decode(monkeypatch, capsys, "--mtp-acceptance", str(saved))
    assert off["mtp"] is None and off["output_tokens_per_step_per_request"] == 1.0
    assert alias == deepseek
    assert deepseek["mtp"] == {
        "acceptance": 0.85,
        "source": "given",
        "verification_rounds_with_drafts": None,
        "acceptance_per_position": None,
    }
    assert measured["mtp"]["acceptance"] == pytest.approx(0.35)
    assert measured["mtp"]["source"] == str(saved)
    assert measured["mtp"]["acceptance_per_position"] == pytest.approx([0.35, 0.14])
    # one step's time with a draft, whatever its acceptance; 1 + acceptance tokens from it
    assert measured["step_ms"] == pytest.approx(deepseek["step_ms"])
    assert measured["step_ms"] > off["step_ms"]
    for run in (off, deepseek, measured):
        tokens = run["output_tokens_per_step_per_request"]
        assert run["output_tokens_per_s_per_request"] == pytest.approx(
            tokens / run["step_ms"] * 1e3
        )
        per_node = tokens * run["gpus"] / run["nodes"] / run["step_ms"] * 1e3
        assert run["tokens_per_s_per_node"] == pytest.approx(per_node)
    # one request per GPU (memory-bound: the draft costs little): measured 0.35 sits between
    speed = [r["output_tokens_per_s_per_request"] for r in (off, measured, deepseek)]
    assert speed == sorted(speed) and len(set(speed)) == 3


def test_serve_model_table_says_where_the_acceptance_came_from(monkeypatch, capsys, tmp_path):
    saved = tmp_path / "metrics.txt"
    saved.write_text(metrics_text(2000, [700]))
    code, out, err = serve(
        "model", "--mtp-acceptance", str(saved), monkeypatch=monkeypatch, capsys=capsys
    )
    assert code == 0, err
    text = " ".join(out.split())
    assert "tokens/s per request" in text
    assert "MTP acceptance 0.35, measured: 700 of 2,000 first drafts accepted" in text
    assert "1.35 tokens per request per step" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["model", "--phase", "prefill", "--mtp-acceptance", "0.8"],
         "error: --mtp-acceptance=0.8 applies to --phase decode only"),
        (["model", "--mtp-acceptance", "1.5"], "error: --mtp-acceptance=1.5 must be a number in"),
        (["model", "--mtp", "abc"], "error: --mtp-acceptance=abc: no such file"),
        (["frontier", "--mtp", "1"], "error: --mtp-acceptance=1 must be"),
        (["position-cost", "--mtp-acceptance", "-1"], "error: --mtp-acceptance=-1 must be"),
        (["plan", "--mtp-acceptance", "EMPTY"], "error: --mtp-acceptance="),
    ],
)  # fmt: skip
def test_bad_acceptance_is_one_line_and_exit_2(args, message, monkeypatch, capsys, tmp_path):
    if "EMPTY" in args:  # a file with no spec_decode counters
        (tmp_path / "empty.txt").write_text("")
        args = [str(tmp_path / "empty.txt") if a == "EMPTY" else a for a in args]
    code, out, err = serve(*args, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), err


def test_plan_frontier_and_position_cost_take_a_measured_source(monkeypatch, capsys, tmp_path):
    saved = tmp_path / "metrics.txt"
    saved.write_text(metrics_text(1000, [600]))
    code, out, err = serve(
        "frontier", "--nodes", "8", "--mtp-acceptance", str(saved), "--json",
        monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    front = json.loads(out)
    assert front["mtp_acceptance"] == pytest.approx(0.6)
    assert front["mtp"]["verification_rounds_with_drafts"] == 1000
    code, out, err = serve(
        "position-cost", "--mtp-acceptance", str(saved), "--json",
        monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["mtp_acceptance"] == pytest.approx(0.6)


def test_reading_acceptance_never_imports_torch(tmp_path):
    saved = tmp_path / "metrics.txt"
    saved.write_text(metrics_text(10, [4]))
    code = (
        "import sys; from moeinfra.serving.mtp_acceptance import read_mtp_acceptance; "
        f"assert read_mtp_acceptance({str(saved)!r}).acceptance == 0.4; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
