"""Builders of hand-made Kineto-style Chrome traces for the trace tests."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def kernel(
    name: str,
    ts: float,
    dur: float | None,
    stream: int = 7,
    device: int = 0,
    corr: int = -1,
    grid=None,
    cat="kernel",
):
    """One Kineto-style GPU op event."""
    args = {"device": device, "stream": stream}
    if corr >= 0:
        args["correlation"] = corr
    if grid is not None:
        args["grid"] = grid
    event = {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": device,
        "tid": stream,
        "ts": ts,
        "args": args,
    }
    if dur is not None:
        event["dur"] = dur
    return event


def launch(ts: float, corr: int, tid: int = 1, dur: float = 1, name: str = "cudaLaunchKernel"):
    """A runtime event (default cudaLaunchKernel) with a correlation id."""
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": name,
        "pid": 100,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": corr},
    }


def annotation(name: str, ts: float, dur: float, tid: int = 1):
    """A CPU-side user annotation (record_function range)."""
    return {
        "ph": "X",
        "cat": "user_annotation",
        "name": name,
        "pid": 100,
        "tid": tid,
        "ts": ts,
        "dur": dur,
    }


def write_trace(path: Path, events: list[dict], gz: bool = False, **top) -> Path:
    """Write a Chrome trace with ``events`` (plus top-level keys) to ``path``."""
    doc = {"schemaVersion": 1, "traceEvents": events, **top}
    data = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path
