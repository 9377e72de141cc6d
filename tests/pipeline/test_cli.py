"""``moeinfra pipeline simulate`` / ``compare`` round trips."""

import json
import subprocess
import sys


def _run(*args, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "pipeline", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_simulate_json_png_trace(tmp_path):
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    out = _run(
        "simulate",
        "--schedule",
        "dualpipev",
        "--ranks",
        "4",
        "--microbatches",
        "10",
        "--costs",
        "F=1,B=2,W=1,FB=3",
        "--json",
        "-o",
        str(png),
        "--trace",
        str(trace),
    ).stdout
    data = json.loads(out)
    assert data["schedule"] == "dualpipev" and data["ranks"] == 4 and data["microbatches"] == 10
    assert data["makespan"] == 66.0
    rank0 = data["per_rank"][0]
    assert {"busy", "idle", "peak_activations", "actions"} <= set(rank0)
    assert rank0["actions"][:2] == ["F0.0", "F0.1"] and "F0.7&B7.3" in rank0["actions"]
    assert data["per_rank"][3]["idle"] == 6.0  # (PP/2-1)(F&B+B-3W) with PP = 8
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(trace.read_text())["traceEvents"]


def test_simulate_table_and_compare():
    out = _run(
        "simulate",
        "--schedule",
        "1f1b",
        "--ranks",
        "4",
        "--microbatches",
        "8",
        "--comm",
        "rendezvous",
    ).stdout
    assert "makespan 33" in out
    data = json.loads(
        _run(
            "compare",
            "--ranks",
            "8",
            "--microbatches",
            "32",
            "--costs",
            "F=1,B=2,W=1,FB=2.4",
            "--json",
        ).stdout
    )
    assert data["best"] == "dualpipe"
    assert [s["schedule"] for s in data["schedules"]] == [
        "gpipe",
        "1f1b",
        "zb1p",
        "dualpipe",
        "dualpipev",
    ]
    table = _run(
        "compare", "--ranks", "4", "--microbatches", "8", "--costs", "F=1,B=2,W=1,FB=3.3"
    ).stdout
    assert "best for these costs: zb1p" in table


def test_bad_input_one_line_exit_2():
    proc = _run(
        "simulate", "--schedule", "dualpipe", "--ranks", "3", "--microbatches", "12", check=False
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "error: num_ranks=3 must be even for DualPipe (two halves meet in the middle)"
    )
    proc = _run(
        "simulate",
        "--schedule",
        "1f1b",
        "--ranks",
        "2",
        "--microbatches",
        "4",
        "--costs",
        "F=x",
        check=False,
    )
    assert proc.returncode == 2 and "costs='F=x'" in proc.stderr


def test_save_and_validate_file(tmp_path):
    path = tmp_path / "s.json"
    _run(
        "simulate", "--schedule", "zb1p", "--ranks", "2", "--microbatches", "3", "--save", str(path)
    )
    assert _run("validate", str(path)).stdout.startswith("ok: zb1p, 2 ranks")
    data = json.loads(path.read_text())
    data["actions"][0].remove("W0.1")
    path.write_text(json.dumps(data))
    proc = _run("validate", str(path), check=False)
    assert proc.returncode == 2 and "input gradient without a later W0.1" in proc.stderr
