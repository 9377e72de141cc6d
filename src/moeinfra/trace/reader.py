"""Read Chrome-trace JSON written by the PyTorch Profiler (Kineto) into a :class:`~moeinfra.trace.model.Trace`.

Fast path: msgspec decodes only the fields the model needs (unknown fields and events are skipped in
C), then the events are sorted into column arrays. Files over 16 MB are decoded in chunks of events,
so peak memory stays below about twice the file size. Accepted inputs: a ``.json`` or ``.json.gz`` file
(object with ``traceEvents`` or a bare event array), or a folder of per-rank files. Timestamps are
microseconds unless the trace is in nanoseconds (see :func:`read_trace`); they become int64 ns exactly as
written: a fraction is read as a decimal (never through float64, which at epoch-µs magnitudes is only
0.25 µs fine) and rounded half to even only beyond the ns digit. Legacy Kineto category names
(``Kernel``, ``Memcpy``, ``Memset``, ``Runtime``, ``Operator``) are understood.
"""

from __future__ import annotations

import decimal
import gzip
import re
import zlib
from collections.abc import Iterable
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from moeinfra.errors import InputError, TraceFormatError
from moeinfra.trace.model import (
    CPU_OP,
    KERNEL,
    MEMCPY,
    MEMSET,
    OTHER_CPU,
    PYTHON,
    RUNTIME,
    Annotations,
    CpuEvents,
    DeviceProps,
    Flows,
    GpuOps,
    Trace,
)

TimeUnit = Literal["auto", "us", "ns"]


class _Args(msgspec.Struct, gc=False):
    # Typed loosely (Any): a wrong type in some unrelated event must not fail the whole file.
    stream: Any = None
    device: Any = None
    correlation: Any = None
    grid: Any = None


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = 0
    tid: int | str = 0
    # A number with a fraction or exponent decodes as an exact Decimal of its text (ints stay ints).
    ts: int | Decimal | None = None
    dur: int | Decimal | None = None
    id: Any = None
    args: _Args | None = None


class _DeviceProperties(msgspec.Struct, gc=False):
    id: Any = None
    name: str = ""
    numSms: int | None = None  # noqa: N815 (Kineto's field name)


class _TraceFile(msgspec.Struct, gc=False):
    traceEvents: list[_Event] = []  # noqa: N815
    deviceProperties: list[_DeviceProperties] = []  # noqa: N815
    distributedInfo: dict[str, Any] | None = None  # noqa: N815
    displayTimeUnit: str | None = None  # noqa: N815
    schemaVersion: Any = None  # noqa: N815


class _RawTraceFile(_TraceFile, gc=False):
    # Large files: events stay undecoded (zero-copy views of the file bytes) and are decoded in
    # chunks, so the decoded form of the whole file never exists at once (bounded memory).
    traceEvents: list[msgspec.Raw] = []  # type: ignore[assignment]  # noqa: N815


