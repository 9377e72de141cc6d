"""Known answers on hand-built traces: decomposition, SM share, attribution, phases, kernels, diff, figure."""

from __future__ import annotations

import json
import math

import pytest
from trace_builders import annotation, kernel, launch, write_trace

from moeinfra.trace import analyze, diff_reports, kernel_breakdown
from moeinfra.trace.attribution import UNATTRIBUTED

PROPS = [{"id": 0, "name": "Test GPU", "numSms": 100}]


def scenario_events(nccl_dur: float = 20) -> list[dict]:
    """Two streams overlapping, a memcpy, a memset after a gap; launches under nested annotations.

    stream 7:  gemm [0,10)        gemm [20,30) memcpy [30,32)
    stream 27:      nccl [5, 5+nccl_dur)
    stream 9:                                         memset [40,41)
    """
    return [
        kernel("gemm", 0, 10, stream=7, corr=1, grid=[200, 1, 1]),
        kernel("ncclDevKernel_AllReduce", 5, nccl_dur, stream=27, corr=2, grid=[20, 1, 1]),
        kernel("gemm", 20, 10, stream=7, corr=3, grid=[200, 1, 1]),
        kernel("Memcpy DtoD (Device -> Device)", 30, 2, stream=7, corr=4, cat="gpu_memcpy"),
        kernel("Memset (Device)", 40, 1, stream=9, corr=5, cat="gpu_memset"),
        annotation("step", -10, 100, tid=1),
        annotation("attn(F)", -10, 8, tid=1),
        annotation("inner", -8, 2, tid=1),
        annotation("dispatch(B)", -2, 4, tid=2),  # other thread
        launch(-7, 1, tid=1),  # in inner, in attn(F)
        launch(-1, 2, tid=2),  # in dispatch(B)
        launch(5, 3, tid=1),  # only in step: no phase
        launch(6, 4, tid=1),
        launch(7, 5, tid=1),
    ]


@pytest.fixture
def result(tmp_path):
    return analyze(write_trace(tmp_path / "a.json", scenario_events(), deviceProperties=PROPS))


def test_decomposition_known_answer(result):
    d = result.to_dict()["devices"][0]
    assert d["span_us"] == 41
    assert d["compute_us"] == 20
    assert d["comm_us"] == 20
    assert d["overlap_us"] == 10
    assert d["exposed_comm_us"] == 10
    assert d["memory_us"] == 3
    assert d["exposed_memory_us"] == 3
    assert d["busy_us"] == 33
    assert d["idle_us"] == 8
    assert (
        d["compute_us"] + d["exposed_comm_us"] + d["exposed_memory_us"] + d["idle_us"]
        == d["span_us"]
    )
    assert d["comm_hidden_fraction"] == 0.5
    assert d["streams"] == {"7": 22, "9": 1, "27": 20}


def test_sm_share_from_grid_and_device_properties(result):
    sm = result.to_dict()["devices"][0]["sm_share"]
    assert sm["compute"]["sm_share"] == pytest.approx(20 * 100 / (100 * 41))
    assert sm["communication"]["sm_share"] == pytest.approx(20 * 20 / (100 * 41))
    assert (
        sm["communication"]["mean_sms"] == 20 and sm["compute"]["max_sms"] == 100
    )  # 200 blocks capped


def test_attribution_innermost_annotation_any_thread(result):
    regions = result.attribution.region_names(result.trace).tolist()
    names = result.trace.gpu.op_names().tolist()
    by_op = dict(
        zip(zip(names, result.trace.gpu.start_ns.tolist(), strict=True), regions, strict=True)
    )
    assert by_op[("gemm", 0)] == "inner"
    assert by_op[("ncclDevKernel_AllReduce", 5000)] == "dispatch(B)"
    assert by_op[("gemm", 20000)] == "step"
    phases = [result.attribution.phases[p] if p >= 0 else None for p in result.attribution.phase]
    by_phase = dict(
        zip(zip(names, result.trace.gpu.start_ns.tolist(), strict=True), phases, strict=True)
    )
    assert by_phase[("gemm", 0)] == "F"  # phase from the enclosing attn(F), through 'inner'
    assert by_phase[("ncclDevKernel_AllReduce", 5000)] == "B"
    assert by_phase[("gemm", 20000)] is None


def test_phases_and_phase_overlap(result):
    d = result.to_dict()["devices"][0]
    assert d["phases"]["F"] == {"compute_us": 10, "comm_us": 0, "memory_us": 0, "ops": 1}
    assert d["phases"]["B"]["comm_us"] == 20
    assert d["phases"][UNATTRIBUTED]["ops"] == 3
    assert d["phase_overlap"]["B"]["F"] == 5  # B's all-reduce hidden behind F's gemm
    assert d["phase_overlap"]["B"][UNATTRIBUTED] == 5
    assert d["phase_overlap"]["F"]["B"] == 0
    assert d["regions"]["dispatch(B)"]["exposed_comm_us"] == 10


