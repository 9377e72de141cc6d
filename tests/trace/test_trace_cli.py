"""CLI round trips on hand-built traces: --comm-pattern, folders, bad options."""

from __future__ import annotations

import json
import subprocess
import sys

from trace_builders import annotation, kernel, write_trace
from typer.testing import CliRunner

from moeinfra.cli.trace import app

runner = CliRunner()


def test_comm_pattern_option_changes_the_classes(tmp_path):
    path = write_trace(
        tmp_path / "t.json",
        [kernel("gemm", 0, 10), kernel("void my::a2a<8>(int)", 5, 10, stream=8)],
    )
    plain = json.loads(runner.invoke(app, ["report", str(path), "--json"]).output)
    extra = json.loads(
        runner.invoke(app, ["report", str(path), "--json", "--comm-pattern", "my::a2a"]).output
    )
    assert plain["devices"][0]["comm_us"] == 0
    dev = extra["devices"][0]
    assert dev["comm_us"] == 10 and dev["overlap_us"] == 5 and dev["comm_hidden_fraction"] == 0.5
    kernels = json.loads(
        runner.invoke(app, ["kernels", str(path), "--json", "--comm-pattern", "my::a2a"]).output
    )
    assert {k["name"]: k["op_class"] for k in kernels["kernels"]}[
        "void my::a2a<8>(int)"
    ] == "communication"


def test_folder_report_and_empty_trace(tmp_path):
    folder = tmp_path / "ranks"
    folder.mkdir()
    for rank in range(2):
        write_trace(
            folder / f"r{rank}.json.gz",
            [kernel("gemm", 0, 10 + rank)],
            gz=True,
            distributedInfo={"rank": rank},
        )
    doc = json.loads(runner.invoke(app, ["report", str(folder), "--json", "--quiet"]).output)
    assert [(d["rank"], d["compute_us"]) for d in doc["devices"]] == [(0, 10), (1, 11)]
    res = runner.invoke(app, ["report", str(folder), "--quiet"])
    assert res.exit_code == 0 and "all devices" in res.output
    cpu_only = write_trace(tmp_path / "c.json", [annotation("step", 0, 10)])
    res = runner.invoke(app, ["report", str(cpu_only)])
    assert res.exit_code == 0 and "no GPU ops" in res.output
    # no events at all (an empty list, or JSON that is no trace) is an error
    for name, text in (("e.json", '{"traceEvents": []}'), ("a.json", '{"a": 1}')):
        (tmp_path / name).write_text(text)
        res = runner.invoke(app, ["report", str(tmp_path / name)])
        assert res.exit_code != 0 and "no trace events" in str(res.exception)
    cli = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "trace", "report", str(tmp_path / "a.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 2 and "Traceback" not in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1 and "no trace events" in cli.stderr


def test_events_without_ts_or_beyond_int64_are_skipped_and_counted(tmp_path):
    from moeinfra.trace import read_trace

    ok = kernel("gemm", 5, 10)
    no_ts = {k: v for k, v in kernel("late", 0, 10).items() if k != "ts"}
    huge = kernel("huge", 1e30, 10)
    trace = read_trace(write_trace(tmp_path / "t.json", [ok, no_ts, huge]))
    assert len(trace.gpu) == 1 and trace.gpu.start_ns.tolist() == [5000]
    assert trace.skipped == {"event without ts or with ts beyond int64 ns": 2}


def test_bad_zoom_is_an_input_error(tmp_path):
    path = write_trace(tmp_path / "t.json", [kernel("gemm", 0, 10)])
    res = runner.invoke(app, ["report", str(path), "-o", str(tmp_path / "x.png"), "--zoom", "9:1"])
    assert res.exit_code != 0 and "zoom" in str(res.exception)


def test_trace_package_never_imports_torch(tmp_path):
    import subprocess
    import sys

    path = write_trace(tmp_path / "t.json", [kernel("gemm", 0, 10)])
    code = (
        "import sys\n"
        "from moeinfra.trace import analyze, kernel_breakdown\n"
        "from moeinfra.trace.timeline import plot_timeline\n"
        f"r = analyze({str(path)!r})\n"
        f"plot_timeline(r, {str(tmp_path / 't.png')!r})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
