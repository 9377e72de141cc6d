"""Iterations, idle-time breakdown, launch statistics and queue length: answers derived by hand.

One rank, times in µs. Launch calls (runtime thread) and the ops they launch:

    call        start dur  -> op  stream  [start, end)  launch delay = op start - call end
    L1 corr 1     10   5   ->  A     7     [20, 30)     5
    L2 corr 2     12   4   ->  B     7     [40, 42)     24   (B runs 2 < its 4 µs call: short)
    L3 corr 3     60   3   ->  C     7     [70, 80)     7
    L4 corr 4     65   2   ->  D     7     [150, 160)   83
    L5 corr 5    120  60   ->  E     7     [300, 301)   120  (call > 50 µs, delay > 100 µs)
    L6 corr 6    130   2   ->  M     9     [131, 132)   -1 -> clipped to 0 (memcpy; short)
    (no call)              ->  F     9     [5, 8)       unlinked
    cudaEventQuery corr 7 at 50: no op

ProfilerStep#1 = [0, 100), ProfilerStep#2 = [100, 200): L1-L4 (so A-D, although D runs at 150) are
step 1; L5, L6 (E, M) step 2; F (no launch) belongs to none.

Stream 7 gaps: 30->40 = 10 (B launched at 12 < 30, 10 < 30: kernel wait), 42->70 = 28 (C launched
at 60 > 42: host wait), 80->150 = 70 (D launched at 65 < 80: other), 160->300 = 140 (E at 120: other).
Stream 9: 8->131 = 123 (M launched at 130 > 8: host wait).
Device gaps (union of all streams): 8->20 = 12 (A at 10 > 8: host), 30->40 = 10 (kernel),
42->70 = 28 (host), 80->131 = 51 (M at 130 > 80: host), 132->150 = 18 (D at 65, 18 < 30: kernel),
160->300 = 140 (other): host 91, kernel 28, other 140 = idle 259 = span 296 - busy 37.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from trace_builders import annotation, kernel, launch, write_trace
from typer.testing import CliRunner

from moeinfra.cli.trace import app
from moeinfra.errors import InputError
from moeinfra.trace import (
    analyze,
    idle_breakdown,
    launch_stats,
    list_steps,
    queue_series,
    queue_summary,
    read_trace,
    select_step,
    step_breakdown,
)

runner = CliRunner()
US = 1000


def scenario() -> list[dict]:
    return [
        annotation("ProfilerStep#1", 0, 100),
        annotation("ProfilerStep#2", 100, 100),
        launch(10, 1, dur=5),
        launch(12, 2, dur=4),
        launch(50, 7, dur=1, name="cudaEventQuery"),
        launch(60, 3, dur=3),
        launch(65, 4, dur=2),
        launch(120, 5, dur=60),
        launch(130, 6, dur=2, name="cudaMemcpyAsync"),
        kernel("A", 20, 10, stream=7, corr=1),
        kernel("B", 40, 2, stream=7, corr=2),
        kernel("C", 70, 10, stream=7, corr=3),
        kernel("D", 150, 10, stream=7, corr=4),
        kernel("E", 300, 1, stream=7, corr=5),
        kernel("Memcpy HtoD", 131, 1, stream=9, corr=6, cat="gpu_memcpy"),
        kernel("F", 5, 3, stream=9),
    ]


@pytest.fixture
def path(tmp_path):
    return write_trace(tmp_path / "s.json", scenario())


@pytest.fixture
def trace(path):
    return read_trace(path)


def test_steps_own_the_ops_their_calls_launched(trace):
    steps = list_steps(trace)
    assert [(s.rank, s.step, s.gpu_ops, s.last) for s in steps] == [
        (0, 1, 4, False),
        (0, 2, 2, True),
    ]
    one = steps[0]
    assert (one.start_ns, one.end_ns, one.gpu_start_ns, one.gpu_end_ns) == (
        0,
        100 * US,
        20 * US,
        160 * US,
    )
    sub = select_step(trace, 1)
    assert sorted(sub.gpu.op_names().tolist()) == ["A", "B", "C", "D"]
    # CPU events starting in [0, 100): L1-L4 and the event query; annotations overlapping it
    assert sub.cpu.start_ns.tolist() == [10 * US, 12 * US, 50 * US, 60 * US, 65 * US]
    assert [sub.annotations.names[i] for i in sub.annotations.name_id] == ["ProfilerStep#1"]
    two = select_step(trace, 2)
    assert sorted(two.gpu.op_names().tolist()) == ["E", "Memcpy HtoD"]


def test_missing_step_names_the_steps_there_are(trace, tmp_path):
    with pytest.raises(InputError, match=r"step=7 is not in the trace; its steps are 1, 2"):
        select_step(trace, 7)
    bare = read_trace(write_trace(tmp_path / "b.json", [kernel("k", 0, 1)]))
    with pytest.raises(InputError, match="no ProfilerStep#N annotations"):
        select_step(bare, 1)
    assert list_steps(bare) == []


def test_steps_without_correlation_ids_fall_back_to_op_start_and_old_kineto_cpu_op(tmp_path):
    old = annotation("ProfilerStep#4", 0, 100)
    old["cat"] = "cpu_op"  # older Kineto wrote the step as an operator
    events = [old, annotation("ProfilerStep#5", 100, 100), kernel("a", 5, 5), kernel("b", 150, 5)]
    t = read_trace(write_trace(tmp_path / "n.json", events))
    assert [(s.step, s.gpu_ops) for s in list_steps(t)] == [(4, 1), (5, 1)]
    assert select_step(t, 5).gpu.op_names().tolist() == ["b"]


def test_idle_breakdown_per_stream_and_device(trace):
    devices, streams = idle_breakdown(trace)
    by_stream = {s.stream: s for s in streams}
    s7 = by_stream[7]
    assert s7.idle_ns == (28 * US, 10 * US, 210 * US)  # host, kernel, other
    assert s7.gaps == (1, 1, 2) and s7.max_gap_ns == (28 * US, 10 * US, 140 * US)
    assert s7.total_idle_ns == s7.span_ns - s7.busy_ns == 248 * US
    assert by_stream[9].idle_ns == (123 * US, 0, 0)
    (dev,) = devices
    assert dev.idle_ns == (91 * US, 28 * US, 140 * US)
    # the device split adds up to the decomposition's idle exactly
    report = analyze(trace)
    assert sum(dev.idle_ns) == report.devices[0].decomposition.idle_ns == 259 * US
    assert report.to_dict()["devices"][0]["idle_breakdown"] == {
        "host_wait_us": 91,
        "kernel_wait_us": 28,
        "other_us": 140,
    }
    # a 5 µs threshold makes the 10 µs and 18 µs gaps "other"
    devices5, streams5 = idle_breakdown(trace, kernel_wait_ns=5 * US)
    assert devices5[0].idle_ns == (91 * US, 0, 168 * US)
    assert {s.stream: s.idle_ns for s in streams5}[7] == (28 * US, 0, 220 * US)
    with pytest.raises(InputError):
        idle_breakdown(trace, kernel_wait_ns=-1)


def test_report_of_one_step(trace):
    report = analyze(trace, step=1)
    d = report.to_dict()
    assert d["step"] == 1 and d["gpu_ops"] == 4
    (dev,) = d["devices"]
    # A, B, C, D: span 20 -> 160, busy 32; gaps 10 (kernel), 28 (host), 70 (other)
    assert (dev["span_us"], dev["busy_us"], dev["idle_us"]) == (140, 32, 108)
    assert dev["idle_breakdown"] == {"host_wait_us": 28, "kernel_wait_us": 10, "other_us": 70}
    assert [s["step"] for s in d["steps"]] == [1, 2]
    rows = step_breakdown(trace)
    assert [(r["step"], r["gpu_ops"], r["span_us"], r["host_wait_us"]) for r in rows] == [
        (1, 4, 140, 28),
        (2, 2, 170, 0),  # M [131, 132) then E [300, 301): the 168 µs gap, E launched at 120
    ]
    assert rows[1]["other_us"] == 168


def test_launch_statistics(trace):
    (s,) = launch_stats(trace)
    assert (s.gpu_ops, s.launches) == (7, 6)  # F has no launch call
    assert s.total_launch_delay_ns == (5 + 24 + 7 + 83 + 120 + 0) * US
    assert s.launch_delay_ns["max"] == 120 * US
    assert s.short_kernels == 2 and s.short_kernel_gpu_ns == 3 * US  # B and M, not E (call > 50)
    assert (s.runtime_outliers, s.launch_delay_outliers, s.clipped) == (1, 1, 1)
    assert [n for n, _, _ in s.short_by_name] == ["B", "Memcpy HtoD"]
    worst = s.worst[0]
    assert worst["name"] == "E" and worst["launch_delay_us"] == 120
    assert worst["cpu_duration_us"] == 60 and worst["op_start_us"] == 295  # from F at 5
    # other thresholds
    (t,) = launch_stats(trace, runtime_cutoff_ns=70 * US, launch_delay_cutoff_ns=20 * US, top=1)
    assert (t.runtime_outliers, t.launch_delay_outliers, t.short_kernels) == (0, 3, 3)
    assert len(t.worst) == 1 and len(t.short_by_name) == 1


def test_queue_length_series_and_summary(trace):
    s7 = next(s for s in queue_series(trace) if s.stream == 7)
    assert s7.length.tolist() == [1, 2, 1, 0, 1, 2, 1, 2, 1, 0]
    assert (s7.ts_ns // US).tolist() == [10, 12, 20, 40, 60, 65, 70, 120, 150, 300]
    q = {x.stream: x for x in queue_summary(trace, max_queue_length=2)}
    q7 = q[7]
    assert (q7.changes, q7.max, q7.min, q7.mean) == (10, 2, 0, 1.1)
    assert q7.time_mean == pytest.approx(313 / 290)
    assert q7.time_at_max_ns == (8 + 5 + 30) * US
    assert q[9].changes == 2  # M only: F has no launch call
    end = {x.stream: x for x in queue_summary(trace, until="end", max_queue_length=2)}
    assert end[7].time_at_max_ns == (18 + 15 + 40) * US
    with pytest.raises(InputError):
        queue_summary(trace, until="middle")  # type: ignore[arg-type]
    with pytest.raises(InputError):
        queue_summary(trace, max_queue_length=0)


def test_cli_steps_idle_launches_queue_json(path):
    doc = json.loads(runner.invoke(app, ["steps", str(path), "--json"]).output)
    assert [(r["step"], r["gpu_ops"], r["last"]) for r in doc["steps"]] == [
        (1, 4, False),
        (2, 2, True),
    ]
    doc = json.loads(runner.invoke(app, ["idle", str(path), "--json", "--step", "1"]).output)
    assert doc["step"] == 1 and doc["kernel_wait_threshold_us"] == 30
    assert doc["devices"][0]["host_wait"]["idle_us"] == 28
    assert {s["stream"] for s in doc["streams"]} == {7}
    doc = json.loads(runner.invoke(app, ["launches", str(path), "--json"]).output)
    assert doc["ranks"][0]["short_kernels"] == 2
    assert doc["ranks"][0]["launch_delay"]["max_us"] == 120
    doc = json.loads(
        runner.invoke(
            app, ["queue", str(path), "--json", "--series", "--until", "end", "--step", "2"]
        ).output
    )
    assert doc["until"] == "end" and [s["stream"] for s in doc["streams"]] == [7, 9]
    assert doc["streams"][0]["series"]["length"] == [1, 0]
    report = json.loads(
        runner.invoke(app, ["report", str(path), "--json", "--kernel-wait-us", "5"]).output
    )
    assert report["devices"][0]["idle_breakdown"]["other_us"] == 168
    kernels = json.loads(runner.invoke(app, ["kernels", str(path), "--json", "--step", "2"]).output)
    assert {k["name"] for k in kernels["kernels"]} == {"E", "Memcpy HtoD"}
    for command in ("steps", "idle", "launches", "queue", "report"):
        res = runner.invoke(app, [command, str(path)])
        assert res.exit_code == 0, (command, res.output)


def test_cli_bad_step_is_one_line_exit_2(path):
    for args in (
        ["report", str(path), "--step", "9"],
        ["idle", str(path), "--kernel-wait-us", "-1"],
        ["queue", str(path), "--until", "later"],
    ):
        res = subprocess.run(
            [sys.executable, "-m", "moeinfra.cli", "trace", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 2 and "Traceback" not in res.stderr, args
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert (
        "its steps are 1, 2"
        in subprocess.run(
            [sys.executable, "-m", "moeinfra.cli", "trace", "launches", str(path), "--step", "3"],
            capture_output=True,
            text=True,
            timeout=120,
        ).stderr
    )