def test_kernel_statistics(tmp_path):
    events = [kernel("k", t, dur) for t, dur in ((0, 1), (10, 2), (20, 3), (30, 6))] + [
        kernel("Memset (Device)", 50, 4, cat="gpu_memset")
    ]
    result = analyze(write_trace(tmp_path / "k.json", events))
    stats = {s.name: s for s in kernel_breakdown(result.trace, result.classes)}
    k = stats["k"]
    assert (k.count, k.total_us, k.mean_us, k.min_us, k.max_us) == (4, 12, 3, 1, 6)
    assert k.std_us == pytest.approx(math.sqrt(3.5))
    assert k.share == pytest.approx(12 / 16)
    assert stats["Memset (Device)"].std_us == 0 and stats["Memset (Device)"].kind == "memset"
    by_class = {s.name: s for s in kernel_breakdown(result.trace, result.classes, by="class")}
    assert by_class["compute"].count == 4 and by_class["memory"].total_us == 4
    by_kind = {s.name: s for s in kernel_breakdown(result.trace, result.classes, by="kind")}
    assert by_kind["kernel"].total_us == 12 and by_kind["memset"].count == 1
    with pytest.raises(ValueError, match="by="):
        kernel_breakdown(result.trace, result.classes, by="stream")


def test_exposed_time_per_comm_kernel(result):
    stats = {s.name: s for s in kernel_breakdown(result.trace, result.classes)}
    assert stats["ncclDevKernel_AllReduce"].exposed_us == 10
    assert stats["gemm"].exposed_us == 0


def test_diff_shows_what_became_exposed(tmp_path):
    a = analyze(write_trace(tmp_path / "a.json", scenario_events()))
    b = analyze(write_trace(tmp_path / "b.json", scenario_events(nccl_dur=30)))
    d = diff_reports(a, b).to_dict()
    metrics = d["devices"][0]["metrics"]
    assert metrics["exposed_comm_us"] == {"a": 10, "b": 15, "delta": 5}
    assert metrics["comm_us"]["delta"] == 10
    top = d["kernels"][0]
    assert (
        top["name"] == "ncclDevKernel_AllReduce"
        and top["delta_total_us"] == 10
        and top["delta_exposed_us"] == 5
    )


def test_cli_diff_prints_the_known_differences(tmp_path):
    """The same two traces through `moeinfra trace diff`: 5 µs more exposed communication."""
    from typer.testing import CliRunner

    from moeinfra.cli.trace import app

    a = write_trace(tmp_path / "a.json", scenario_events())
    b = write_trace(tmp_path / "b.json", scenario_events(nccl_dur=30))
    res = CliRunner().invoke(app, ["diff", str(a), str(b), "--json"])
    assert res.exit_code == 0, res.output
    metrics = json.loads(res.output)["devices"][0]["metrics"]
    assert metrics["exposed_comm_us"] == {"a": 10, "b": 15, "delta": 5}
    res = CliRunner().invoke(app, ["diff", str(a), str(b)])
    assert res.exit_code == 0 and "exposed_comm_us" in res.output


def test_comm_patterns_add_rules(tmp_path):
    events = [kernel("gemm", 0, 10), kernel("void my::alltoall<8>(int)", 5, 10, stream=8)]
    path = write_trace(tmp_path / "t.json", events)
    assert analyze(path).to_dict()["devices"][0]["comm_us"] == 0
    assert analyze(path, comm_patterns=[r"my::alltoall"]).to_dict()["devices"][0]["comm_us"] == 10


def test_timeline_png(result, tmp_path):
    from moeinfra.trace.timeline import plot_timeline

    out = plot_timeline(result, tmp_path / "fig" / "t.png", window_us=(0, 20))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp file left


def test_timeline_of_a_two_rank_moe_trace_names_ranks_ops_and_only_drawn_classes(tmp_path):
    """The MoE runtime writes one file for its CPU ranks (one device each): lanes are told apart
    by device, not labelled rank 0 twice; wide ops carry their names; the legend lists only the
    classes drawn (no memory ops here)."""
    from moeinfra.moe.timeline import COMM_TRACK, COMPUTE_TRACK, write_chrome_trace
    from moeinfra.trace.classify import MEMORY
    from moeinfra.trace.timeline import plot_timeline, timeline_lanes

    events = [
        [("ATTN-0", COMPUTE_TRACK, 0.000, 0.004), ("dispatch", COMM_TRACK, 0.004, 0.006)],
        [("ATTN-0", COMPUTE_TRACK, 0.000, 0.005), ("dispatch", COMM_TRACK, 0.005, 0.006)],
    ]
    report = analyze(write_chrome_trace(tmp_path / "moe.json", events))
    lanes, labels, shown = timeline_lanes(report)
    names = [name for name, _ in lanes]
    assert any(n.startswith("device 0 ") for n in names)
    assert any(n.startswith("device 1 ") for n in names)
    assert not any("gpu" in n or n.startswith("rank 0 device") for n in names)
    written = {str(x) for _, _, _, ops in labels for x in ops}
    assert {"ATTN-0", "gloo:dispatch"} <= written
    assert shown.size and MEMORY not in set(shown.tolist())  # so no "memory" in the legend
    assert plot_timeline(report, tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
