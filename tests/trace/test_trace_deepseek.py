"""DeepSeek's published training trace (DualPipe, EP64, H800): decomposition, DeepEP, F/B/W, SMs; CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from moeinfra.cli.trace import app
from moeinfra.trace import COMM, COMPUTE, analyze, kernel_breakdown
from moeinfra.trace.attribution import UNATTRIBUTED


@pytest.fixture(scope="module")
def deepseek_trace_path():
    return Path(__file__).resolve().parents[2] / "examples" / "data" / "deepseek_train_trace.json"


@pytest.fixture(scope="module")
def deepseek(deepseek_trace_path):
    return analyze(deepseek_trace_path)


def test_decomposition_adds_up_exactly(deepseek):
    (dev,) = deepseek.devices
    d = dev.decomposition
    assert d.compute_ns + d.exposed_comm_ns + d.exposed_memory_ns + d.idle_ns == d.span_ns
    assert d.busy_ns + d.idle_ns == d.span_ns
    assert d.overlap_ns + d.exposed_comm_ns == d.comm_ns
    # the published trace hides almost all of its all-to-all behind computation
    assert d.comm_ns > 0.8 * d.span_ns
    assert d.comm_hidden_fraction > 0.9
    assert set(d.stream_busy_ns) == {7, 23, 27}


def test_deepep_kernels_are_communication(deepseek):
    gpu = deepseek.trace.gpu
    names = gpu.op_names()
    is_ep = np.array([n.startswith("void dpsk::ep::") for n in names])
    layout = np.array(["get_dispatch_layout" in n for n in names])
    assert is_ep.sum() == 36 and layout.sum() == 4
    assert np.all(deepseek.classes[is_ep & ~layout] == COMM)
    assert np.all(deepseek.classes[layout] == COMPUTE)
    # nothing else is communication (GEMMs in the dpsk::grouped_gemm namespace stay compute)
    assert np.all(deepseek.classes[~is_ep] != COMM)
    # all communication runs on the DeepEP stream
    assert set(gpu.stream[deepseek.classes == COMM].tolist()) == {27}


def test_sm_partition_deepep_20_gemm_112(deepseek):
    d = deepseek.devices[0].decomposition
    assert d.num_sms == 132
    assert d.sm["communication"].max_sms == 20
    gpu = deepseek.trace.gpu
    on_23 = gpu.stream == 23
    assert set(gpu.blocks[on_23].tolist()) == {112}  # the overlapped GEMMs leave 20 SMs to DeepEP


def test_fbw_phases_found_for_all_gpu_ops(deepseek):
    att = deepseek.attribution
    assert att.phases == ["F", "B", "W"]
    assert np.all(att.phase >= 0)
    assert np.all(att.launch >= 0)
    doc = deepseek.to_dict()["devices"][0]
    assert UNATTRIBUTED not in doc["phases"]
    assert doc["phases"]["W"]["comm_us"] == 0  # weight gradients need no all-to-all
    over = doc["phase_overlap"]
    # DualPipe: forward communication hidden by backward computation and vice versa
    assert over["F"]["B"] > 0.5 * doc["phases"]["F"]["comm_us"]
    assert over["B"]["F"] > 0
    assert over["F"]["F"] == 0 and over["B"]["B"] == 0
    for x in over:  # comm of X hidden by any phase's compute cannot exceed X's comm
        assert 0 <= max(over[x].values()) <= doc["phases"][x]["comm_us"]


def test_kernel_breakdown_totals(deepseek):
    stats = kernel_breakdown(deepseek.trace, deepseek.classes)
    assert sum(s.count for s in stats) == len(deepseek.trace.gpu)
    assert sum(s.total_us for s in stats) == pytest.approx(deepseek.trace.gpu.dur_ns.sum() / 1000)
    combine = [s for s in stats if "dpsk::ep::internode::combine" in s.name]
    assert combine and combine[0].op_class == "communication" and combine[0].count == 8


runner = CliRunner()


def test_cli_report_json(deepseek_trace_path):
    res = runner.invoke(app, ["report", str(deepseek_trace_path), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    dev = doc["devices"][0]
    for key in (
        "span_us",
        "busy_us",
        "idle_us",
        "compute_us",
        "comm_us",
        "memory_us",
        "overlap_us",
        "exposed_comm_us",
        "exposed_memory_us",
        "comm_hidden_fraction",
        "streams",
        "phases",
        "phase_overlap",
    ):
        assert key in dev
    assert dev["compute_us"] + dev["exposed_comm_us"] + dev["exposed_memory_us"] + dev[
        "idle_us"
    ] == pytest.approx(dev["span_us"], abs=1e-6)


def test_cli_report_tables_and_png(deepseek_trace_path, tmp_path):
    out = tmp_path / "timeline.png"
    res = runner.invoke(
        app, ["report", str(deepseek_trace_path), "-o", str(out), "--zoom", "0:30000"]
    )
    assert res.exit_code == 0, res.output
    assert "exposed communication" in res.output and "phase_overlap" in res.output
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_cli_kernels(deepseek_trace_path):
    res = runner.invoke(app, ["kernels", str(deepseek_trace_path), "--top", "5", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert len(doc["kernels"]) == 5
    totals = [k["total_us"] for k in doc["kernels"]]
    assert totals == sorted(totals, reverse=True)
    res = runner.invoke(app, ["kernels", str(deepseek_trace_path), "--top", "3"])
    assert res.exit_code == 0 and "count" in res.output


def test_cli_truncated_trace_exits_2_with_one_line(tmp_path, deepseek_trace_path):
    bad = tmp_path / "cut.json"
    bad.write_bytes(deepseek_trace_path.read_bytes()[:100_000])
    res = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "trace", "report", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert re.search(r"error: .*cut\.json.*truncated", res.stderr)


def test_report_section(tmp_path, deepseek_trace_path):
    from moeinfra.report.trace_section import DEEPSEEK_TRACE, build

    assert deepseek_trace_path == DEEPSEEK_TRACE
    section = build(tmp_path)
    assert section.anchor == "trace"
    for fig in ("trace_timeline.png", "trace_timeline_zoom.png"):
        assert fig in section.body_html and (tmp_path / fig).read_bytes()[:4] == b"\x89PNG"
    assert "phase_overlap" in section.body_html and "dispatch(B)" in section.body_html
    missing = build(tmp_path / "other", trace_path=tmp_path / "absent.json")
    assert "not found" in missing.body_html and not (tmp_path / "other").exists()


def test_cli_phase_pattern_pairs_attention_with_combine(deepseek_trace_path):
    # DualPipe overlaps attention with combine and MLP with dispatch of the other chunk.
    res = runner.invoke(
        app,
        [
            "report",
            str(deepseek_trace_path),
            "--json",
            "--phase-pattern",
            r"^(attn|mlp|dispatch|combine)",
        ],
    )
    assert res.exit_code == 0, res.output
    dev = json.loads(res.output)["devices"][0]
    assert sorted(dev["phases"]) == ["attn", "combine", "dispatch", "mlp"]
    over = dev["phase_overlap"]
    assert over["combine"]["attn"] > 0.95 * dev["phases"]["combine"]["comm_us"]
    assert over["dispatch"]["mlp"] > 0.95 * dev["phases"]["dispatch"]["comm_us"]
    assert over["combine"]["mlp"] == over["dispatch"]["attn"] == 0


def test_profiler_step_idle_launches_queue(deepseek, deepseek_trace_path):
    from moeinfra.trace import idle_breakdown, launch_stats, list_steps, queue_summary

    trace = deepseek.trace
    (step,) = list_steps(trace)
    assert (step.step, step.gpu_ops, step.last) == (1, len(trace.gpu), True)
    one = analyze(deepseek_trace_path, step=1)
    assert one.to_dict()["devices"][0]["span_us"] == deepseek.to_dict()["devices"][0]["span_us"]
    (dev,) = deepseek.devices
    assert sum(dev.idle.idle_ns) == dev.decomposition.idle_ns  # 497 µs
    assert dev.to_dict()["idle_breakdown"] == {
        "host_wait_us": 42.0,
        "kernel_wait_us": 455.0,
        "other_us": 0.0,
    }
    devices, streams = idle_breakdown(trace)
    assert {s.stream for s in streams} == {7, 23, 27}
    (launches,) = launch_stats(trace)
    assert launches.launches <= launches.gpu_ops == len(trace.gpu)
    assert {q.stream for q in queue_summary(trace)} <= {7, 23, 27}
