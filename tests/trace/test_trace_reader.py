"""Reading Chrome traces: gz, folders, µs/ns, legacy categories, missing dur, truncated JSON, empty traces."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from trace_builders import annotation, kernel, launch, write_trace

from moeinfra.errors import InputError, TraceFormatError
from moeinfra.trace import analyze, read_trace


def test_plain_and_gz_read_the_same(tmp_path):
    events = [
        kernel("gemm", 10, 5, corr=1, grid=[4, 2, 1]),
        launch(8, 1),
        annotation("step", 0, 100),
    ]
    plain = read_trace(write_trace(tmp_path / "a.json", events))
    gz = read_trace(write_trace(tmp_path / "a.json.gz", events, gz=True))
    for t in (plain, gz):
        assert len(t.gpu) == 1 and len(t.cpu) == 1 and len(t.annotations) == 1
        assert t.gpu.start_ns.tolist() == [10_000] and t.gpu.end_ns.tolist() == [15_000]
        assert t.gpu.blocks.tolist() == [8]
        assert t.gpu.correlation.tolist() == [1]


def test_fractional_microseconds_keep_nanoseconds(tmp_path):
    events = [kernel("a", 5079929745398.459, 1.25), kernel("b", 5079929745399.709, 0.001, stream=8)]
    t = read_trace(write_trace(tmp_path / "t.json", events))
    assert t.gpu.start_ns.tolist() == [5079929745398459, 5079929745399709]
    assert t.gpu.dur_ns.tolist() == [1250, 1]


def _verbatim_trace(path, rows, **top):
    """A trace of kernels ``(name, stream, ts, dur)`` whose ts/dur texts are written as given.

    ``json.dumps`` would write a float64's repr instead (1700000000123456.789 -> ...456.8).
    """
    events = ", ".join(
        f'{{"ph": "X", "cat": "kernel", "name": "{name}", "pid": 0, "tid": {stream}, '
        f'"ts": {ts}, "dur": {dur}, "args": {{"device": 0, "stream": {stream}}}}}'
        for name, stream, ts, dur in rows
    )
    head = "".join(f'"{k}": {json.dumps(v)}, ' for k, v in top.items())
    path.write_text(f'{{{head}"schemaVersion": 1, "traceEvents": [{events}]}}')
    return path


def test_fractional_timestamps_are_exact_at_epoch_magnitude(tmp_path):
    # float64 steps by 0.25 µs near 1.7e15 µs: it reads ...456.789 and ...456.790 both as ...456.75.
    assert float("1700000000123456.789") == float("1700000000123456.790") == 1700000000123456.75
    rows = [
        ("later", 7, "1700000000123456.790", "0.001"),  # listed first: the reader must sort
        ("first", 7, "1700000000123456.789", "0.001"),
        ("other", 8, "1700000000123456.789", "2.5"),
    ]
    t = read_trace(_verbatim_trace(tmp_path / "t.json", rows))
    # 1700000000123456 µs * 1000 + 789 ns; dur 0.001 µs = 1 ns
    assert t.gpu.start_ns.tolist() == [
        1700000000123456789,
        1700000000123456790,
        1700000000123456789,
    ]
    assert t.gpu.end_ns.tolist() == [
        1700000000123456790,
        1700000000123456791,
        1700000000123459289,
    ]
    assert [t.gpu.names[i] for i in t.gpu.name_id] == ["first", "later", "other"]
    assert t.gpu.start_ns.dtype == np.int64


def test_integer_timestamps_are_unchanged(tmp_path):
    rows = [("a", 7, "1740461679471821", "112"), ("b", 7, "1740461679471961", "43")]
    t = read_trace(_verbatim_trace(tmp_path / "t.json", rows))
    assert t.gpu.start_ns.tolist() == [1740461679471821000, 1740461679471961000]
    assert t.gpu.end_ns.tolist() == [1740461679471933000, 1740461679472004000]


def test_digits_beyond_the_nanosecond_round_half_to_even(tmp_path):
    rows = [  # (dur text, ns): 0.5 ns ties go to the even ns, anything past a tie goes away from it
        ("0.0005", 0),
        ("0.0015", 2),
        ("0.0025", 2),
        ("0.00250000001", 3),
        ("0.0024999", 2),
        ("2.0005", 2000),
        ("1.5e-3", 2),  # an exponent is read exactly too: 1.5 ns, a tie, to even
        ("1E+3", 1_000_000),
        # 44 significant digits: a tie only at 28 of them (Decimal's default precision)
        ("0.0005000000000000000000000000000000000000001", 1),
    ]
    trace_rows = [(f"k{i}", i, str(10 * i), dur) for i, (dur, _) in enumerate(rows)]
    t = read_trace(_verbatim_trace(tmp_path / "t.json", trace_rows))
    assert (t.gpu.end_ns - t.gpu.start_ns).tolist() == [ns for _, ns in rows]
    negative = read_trace(_verbatim_trace(tmp_path / "n.json", [("a", 7, "-0.0015", "1")]))
    assert negative.gpu.start_ns.tolist() == [-2]  # ties to even on either side of zero
    ns_rows = [("a", 7, "1700000000123456789.5", "2500.5")]  # ns trace: ties at the unit
    ns = read_trace(_verbatim_trace(tmp_path / "s.json", ns_rows), time_unit="ns")
    assert ns.gpu.start_ns.tolist() == [1700000000123456790]
    assert ns.gpu.end_ns.tolist() == [1700000000123456790 + 2500]


def test_times_at_the_int64_bound_and_non_numbers_are_skipped_and_counted(tmp_path):
    # |ts| and dur must stay below 2**62 ns = 4611686018427387.904 µs, fraction or not
    rows = [
        ("below", 7, "4611686018427387.903", "1"),
        ("at", 7, "4611686018427387.904", "1"),
        ("beyond", 7, "4611686018427388", "1"),
        ("nan", 7, '"NaN"', "1"),  # a string decodes as a decimal: NaN is skipped, no crash
        ("endless", 7, "0", '"Infinity"'),
    ]
    t = read_trace(_verbatim_trace(tmp_path / "t.json", rows))
    assert t.gpu.start_ns.tolist() == [4611686018427387903]
    assert t.skipped == {"event without ts or with ts beyond int64 ns": 3, "GPU op without dur": 1}


def test_nanosecond_traces(tmp_path):
    events = [kernel("a", 1_000_000, 2_500)]
    explicit = read_trace(write_trace(tmp_path / "ns.json", events), time_unit="ns")
    assert explicit.gpu.start_ns.tolist() == [1_000_000] and explicit.gpu.dur_ns.tolist() == [2_500]
    # auto: a non-Kineto trace declaring ns
    path = tmp_path / "auto.json"
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ns"}))
    assert read_trace(path).gpu.dur_ns.tolist() == [2_500]
    # a Kineto trace (schemaVersion) stays in µs even with displayTimeUnit ns
    kineto = read_trace(write_trace(tmp_path / "k.json", events, displayTimeUnit="ns"))
    assert kineto.gpu.dur_ns.tolist() == [2_500_000]
    with pytest.raises(InputError, match="time_unit"):
        read_trace(path, time_unit="ms")  # type: ignore[arg-type]


def test_legacy_categories(tmp_path):
    events = [
        kernel("gemm", 0, 10, cat="Kernel"),
        kernel("Memcpy HtoD (Pageable -> Device)", 10, 2, cat="Memcpy"),
        kernel("Memset (Device)", 12, 1, cat="Memset"),
        {
            "ph": "X",
            "cat": "Runtime",
            "name": "cudaLaunchKernel",
            "pid": 1,
            "tid": 1,
            "ts": 0,
            "dur": 1,
            "args": {"correlation": 3},
        },
        {"ph": "X", "cat": "Operator", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 2},
    ]
    t = read_trace(write_trace(tmp_path / "legacy.json", events))
    assert sorted(t.gpu.kind.tolist()) == [0, 1, 2]
    assert len(t.cpu) == 2
    d = analyze(t).devices[0].decomposition
    assert d.compute_ns == 10_000 and d.memory_ns == 3_000


def test_missing_dur_is_counted_not_silently_dropped(tmp_path):
    events = [kernel("a", 0, 10), kernel("b", 5, None)]
    result = analyze(write_trace(tmp_path / "t.json", events))
    assert len(result.trace.gpu) == 1
    assert result.to_dict()["skipped"] == {"GPU op without dur": 1}


def test_truncated_json_is_a_clear_error(tmp_path):
    path = write_trace(tmp_path / "t.json", [kernel("a", 0, 10)] * 5)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFormatError, match="truncated"):
        read_trace(path)
    gz = tmp_path / "t.json.gz"
    gz.write_bytes(gzip.compress(data)[:40])
    with pytest.raises(TraceFormatError, match=r"t\.json\.gz"):
        read_trace(gz)


def test_wrong_structure_is_a_trace_format_error(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": [{"ph": "X", "ts": "soon"}]}')
    with pytest.raises(TraceFormatError, match="ts"):
        read_trace(path)


def test_empty_trace_and_bare_array(tmp_path):
    with pytest.raises(TraceFormatError, match="no trace events"):  # nothing at all: an error
        analyze(write_trace(tmp_path / "e.json", []))
    cpu_only = analyze(write_trace(tmp_path / "c.json", [annotation("step", 0, 10)]))
    assert cpu_only.devices == [] and cpu_only.to_dict()["gpu_ops"] == 0
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps([kernel("a", 0, 3)]))
    assert len(read_trace(bare).gpu) == 1


def test_unknown_fields_and_events_are_tolerated(tmp_path):
    events = [
        kernel("a", 0, 3),
        {"ph": "C", "name": "counter", "pid": 0, "ts": 1, "args": {"value": [1, 2]}},
        {
            "ph": "X",
            "cat": "something_new",
            "name": "x",
            "pid": "Spans",
            "tid": "PyTorch Profiler",
            "ts": 0,
            "dur": 4,
            "args": {"stream": "weird", "grid": "no"},
        },
        {"ph": "i", "name": "marker", "pid": "", "tid": "", "ts": 2, "s": "g"},
    ]
    t = read_trace(write_trace(tmp_path / "t.json", events, extra={"a": 1}))
    assert len(t.gpu) == 1 and len(t.cpu) == 1


def test_folder_of_rank_files(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    for rank in (1, 0):
        write_trace(
            folder / f"rank{rank}.json",
            [kernel("gemm", 0, 10 + rank), kernel("ncclDevKernel_AllReduce", 5, 10)],
            distributedInfo={"rank": rank},
        )
    (folder / "notes.txt").write_text("not a trace")
    result = analyze(folder)
    assert result.trace.ranks == [0, 1]
    assert [(d.decomposition.rank, d.decomposition.device) for d in result.devices] == [
        (0, 0),
        (1, 0),
    ]
    assert [d.decomposition.compute_ns for d in result.devices] == [10_000, 11_000]
    assert np.all([d.decomposition.comm_ns == 10_000 for d in result.devices])


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        read_trace(tmp_path / "nope.json")
    with pytest.raises(InputError, match="without"):
        read_trace(tmp_path)


def test_chunked_reading_of_large_files_gives_the_same_trace(tmp_path):
    # Files larger than the chunk are streamed (see test_trace_stream.py for the exhaustive test).
    events = [kernel("gemm", i * 10, 5, stream=7 + i % 2, corr=i) for i in range(7)]
    events += [launch(i * 10 - 3, i, tid=1 + i % 2) for i in range(7)] + [
        annotation("x(F)", -5, 100)
    ]
    path = write_trace(tmp_path / "t.json", events)
    one_pass = analyze(path).to_dict()
    chunked = analyze(read_trace(path, chunk_bytes=64))
    assert chunked.to_dict() == one_pass
    assert len(chunked.trace.threads) == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"traceEvents": [*events[:7], {"ph": "X", "ts": "soon"}]}))
    for chunk_bytes in (64, 1 << 20):
        with pytest.raises(TraceFormatError, match=r"traceEvents\[7\]"):
            read_trace(bad, chunk_bytes=chunk_bytes)


def test_rank_assignment_for_folders():
    from moeinfra.trace.reader import _assign_ranks

    assert _assign_ranks([1, None]) == [1, 0]
    assert _assign_ranks([0, 0]) == [0, 1]
    assert _assign_ranks([None, None]) == [0, 1]
    assert _assign_ranks([3, 1, None, 1]) == [3, 1, 0, 2]


def test_string_and_mixed_thread_ids(tmp_path):
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": "main", "ts": 0, "dur": 1},
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "b",
            "pid": "Spans",
            "tid": "PyTorch Profiler",
            "ts": 0,
            "dur": 1,
        },
        {"ph": "X", "cat": "cpu_op", "name": "c", "pid": 1, "tid": "main", "ts": 2, "dur": 1},
        {"ph": "X", "cat": "cpu_op", "name": "d", "pid": 1, "tid": 7, "ts": 3, "dur": 1},
    ]
    t = read_trace(write_trace(tmp_path / "t.json", events))
    assert sorted(t.threads) == [(0, "1", "7"), (0, "1", "main"), (0, "Spans", "PyTorch Profiler")]
    names = [t.cpu.names[i] for i in t.cpu.name_id]
    thread_of = {n: t.threads[k] for n, k in zip(names, t.cpu.thread.tolist(), strict=True)}
    assert thread_of["a"] == thread_of["c"] == (0, "1", "main")
