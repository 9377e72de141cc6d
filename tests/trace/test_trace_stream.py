"""Streaming reads: any chunk size gives exactly the trace a one-pass decode of the whole file gives.

The reference decodes the whole (decompressed) file with msgspec at once and adds all its events in
one go, as the reader did before it streamed. Chunks of 1, 7, 64, ... bytes cut events, strings,
escapes (``\\"``, ``\\\\``) and numbers everywhere; names and args hold quotes, brackets, commas and
colons; categories first appear in a different order from one chunk to the next, and times tie
across categories, so numbering and tie order would show any dependence on the chunking.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from trace_builders import annotation, kernel, launch, write_trace

from moeinfra.errors import TraceFormatError
from moeinfra.trace import reader
from moeinfra.trace.reader import read_trace

DEEPSEEK = Path(__file__).resolve().parents[2] / "examples" / "data" / "deepseek_train_trace.json"
HTA = Path(__file__).parent / "data" / "hta"
TRICKY = ['say "hi"', "path\\to\\", 'end\\"', "[{", "}]", '], "traceEvents": [', ",:", "ü€ \t"]


def one_pass(path: Path, time_unit: str = "auto"):
    """The whole file decoded by msgspec in one pass, all its events added at once."""
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    doc = reader.decode_trace_bytes(data, str(path))
    unit = time_unit
    if unit == "auto":
        unit = "ns" if doc.displayTimeUnit == "ns" and doc.schemaVersion is None else "us"
    collector = reader._Collector()
    collector.add(doc.traceEvents, 0, unit)
    for p in doc.deviceProperties:
        collector.devices[(0, p.id)] = reader.DeviceProps(p.id, p.name, p.numSms)
    rank = (doc.distributedInfo or {}).get("rank")
    return collector.finish([rank if isinstance(rank, int) else 0], [str(path)])


def assert_same(a, b, where: str = "trace") -> None:
    """Equal field by field: arrays in value and dtype, lists and dicts in order too."""
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def tricky_events() -> list[dict]:
    """Events whose chunked reading could go wrong: see the module docstring."""
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}}]
    for i in range(24):
        name = f"{TRICKY[i % len(TRICKY)]}#{i % 5}"
        ts = 100 + 10 * (i // 3)  # three events per start time, in different categories
        if i % 4 == 0:
            events.append(kernel(name, ts, 5, stream=7 + i % 3, corr=i, grid=[i + 1, 2, 1]))
            events[-1]["args"]["note"] = {"nested": [TRICKY, {"x": TRICKY[i % 3]}]}
        elif i % 4 == 1:
            events.append(launch(ts, i, tid=1 + i % 2, name=name))
        elif i % 4 == 2:
            events.append(annotation(f"{name}(F)", ts, 30, tid=[1, "main", 2][i % 3]))
        else:
            events.append(
                {"ph": "X", "cat": "cpu_op", "name": name, "pid": 100, "tid": i % 3, "ts": ts}
                | ({"dur": 2} if i % 7 else {})  # some without dur: counted as skipped
            )
        if i % 6 == 5:
            events.append({"ph": "s", "id": f"id {TRICKY[i % 8]}", "cat": "ac2g", "ts": ts})
            events.append({"ph": "f", "id": i, "cat": "ac2g", "ts": ts + 1, "bp": "e"})
    events.insert(5, kernel("negative", 150, -1, cat="gpu_memset"))
    events.insert(7, kernel("no dur", 120, None, stream=8))
    events.insert(9, {"ph": "X", "cat": "gpu_user_annotation", "name": "g", "pid": 0, "tid": 7})
    events.append(
        {
            "ph": "X",
            "cat": "python_function",
            "name": "late",
            "pid": 100,
            "tid": 1,
            "ts": 100,
            "dur": 1,
        }
    )  # a new category, first seen at the end, same start
    return events


def _write(path: Path, text: str, gz: bool = False) -> Path:
    data = text.encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


@pytest.mark.parametrize("variant", ["head first", "head last", "pretty", "gz", "bare array"])
def test_streamed_read_is_a_one_pass_read_for_any_chunk_size(tmp_path, variant):
    events = tricky_events()
    head = {
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": 'H800 "sxm"', "numSms": 132}],
        "distributedInfo": {"rank": 3, "note": "[{,:"},
        "unknown": {"deep": [[["]"]]]},
    }
    if variant == "bare array":
        text = json.dumps(events)
    elif variant == "head last":
        text = json.dumps({"traceEvents": events, **head, "traceName": "x]}"})
    elif variant == "pretty":
        text = json.dumps({**head, "traceEvents": events}, indent=2, ensure_ascii=False)
    else:
        text = json.dumps({**head, "traceEvents": events})
    path = _write(tmp_path / ("t.json.gz" if variant == "gz" else "t.json"), text, variant == "gz")
    expected = one_pass(path)
    assert len(expected.gpu) and len(expected.cpu) and len(expected.annotations)
    assert len(expected.flows) and len(expected.threads) == 4 and len(expected.skipped) == 4
    for chunk_bytes in (1, 2, 7, 64, 1000, 1 << 20):
        assert_same(read_trace(path, chunk_bytes=chunk_bytes), expected, f"chunk {chunk_bytes}")
    if variant != "bare array":
        got = read_trace(path, chunk_bytes=5)
        assert got.ranks == [3] and got.devices[(3, 0)].num_sms == 132


def test_deepseek_and_hta_traces_stream_as_one_pass():
    for path in (DEEPSEEK, HTA / "sampled" / "sampled_rank-0.json.gz"):
        expected = one_pass(path)
        for chunk_bytes in (4093, 65536):
            assert_same(read_trace(path, chunk_bytes=chunk_bytes), expected, str(path))


def test_folders_and_time_units_stream_the_same(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    for rank in (1, 0):
        write_trace(
            folder / f"rank{rank}.json",
            tricky_events()[rank::2],
            distributedInfo={"rank": rank},
        )
    whole = read_trace(folder, chunk_bytes=1 << 20)
    assert whole.ranks == [0, 1]
    for unit in ("auto", "ns"):
        assert_same(
            read_trace(folder, chunk_bytes=3, time_unit=unit), read_trace(folder, time_unit=unit)
        )


def test_members_after_trace_events_decide_the_time_unit(tmp_path):
    events = [kernel("a", 1_000_000, 2_500), kernel("b", 2_000_000, 1.5)]
    # Not a Kineto trace, "ns" declared after the events: read as µs first, then again as ns.
    late_ns = _write(
        tmp_path / "ns.json", json.dumps({"traceEvents": events, "displayTimeUnit": "ns"})
    )
    # displayTimeUnit "ns" first, but schemaVersion (Kineto) after the events: µs.
    late_kineto = _write(
        tmp_path / "k.json",
        json.dumps({"displayTimeUnit": "ns", "traceEvents": events, "schemaVersion": 1}),
    )
    for chunk_bytes in (7, 1 << 20):
        ns = read_trace(late_ns, chunk_bytes=chunk_bytes)
        assert ns.gpu.dur_ns.tolist() == [2_500, 2]
        assert_same(ns, one_pass(late_ns))
        us = read_trace(late_kineto, chunk_bytes=chunk_bytes)
        assert us.gpu.dur_ns.tolist() == [2_500_000, 1_500]
        assert_same(us, one_pass(late_kineto))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"traceEvents": [{"ph": "X"}, {"ph": "X", "ts": "soon"}]}', r"traceEvents\[1\]\.ts"),
        ('{"traceEvents": [{"ph": "X"} {"ph": "X"}]}', "expected ','"),
        ('{"traceEvents": [{"ph": "X"},]}', "trailing"),
        ('{"traceEvents": [{"ph": "X"}]} {}', "after the top-level value|trailing characters"),
        ('{"traceEvents": [{"ph": "X"}}', "closed by|expected ','"),
        ('{"traceEvents": [{"ph": "X", "name": "a\\"b', "truncated"),
        ('{"traceEvents": null}', "Expected `array`"),
        ('{"deviceProperties": 5, "traceEvents": []}', "deviceProperties"),
        ('"just a string"', "(?i)expected (an )?`?object"),
        ("", "truncated"),
    ],
)
def test_bad_json_is_a_trace_format_error_for_any_chunk_size(tmp_path, text, match):
    path = _write(tmp_path / "bad.json", text)
    for chunk_bytes in (1, 5, 1 << 20):
        with pytest.raises(TraceFormatError, match=match):
            read_trace(path, chunk_bytes=chunk_bytes)


def test_peak_memory_is_bounded_by_the_chunk_not_the_file(tmp_path):
    events = []
    for i in range(6000):  # ~2 MB; the kept columns are a small part of it
        events.append(kernel(f"kernel {i % 50} " + "x" * 120, i * 10, 5, corr=i, grid=[4, 1, 1]))
        events.append({"ph": "i", "name": "marker " + "y" * 150, "pid": 0, "tid": 0, "ts": i})
    path = write_trace(tmp_path / "big.json", events)
    size = path.stat().st_size
    assert size > 1.5e6
    tracemalloc.start()
    try:
        trace = read_trace(path, chunk_bytes=64 << 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(trace.gpu) == 6000
    assert peak < 0.4 * size, (peak, size)


def test_chunk_bytes_must_be_positive(tmp_path):
    path = write_trace(tmp_path / "t.json", [kernel("a", 0, 1)])
    with pytest.raises(ValueError, match="chunk_bytes"):
        read_trace(path, chunk_bytes=0)