_DECODERS = {False: msgspec.json.Decoder(_TraceFile), True: msgspec.json.Decoder(_RawTraceFile)}
_ARRAY_DECODERS = {
    False: msgspec.json.Decoder(list[_Event]),
    True: msgspec.json.Decoder(list[msgspec.Raw]),
}
_EVENTS_DECODER = _ARRAY_DECODERS[False]
_CHUNK = 8_000  # events per decoded chunk: small chunks keep peak memory low
_TS_LIMIT_NS = 2**62  # |ts| and dur in ns must fit int64 with room for ts + dur
# Decimal arithmetic for times: exact (no precision limit), and comparing a NaN (from a "NaN" string)
# is False instead of an error, so such a time fails the range check like an out-of-range one.
_EXACT = decimal.Context(
    prec=decimal.MAX_PREC, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[]
)
# Per unit, |value| < _TS_LIMIT_NS ns exactly, as an int bound for ints and a Decimal bound for
# Decimals (each compares about 3x faster with its own type).
_LIMITS = {
    unit: (-(-_TS_LIMIT_NS // scale), Decimal(_TS_LIMIT_NS).scaleb(-digits, _EXACT))
    for unit, scale, digits in (("us", 1000, 3), ("ns", 1, 0))
}
_ONE_PASS_BYTES = 16_000_000  # below this, decode in one pass (faster); above, in chunks

# Category (lower case) -> GPU op kind. Legacy Kineto used "Kernel", "Memcpy", "Memset".
_GPU_CATS = {
    "kernel": KERNEL,
    "gpu_memcpy": MEMCPY,
    "memcpy": MEMCPY,
    "gpu_memset": MEMSET,
    "memset": MEMSET,
}
_CPU_CATS = {
    "cpu_op": CPU_OP,
    "operator": CPU_OP,
    "cuda_runtime": RUNTIME,
    "cuda_driver": RUNTIME,
    "runtime": RUNTIME,
    "driver": RUNTIME,
    "python_function": PYTHON,
}
_ANNOTATION_CATS = {"user_annotation": False, "gpu_user_annotation": True}
_TRACE_SUFFIXES = (".json", ".json.gz")
_DIGITS = re.compile(r"-?\d+")


def read_trace(path: str | Path, *, time_unit: TimeUnit = "auto", progress: bool = False) -> Trace:
    """Read one trace file or a folder of per-rank trace files.

    Args:
        path: a ``.json`` / ``.json.gz`` Chrome trace, or a folder holding such files (one per
            rank; the rank comes from ``distributedInfo.rank`` or else the file's sorted position).
        time_unit: unit of ``ts`` / ``dur``. ``"us"`` (the Chrome-trace standard, what Kineto
            writes; fractions are read exactly and rounded half to even beyond the ns digit), ``"ns"``,
            or ``"auto"``: ns only when the file declares ``displayTimeUnit: "ns"`` and is not a Kineto
            trace (no ``schemaVersion``).
        progress: show a progress bar over the files of a folder.

    Returns:
        The merged :class:`Trace`, times in int64 ns.

    Raises:
        InputError: ``path`` does not exist, or a folder holds no trace files.
        TraceFormatError: a file is not valid (e.g. truncated) trace JSON.
    """
    if time_unit not in ("auto", "us", "ns"):
        raise InputError(f"time_unit={time_unit!r} is not allowed; use 'auto', 'us' or 'ns'")
    path = Path(path)
    if path.is_dir():
        files = sorted(
            p for p in path.iterdir() if p.is_file() and p.name.endswith(_TRACE_SUFFIXES)
        )
        if not files:
            raise InputError(
                f"path={str(path)!r} is a folder without .json or .json.gz trace files"
            )
    elif path.exists():
        files = [path]
    else:
        raise InputError(
            f"path={str(path)!r} does not exist; give a trace file or a folder of them"
        )

    iterator: Iterable[Path] = files
    if progress and len(files) > 1:
        from tqdm import tqdm

        iterator = tqdm(files, desc="reading traces", unit="file")
    collector = _Collector()
    declared = []
    for position, file in enumerate(iterator):
        declared.append(_read_file(file, position, time_unit, collector))
    if collector.events_seen == 0:
        raise TraceFormatError(
            f"{path}: no trace events (no traceEvents array, or an empty one); "
            "a Chrome trace lists its events in traceEvents"
        )
    return collector.finish(_assign_ranks(declared), [str(f) for f in files])


def _assign_ranks(declared: list[int | None]) -> list[int]:
    """Declared ranks where unique; files without one (or repeating one) get the lowest free ranks."""
    ranks: list[int | None] = []
    used: set[int] = set()
    for rank in declared:
        keep = rank is not None and rank not in used
        ranks.append(rank if keep else None)
        if keep:
            used.add(rank)  # type: ignore[arg-type]
    free = (r for r in range(len(declared) + len(used) + 1) if r not in used)
    return [r if r is not None else next(free) for r in ranks]


def decode_trace_bytes(
    data: bytes, source: str = "<bytes>", raw_events: bool = False
) -> _TraceFile:
    """Decode trace JSON bytes (events as msgspec.Raw when ``raw_events``); raises TraceFormatError."""
    first = re.match(rb"\s*", data).end()  # type: ignore[union-attr]
    try:
        if data[first : first + 1] == b"[":
            events = _ARRAY_DECODERS[raw_events].decode(data)
            return (
                _RawTraceFile(traceEvents=events) if raw_events else _TraceFile(traceEvents=events)
            )
        return _DECODERS[raw_events].decode(data)
    except msgspec.DecodeError as exc:
        message = str(exc)
        hint = (
            " (the file looks truncated: was it still being written?)"
            if "truncated" in message
            else ""
        )
        raise TraceFormatError(
            f"{source}: not a valid Chrome trace JSON: {message}{hint}"
        ) from None


def _load_bytes(file: Path) -> bytes:
    raw = file.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as exc:
            raise TraceFormatError(
                f"{file}: broken gzip stream ({exc}); the file may be truncated"
            ) from None
    return raw


def _as_int(value: Any, default: int) -> int:
    if type(value) is int:
        return value
    if isinstance(value, str):
        match = _DIGITS.search(value)
        if match:
            return int(match.group())
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return default


def _read_file(file: Path, position: int, time_unit: TimeUnit, collector: _Collector) -> int | None:
    """Decode one file into ``collector`` (events tagged with ``position``); return its declared rank."""
    data = _load_bytes(file)
    raw_events = len(data) > _ONE_PASS_BYTES
    doc = decode_trace_bytes(data, str(file), raw_events)
    del data  # raw events keep the buffer alive by themselves; decoded ones do not need it
    unit = time_unit
    if unit == "auto":
        unit = "ns" if doc.displayTimeUnit == "ns" and doc.schemaVersion is None else "us"
    rank = None
    if doc.distributedInfo and isinstance(doc.distributedInfo.get("rank"), int):
        rank = doc.distributedInfo["rank"]
    for p in doc.deviceProperties:
        device = _as_int(p.id, -1)
        if device >= 0:
            collector.devices[(position, device)] = DeviceProps(
                device=device, name=p.name, num_sms=p.numSms
            )
    if not raw_events:
        collector.add(doc.traceEvents, position, unit)
        return rank
    raws = doc.traceEvents
    doc = None
    for lo in range(0, len(raws), _CHUNK):
        chunk = b"[" + b",".join(raws[lo : lo + _CHUNK]) + b"]"
        try:
            events = _EVENTS_DECODER.decode(chunk)
        except msgspec.DecodeError as exc:
            message = re.sub(
                r"\$\[(\d+)\]",
                lambda m, offset=lo: f"$.traceEvents[{int(m.group(1)) + offset}]",
                str(exc),
            )
            raise TraceFormatError(f"{file}: not a valid Chrome trace event: {message}") from None
        del chunk
        collector.add(events, position, unit)
    return rank


def _to_ns(values: list[int | Decimal], unit: str) -> np.ndarray:
    """Timestamps or durations in ``unit`` (µs or ns) as written -> int64 ns, shape ``[len(values)]``.

    ``values`` are ints or Decimals (the exact text of a number with a fraction), already checked
    to be finite and within int64 ns. The result is exact; a fraction finer than 1 ns is rounded
    half to even (``1700000000123456.789`` µs -> ``1700000000123456789``; ``0.0005`` µs -> 0 ns,
    ``0.0015`` µs -> 2 ns).
    """
    if not values:
        return np.zeros(0, dtype=np.int64)
    scale = 1000 if unit == "us" else 1
    arr = np.asarray(values)
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64) * scale
    with decimal.localcontext(_EXACT):  # exact product; round() of a Decimal is half to even
        return np.asarray([round(v * scale) for v in values], dtype=np.int64)


def _grid_blocks(grid: Any) -> int:
    if type(grid) is not list or not grid:
        return 0
    blocks = 1
    for g in grid:
        if type(g) is not int:
            return 0
        blocks *= g
    return blocks


def _int_column(values: list, fallback: list, default: int) -> list[int]:
    """``values`` as ints; where not an int (or digits in a string), the fallback, else ``default``."""
    return [
        v if type(v) is int else _as_int(v, _as_int(f, default))
        for v, f in zip(values, fallback, strict=True)
    ]


def _intern(values: list, table: dict) -> np.ndarray:
    """Index of every value in ``table`` (values not yet in it are appended), int32 ``[len(values)]``."""
    lookup = {v: table.setdefault(v, len(table)) for v in dict.fromkeys(values)}
    return np.asarray([lookup[v] for v in values], dtype=np.int32)


def _thread_ids(events: list[_Event], rank: int, threads: dict) -> np.ndarray:
    """Global thread index of every event, keyed by ``(rank, pid, tid)``, int32 ``[len(events)]``."""
    if not events:
        return np.zeros(0, dtype=np.int32)
    pids = [e.pid for e in events]
    tids = [e.tid for e in events]
    try:
        # The usual case: integer ids (a string id makes the conversion fail).
        pid = np.asarray(pids, dtype=np.int64)
        tid = np.asarray(tids, dtype=np.int64)
        fast = pid.min() >= 0 and tid.min() >= 0 and max(pid.max(), tid.max()) < 2**31
    except (TypeError, ValueError, OverflowError):
        fast = False
    if fast:
        keys, inverse = np.unique((pid << 31) | tid, return_inverse=True)
        pairs: list = [(int(k >> 31), int(k & (2**31 - 1))) for k in keys.tolist()]
    else:
        local: dict = {}
        inverse = _intern(list(zip(pids, tids, strict=True)), local)
        pairs = list(local)
    table = np.asarray(
        [threads.setdefault((rank, p, t), len(threads)) for p, t in pairs], dtype=np.int32
    )
    return table[inverse.reshape(-1)]


class _Collector:
    """Accumulates column parts chunk by chunk; :meth:`finish` builds the :class:`Trace`."""

    def __init__(self) -> None:
        self.gpu_names: dict[str, int] = {}
        self.cpu_names: dict[str, int] = {}
        self.ann_names: dict[str, int] = {}
        self.flow_cats: dict[str, int] = {}
        self.threads: dict[tuple[int, int | str, int | str], int] = {}
        self.g_parts: list[dict[str, np.ndarray]] = []
        self.c_parts: list[dict[str, np.ndarray]] = []
        self.a_parts: list[dict[str, np.ndarray]] = []
        self.f_parts: list[dict[str, np.ndarray]] = []
        self.skipped: dict[str, int] = {}
        self.events_seen = 0
        self.devices: dict[tuple[int, int], DeviceProps] = {}

    def add(self, events: list[_Event], rank: int, unit: str) -> None:
        """Add decoded events of one file (``rank`` = the file's position until :meth:`finish`)."""
        gpu_names, cpu_names, ann_names, flow_cats = (
            self.gpu_names,
            self.cpu_names,
            self.ann_names,
            self.flow_cats,
        )
        threads, skipped = self.threads, self.skipped
        g_parts, c_parts, a_parts, f_parts = self.g_parts, self.c_parts, self.a_parts, self.f_parts
        # One pass to bucket events by phase and category; columns come from comprehensions.
        by_cat: dict[str, list[_Event]] = {}
        flow_events: list[_Event] = []
        self.events_seen += len(events)
        # times become int64 ns: an event without a ts, or one beyond int64's range, is skipped
        limit, dec_limit = _LIMITS[unit]
        unplaced = 0
        with decimal.localcontext(_EXACT):  # a NaN Decimal compares False: skipped, not an error
            for ev in events:
                ph = ev.ph
                if ph != "X" and ph != "s" and ph != "f":
                    continue
                ts = ev.ts
                if not (
                    -limit < ts < limit
                    if type(ts) is int
                    else ts is not None and -dec_limit < ts < dec_limit
                ):
                    unplaced += 1
                elif ph == "X":
                    bucket = by_cat.get(ev.cat)
                    if bucket is None:
                        bucket = by_cat[ev.cat] = []
                    bucket.append(ev)
                else:
                    flow_events.append(ev)
        if unplaced:
            reason = "event without ts or with ts beyond int64 ns"
            skipped[reason] = skipped.get(reason, 0) + unplaced

        gpu_events: list[_Event] = []
        gpu_kind: list[int] = []
        cpu_events: list[_Event] = []
        cpu_kind: list[int] = []
        cpu_corr: list[int] = []
        cpu_threads: list[np.ndarray] = []
        ann_events: list[_Event] = []
        ann_gpu: list[bool] = []
        for cat, bucket in by_cat.items():
            low = cat.lower()
            with decimal.localcontext(_EXACT):
                has_dur = [
                    e
                    for e in bucket
                    if (
                        -limit < e.dur < limit
                        if type(e.dur) is int
                        else e.dur is not None and -dec_limit < e.dur < dec_limit
                    )
                ]
            missing = len(bucket) - len(has_dur)
            kind = _GPU_CATS.get(low)
            if missing:
                reason = "GPU op without dur" if kind is not None else "CPU event without dur"
                skipped[reason] = skipped.get(reason, 0) + missing
            if kind is not None:
                gpu_events += has_dur
                gpu_kind += [kind] * len(has_dur)
            elif low in _ANNOTATION_CATS:
                ann_events += has_dur
                ann_gpu += [_ANNOTATION_CATS[low]] * len(has_dur)
            else:
                cpu_code = _CPU_CATS.get(low, OTHER_CPU)
                cpu_events += has_dur
                # Per category: a stray string id in one category keeps the others on the fast path.
                cpu_threads.append(_thread_ids(has_dur, rank, threads))
                cpu_kind += [cpu_code] * len(has_dur)
                # Only runtime/driver calls carry the correlation id that links them to GPU ops.
                cpu_corr += (
                    [_as_int(e.args.correlation, -1) if e.args is not None else -1 for e in has_dur]
                    if cpu_code == RUNTIME
                    else [-1] * len(has_dur)
                )

        args = [e.args for e in gpu_events]
        pids = [e.pid for e in gpu_events]
        tids = [e.tid for e in gpu_events]
        kinds = np.asarray(gpu_kind, dtype=np.int8)
        g_parts.append(
            {
                "name": _intern([e.name for e in gpu_events], gpu_names),
                "kind": kinds,
                "rank": np.full(len(gpu_events), rank, dtype=np.int32),
                "device": np.asarray(
                    _int_column([a.device if a else None for a in args], pids, 0), dtype=np.int32
                ),
                "stream": np.asarray(
                    _int_column([a.stream if a else None for a in args], tids, 0), dtype=np.int64
                ),
                "start": _to_ns([e.ts for e in gpu_events], unit),
                "dur": _to_ns([e.dur for e in gpu_events], unit),
                "corr": np.asarray(
                    _int_column(
                        [a.correlation if a else None for a in args], [None] * len(args), -1
                    ),
                    dtype=np.int64,
                ),
                "blocks": np.asarray(
                    [_grid_blocks(a.grid) if a else 0 for a in args], dtype=np.int64
                )
                * (kinds == KERNEL),
            }
        )
        c_parts.append(
            {
                "name": _intern([e.name for e in cpu_events], cpu_names),
                "kind": np.asarray(cpu_kind, dtype=np.int8),
                "rank": np.full(len(cpu_events), rank, dtype=np.int32),
                "thread": np.concatenate(cpu_threads) if cpu_threads else np.zeros(0, np.int32),
                "start": _to_ns([e.ts for e in cpu_events], unit),
                "dur": _to_ns([e.dur for e in cpu_events], unit),
                "corr": np.asarray(cpu_corr, dtype=np.int64),
            }
        )
        a_parts.append(
            {
                "name": _intern([e.name for e in ann_events], ann_names),
                "rank": np.full(len(ann_events), rank, dtype=np.int32),
                "thread": _thread_ids(ann_events, rank, threads),
                "start": _to_ns([e.ts for e in ann_events], unit),
                "dur": _to_ns([e.dur for e in ann_events], unit),
                "gpu": np.asarray(ann_gpu, dtype=bool),
            }
        )
        f_parts.append(
            {
                "id": np.asarray(
                    [
                        e.id if type(e.id) is int else hash(str(e.id)) & 0x7FFFFFFFFFFFFFFF
                        for e in flow_events
                    ],
                    dtype=np.int64,
                ),
                "start": np.asarray([e.ph == "s" for e in flow_events], dtype=bool),
                "rank": np.full(len(flow_events), rank, dtype=np.int32),
                "ts": _to_ns([e.ts for e in flow_events], unit),
                "cat": _intern([e.cat for e in flow_events], flow_cats),
            }
        )

    def finish(self, ranks: list[int], sources: list[str]) -> Trace:
        """Concatenate the parts, map file positions to ``ranks``, sort, and build the Trace."""
        rank_of = np.asarray(ranks, dtype=np.int32)
        skipped, threads = self.skipped, self.threads
        gpu_names, cpu_names, ann_names, flow_cats = (
            self.gpu_names,
            self.cpu_names,
            self.ann_names,
            self.flow_cats,
        )
        devices = {(ranks[pos], dev): prop for (pos, dev), prop in self.devices.items()}
        g = _concat(self.g_parts, GPU_COLUMNS)
        g["rank"] = rank_of[g["rank"]]
        negative = g["dur"] < 0
        if negative.any():
            skipped["GPU op with negative dur"] = int(negative.sum())
            g = {k: v[~negative] for k, v in g.items()}
        g_end = g["start"] + g["dur"]
        order = np.lexsort((g["start"], g["stream"], g["device"], g["rank"]))
        gpu = GpuOps(
            names=list(gpu_names),
            name_id=g["name"][order],
            kind=g["kind"][order],
            rank=g["rank"][order],
            device=g["device"][order],
            stream=g["stream"][order],
            start_ns=g["start"][order],
            end_ns=g_end[order],
            correlation=g["corr"][order],
            blocks=g["blocks"][order],
        )
        c = _concat(self.c_parts, CPU_COLUMNS)
        order = np.argsort(c["start"], kind="stable")
        cpu = CpuEvents(
            names=list(cpu_names),
            name_id=c["name"][order],
            kind=c["kind"][order],
            rank=rank_of[c["rank"][order]],
            thread=c["thread"][order],
            start_ns=c["start"][order],
            end_ns=(c["start"] + c["dur"])[order],
            correlation=c["corr"][order],
        )
        a = _concat(self.a_parts, ANN_COLUMNS)
        order = np.argsort(a["start"], kind="stable")
        annotations = Annotations(
            names=list(ann_names),
            name_id=a["name"][order],
            rank=rank_of[a["rank"][order]],
            thread=a["thread"][order],
            start_ns=a["start"][order],
            end_ns=(a["start"] + a["dur"])[order],
            on_gpu=a["gpu"][order],
        )
        f = _concat(self.f_parts, FLOW_COLUMNS)
        flows = Flows(
            flow_id=f["id"],
            is_start=f["start"],
            rank=rank_of[f["rank"]],
            ts_ns=f["ts"],
            category=list(flow_cats),
            category_id=f["cat"],
        )
        return Trace(
            gpu=gpu,
            cpu=cpu,
            annotations=annotations,
            flows=flows,
            threads=[(ranks[pos], str(p), str(t)) for pos, p, t in threads],
            devices=devices,
            ranks=list(ranks),
            sources=sources,
            skipped=skipped,
        )


GPU_COLUMNS = {
    "name": np.int32,
    "kind": np.int8,
    "rank": np.int32,
    "device": np.int32,
    "stream": np.int64,
    "start": np.int64,
    "dur": np.int64,
    "corr": np.int64,
    "blocks": np.int64,
}
CPU_COLUMNS = {
    "name": np.int32,
    "kind": np.int8,
    "rank": np.int32,
    "thread": np.int32,
    "start": np.int64,
    "dur": np.int64,
    "corr": np.int64,
}
ANN_COLUMNS = {
    "name": np.int32,
    "rank": np.int32,
    "thread": np.int32,
    "start": np.int64,
    "dur": np.int64,
    "gpu": bool,
}
FLOW_COLUMNS = {"id": np.int64, "start": bool, "rank": np.int32, "ts": np.int64, "cat": np.int32}


def _concat(parts: list[dict[str, np.ndarray]], columns: dict[str, Any]) -> dict[str, np.ndarray]:
    if not parts:
        return {key: np.zeros(0, dtype=dtype) for key, dtype in columns.items()}
    return {
        key: np.concatenate([p[key] for p in parts]).astype(dtype, copy=False)
        for key, dtype in columns.items()
    }
