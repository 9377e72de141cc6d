"""Read Chrome-trace JSON written by the PyTorch Profiler (Kineto) into a :class:`~moeinfra.trace.model.Trace`.

Streaming: a file (``.json``, or ``.json.gz`` decompressed on the fly) is read in chunks of
``chunk_bytes``; :mod:`moeinfra.trace.stream` cuts each chunk after the last complete event of
``traceEvents``, msgspec decodes those events (only the fields the model needs; unknown fields and
events are skipped in C), and only the column arrays of the ops kept stay in memory, so peak memory
is the chunk's decoded events plus those columns, never the whole file. A file that fits in one
chunk is decoded in one pass. Top-level fields
(``deviceProperties``, ``distributedInfo``, ``displayTimeUnit``, ``schemaVersion``) are read wherever they
are in the file, also after ``traceEvents``. The result does not depend on the chunk size: names and
threads are numbered as a one-pass decode of each file numbers them. Accepted inputs: a ``.json`` or
``.json.gz`` file (object with ``traceEvents`` or a bare event array), or a folder of per-rank files.
Timestamps are microseconds unless the trace is in nanoseconds (see :func:`read_trace`); they become
int64 ns exactly as written: a fraction is read as a decimal (never through float64, which at epoch-µs
magnitudes is only 0.25 µs fine) and rounded half to even only beyond the ns digit. Legacy Kineto
category names (``Kernel``, ``Memcpy``, ``Memset``, ``Runtime``, ``Operator``) are understood.
"""

from __future__ import annotations

import contextlib
import copy
import decimal
import gzip
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
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
from moeinfra.trace.stream import ScanError, scan_trace

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


_DECODER = msgspec.json.Decoder(_TraceFile)
_EVENTS_DECODER = msgspec.json.Decoder(list[_Event])
_HEAD_KEYS = frozenset(_TraceFile.__struct_fields__)  # top-level members kept whatever their size
_OTHER_MEMBER_BYTES = 1 << 20  # other members up to this size are still checked to be valid JSON
#: Bytes read (after decompression) per step. Peak memory of reading is a few times this (the
#: chunk's decoded events) plus the column arrays of the ops kept.
CHUNK_BYTES = 4 << 20
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


def read_trace(
    path: str | Path,
    *,
    time_unit: TimeUnit = "auto",
    progress: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
) -> Trace:
    """Read one trace file or a folder of per-rank trace files.

    Args:
        path: a ``.json`` / ``.json.gz`` Chrome trace, or a folder holding such files (one per
            rank; the rank comes from ``distributedInfo.rank`` or else the file's sorted position).
        time_unit: unit of ``ts`` / ``dur``. ``"us"`` (the Chrome-trace standard, what Kineto
            writes; fractions are read exactly and rounded half to even beyond the ns digit), ``"ns"``,
            or ``"auto"``: ns only when the file declares ``displayTimeUnit: "ns"`` and is not a Kineto
            trace (no ``schemaVersion``).
        progress: show a progress bar over the files of a folder.
        chunk_bytes: bytes read (decompressed) per step; the result is the same for any size.

    Returns:
        The merged :class:`Trace`, times in int64 ns.

    Raises:
        InputError: ``path`` does not exist, or a folder holds no trace files.
        TraceFormatError: a file is not valid (e.g. truncated) trace JSON.
    """
    if time_unit not in ("auto", "us", "ns"):
        raise InputError(f"time_unit={time_unit!r} is not allowed; use 'auto', 'us' or 'ns'")
    if not (isinstance(chunk_bytes, int) and chunk_bytes > 0):
        raise InputError(f"chunk_bytes={chunk_bytes!r} must be a positive number of bytes")
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
        declared.append(_read_file(file, position, time_unit, collector, chunk_bytes))
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


def decode_trace_bytes(data: bytes, source: str = "<bytes>") -> _TraceFile:
    """Decode a whole trace JSON document in one pass (a bare event array too); raises TraceFormatError.

    :func:`read_trace` streams instead; this one-pass form is the reference it is tested against.
    """
    first = re.match(rb"\s*", data).end()  # type: ignore[union-attr]
    try:
        if data[first : first + 1] == b"[":
            return _TraceFile(traceEvents=_EVENTS_DECODER.decode(data))
        return _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise TraceFormatError(_format_message(source, str(exc))) from None


def _format_message(source: str, message: str) -> str:
    hint = (
        " (the file looks truncated: was it still being written?)" if "truncated" in message else ""
    )
    return f"{source}: not a valid Chrome trace JSON: {message}{hint}"


@contextlib.contextmanager
def _opened(file: Path) -> Iterator[Callable[[int], bytes]]:
    """``read(n)`` of ``file``'s bytes, decompressed if gzip (found by its magic bytes, not its name)."""
    with file.open("rb") as raw:
        gz = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        if not gz:
            yield raw.read
            return
        with gzip.GzipFile(fileobj=raw) as unpacked:

            def read(size: int) -> bytes:
                try:
                    return unpacked.read(size)
                except (EOFError, OSError, zlib.error) as exc:
                    raise TraceFormatError(
                        f"{file}: broken gzip stream ({exc}); the file may be truncated"
                    ) from None

            yield read


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


def _head_unit(members: list[bytes], keys: set[str], source: str) -> str | None:
    """The time unit that ``time_unit="auto"`` gives, if the members read so far decide it."""
    head = _decode_head(members, source)
    if head.schemaVersion is not None:  # a Kineto trace: µs whatever else it declares
        return "us"
    if "displayTimeUnit" in keys and head.displayTimeUnit != "ns":
        return "us"
    return None  # "ns" only once the whole file shows there is no schemaVersion


def _decode_head(members: list[bytes], source: str) -> _TraceFile:
    try:
        return _DECODER.decode(b"{" + b",".join(members) + b"}")
    except msgspec.DecodeError as exc:
        raise TraceFormatError(_format_message(source, str(exc))) from None


def _event_error(source: str, exc: msgspec.DecodeError, done: int, offset: int, bare: bool) -> str:
    """msgspec's message about a batch of events, with positions in the file: event ``$[i]`` is
    event ``done + i`` of the file, byte ``b`` of the batch is at file offset ``offset + b - 1``."""
    path = "$" if bare else "$.traceEvents"
    message = re.sub(r"\$\[(\d+)\]", lambda m: f"{path}[{int(m.group(1)) + done}]", str(exc))
    message = re.sub(r"\(byte (\d+)\)", lambda m: f"(byte {int(m.group(1)) + offset - 1})", message)
    return _format_message(source, message)


def _read_file(
    file: Path, position: int, time_unit: TimeUnit, collector: _Collector, chunk_bytes: int
) -> int | None:
    """Read one file into ``collector`` (events tagged with ``position``); return its declared rank.

    A file that fits in one chunk is decoded in one pass; a larger one is streamed (see
    :func:`_stream_file`).
    """
    source = str(file)
    with _opened(file) as read:
        first = read(chunk_bytes)
        more = read(1) if first else b""
        if more:
            chunks = iter((first, more))
            del first, more
            head = _stream_file(
                lambda size: next(chunks, b"") or read(size),
                source,
                position,
                time_unit,
                collector,
                chunk_bytes,
            )
        else:
            head = decode_trace_bytes(first, source)
            del first
            unit = time_unit
            if unit == "auto":
                unit = "ns" if head.displayTimeUnit == "ns" and head.schemaVersion is None else "us"
            collector.add(head.traceEvents, position, unit)
    if head is None:  # the file declared ns after its events: read it again as ns
        return _read_file(file, position, "ns", collector, chunk_bytes)
    rank = None
    if head.distributedInfo and isinstance(head.distributedInfo.get("rank"), int):
        rank = head.distributedInfo["rank"]
    for p in head.deviceProperties:
        device = _as_int(p.id, -1)
        if device >= 0:
            collector.devices[(position, device)] = DeviceProps(
                device=device, name=p.name, num_sms=p.numSms
            )
    return rank


def _stream_file(
    read: Callable[[int], bytes],
    source: str,
    position: int,
    time_unit: TimeUnit,
    collector: _Collector,
    chunk_bytes: int,
) -> _TraceFile | None:
    """Stream one file's events into ``collector``; return its other top-level fields.

    With ``time_unit="auto"`` the unit can depend on members after ``traceEvents``: until one
    decides it the events are read as µs (Kineto's unit). Should the file end up declaring ns,
    ``collector`` goes back to where it was and None is returned: the file must be read as ns.
    """
    unit: str | None = None if time_unit == "auto" else time_unit
    members: list[bytes] = []
    keys: set[str] = set()
    snapshot = None
    done = 0
    try:
        for item in scan_trace(read, chunk_bytes, keep=_HEAD_KEYS, cap=_OTHER_MEMBER_BYTES):
            if item[0] == "member":
                keys.add(item[1])
                if item[2] is not None:
                    members.append(item[2])
                continue
            _, data, offset, bare = item
            if unit is None:
                unit = _head_unit(members, keys, source)
                if unit is None:
                    snapshot, unit = collector.snapshot(), "us"
            try:
                events = _EVENTS_DECODER.decode(data)
            except msgspec.DecodeError as exc:
                raise TraceFormatError(_event_error(source, exc, done, offset, bare)) from None
            del data, item
            done += len(events)
            collector.add(events, position, unit)
            del events
    except ScanError as exc:
        raise TraceFormatError(_format_message(source, str(exc))) from None
    head = _decode_head(members, source)
    if snapshot is not None and head.displayTimeUnit == "ns" and head.schemaVersion is None:
        collector.restore(snapshot)
        return None
    return head


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


def _thread_ids(
    events: list[_Event], rank: int, threads: dict
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Threads of ``events`` in ``threads`` (keyed by ``(rank, pid, tid)``, new ones appended).

    Returns:
        index in ``threads`` of every event, int32 ``[len(events)]``; the distinct threads in order
        of first appearance, int32 ``[threads seen]``; whether every id is an int in ``[0, 2**31)``
        (a one-pass read then numbers the threads in (pid, tid) order, else in order of appearance).
    """
    if not events:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32), True
    pids = [e.pid for e in events]
    tids = [e.tid for e in events]
    try:
        # The usual case: integer ids (a string id makes the conversion fail).
        pid = np.asarray(pids, dtype=np.int64)
        tid = np.asarray(tids, dtype=np.int64)
        fast = bool(pid.min() >= 0 and tid.min() >= 0 and max(pid.max(), tid.max()) < 2**31)
    except (TypeError, ValueError, OverflowError):
        fast = False
    if fast:
        keys, first, inverse = np.unique((pid << 31) | tid, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        position = np.empty_like(order)
        position[order] = np.arange(len(order))
        inverse = position[inverse.reshape(-1)]
        pairs: list = [(int(k >> 31), int(k & (2**31 - 1))) for k in keys[order].tolist()]
    else:
        local: dict = {}
        inverse = _intern(list(zip(pids, tids, strict=True)), local)
        pairs = list(local)
    table = np.asarray(
        [threads.setdefault((rank, p, t), len(threads)) for p, t in pairs], dtype=np.int32
    )
    return table[inverse], table, fast


def _note_first(keys: dict, values: Iterable, group: tuple) -> None:
    """``keys[v] = min(keys[v], (*group, i))`` for the ``i``-th distinct value ``v`` of ``values``."""
    for i, value in enumerate(dict.fromkeys(values)):
        key = (*group, i)
        old = keys.get(value)
        if old is None or key < old:
            keys[value] = key


def _renumbering(table: dict, keys: dict) -> tuple[list, np.ndarray]:
    """The entries of ``table`` (value -> index) sorted by ``keys[value]``, and old -> new index."""
    values = list(table)
    order = sorted(range(len(values)), key=lambda i: keys[values[i]])
    new = np.empty(len(values), dtype=np.int32)
    new[order] = np.arange(len(values), dtype=np.int32)
    return [values[i] for i in order], new


class _Collector:
    """Accumulates column parts chunk by chunk; :meth:`finish` builds the :class:`Trace`.

    Names and threads are first numbered as they come; :meth:`finish` renumbers them as a
    one-pass read of each file would (categories in order of first appearance, then events in
    order), from the first-appearance keys noted per chunk, so the chunking never shows.
    """

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
        # Order keys (see the class docstring): chunks and categories in order of appearance.
        self.chunks = 0
        self.cat_seq: dict[tuple[int, str], int] = {}  # (file, category) -> order of appearance
        self.gpu_keys: dict[str, tuple] = {}
        self.cpu_keys: dict[str, tuple] = {}
        self.ann_keys: dict[str, tuple] = {}
        # (file, 0, category) for CPU categories, (file, 1, 0) for annotations -> [all ids in
        # [0, 2**31), {thread: first-appearance key}]
        self.thread_groups: dict[tuple[int, int, int], list] = {}
        self.skip_keys: dict[str, tuple] = {}

    def snapshot(self) -> dict[str, Any]:
        """A copy of the state, for :meth:`restore` (column parts are shared, not copied)."""
        state = vars(self)
        parts = {k: list(v) for k, v in state.items() if k.endswith("_parts")}
        return copy.deepcopy({k: v for k, v in state.items() if k not in parts}) | parts

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Go back to the state of :meth:`snapshot`."""
        vars(self).update(snapshot)

    def _skip(self, reason: str, count: int, key: tuple) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count
        old = self.skip_keys.get(reason)
        if old is None or key < old:
            self.skip_keys[reason] = key

    def _threads(self, events: list[_Event], rank: int, group: tuple, cat: int) -> np.ndarray:
        """Thread ids of ``events`` (one category of one chunk), noting their order keys."""
        ids, seen, fast = _thread_ids(events, rank, self.threads)
        if len(seen):
            info = self.thread_groups.setdefault(group, [True, {}])
            info[0] = info[0] and fast
            _note_first(info[1], seen.tolist(), (cat, self.chunks))
        return ids

    def add(self, events: list[_Event], rank: int, unit: str) -> None:
        """Add decoded events of one file (``rank`` = the file's position until :meth:`finish`)."""
        gpu_names, cpu_names, ann_names, flow_cats = (
            self.gpu_names,
            self.cpu_names,
            self.ann_names,
            self.flow_cats,
        )
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
            self._skip("event without ts or with ts beyond int64 ns", unplaced, (rank, 0, 0))

        gpu_events: list[_Event] = []
        gpu_kind: list[int] = []
        gpu_seq: list[int] = []
        cpu_events: list[_Event] = []
        cpu_kind: list[int] = []
        cpu_seq: list[int] = []
        cpu_corr: list[int] = []
        cpu_threads: list[np.ndarray] = []
        ann_events: list[_Event] = []
        ann_gpu: list[bool] = []
        ann_seq: list[int] = []
        ann_threads: list[np.ndarray] = []
        chunk = self.chunks
        for cat, bucket in by_cat.items():
            low = cat.lower()
            seq = self.cat_seq.setdefault((rank, cat), len(self.cat_seq))
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
                self._skip(reason, missing, (rank, 1, seq))
            if kind is not None:
                gpu_events += has_dur
                gpu_kind += [kind] * len(has_dur)
                gpu_seq += [seq] * len(has_dur)
                _note_first(self.gpu_keys, [e.name for e in has_dur], (seq, chunk))
            elif low in _ANNOTATION_CATS:
                ann_events += has_dur
                ann_gpu += [_ANNOTATION_CATS[low]] * len(has_dur)
                ann_seq += [seq] * len(has_dur)
                _note_first(self.ann_keys, [e.name for e in has_dur], (seq, chunk))
                ann_threads.append(self._threads(has_dur, rank, (rank, 1, 0), seq))
            else:
                cpu_code = _CPU_CATS.get(low, OTHER_CPU)
                cpu_events += has_dur
                _note_first(self.cpu_keys, [e.name for e in has_dur], (seq, chunk))
                # Per category: a stray string id in one category keeps the others on the fast path.
                cpu_threads.append(self._threads(has_dur, rank, (rank, 0, seq), seq))
                cpu_kind += [cpu_code] * len(has_dur)
                cpu_seq += [seq] * len(has_dur)
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
                "cat": np.asarray(gpu_seq, dtype=np.int32),
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
                "cat": np.asarray(cpu_seq, dtype=np.int32),
            }
        )
        a_parts.append(
            {
                "name": _intern([e.name for e in ann_events], ann_names),
                "rank": np.full(len(ann_events), rank, dtype=np.int32),
                "thread": np.concatenate(ann_threads) if ann_threads else np.zeros(0, np.int32),
                "start": _to_ns([e.ts for e in ann_events], unit),
                "dur": _to_ns([e.dur for e in ann_events], unit),
                "gpu": np.asarray(ann_gpu, dtype=bool),
                "cat": np.asarray(ann_seq, dtype=np.int32),
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
        self.chunks += 1

    def finish(self, ranks: list[int], sources: list[str]) -> Trace:
        """Concatenate the parts, map file positions to ``ranks``, renumber names and threads as
        a one-pass read would, sort, and build the Trace."""
        rank_of = np.asarray(ranks, dtype=np.int32)
        devices = {(ranks[pos], dev): prop for (pos, dev), prop in self.devices.items()}
        skipped = {r: self.skipped[r] for r in sorted(self.skipped, key=self.skip_keys.get)}
        thread_keys = list(self.threads)
        thread_order: dict[int, None] = {}
        for group in sorted(self.thread_groups):
            fast, first = self.thread_groups[group]
            # A one-pass read numbers a group's threads in (pid, tid) order when all ids are small
            # ints, else in order of appearance.
            by = (lambda t: thread_keys[t][1:]) if fast else first.__getitem__
            thread_order.update(dict.fromkeys(sorted(first, key=by)))
        new_thread = np.empty(len(thread_keys), dtype=np.int32)
        new_thread[list(thread_order)] = np.arange(len(thread_order), dtype=np.int32)
        threads = [thread_keys[t] for t in thread_order]

        gpu_names, new_name = _renumbering(self.gpu_names, self.gpu_keys)
        g = _concat(self.g_parts, GPU_COLUMNS)
        self.g_parts = []
        g["name"] = new_name[g["name"]]
        g["rank"] = rank_of[g["rank"]]
        negative = g["dur"] < 0
        if negative.any():
            skipped["GPU op with negative dur"] = int(negative.sum())
            g = {k: v[~negative] for k, v in g.items()}
        g["end"] = g["start"] + g.pop("dur")
        keys = (g["start"], g["stream"], g["device"], g["rank"])
        order = np.lexsort(keys if _in_order(g["cat"]) else (g["cat"], *keys))
        for k in list(g):  # one column at a time: the unsorted one is freed at once
            g[k] = g[k][order]
        gpu = GpuOps(
            names=gpu_names,
            name_id=g["name"],
            kind=g["kind"],
            rank=g["rank"],
            device=g["device"],
            stream=g["stream"],
            start_ns=g["start"],
            end_ns=g["end"],
            correlation=g["corr"],
            blocks=g["blocks"],
        )
        del g
        cpu_names, new_name = _renumbering(self.cpu_names, self.cpu_keys)
        c = _concat(self.c_parts, CPU_COLUMNS)
        self.c_parts = []
        c["end"] = c["start"] + c.pop("dur")
        order = _by_start(c["start"], c.pop("cat"))
        for k in list(c):
            c[k] = c[k][order]
        cpu = CpuEvents(
            names=cpu_names,
            name_id=new_name[c["name"]],
            kind=c["kind"],
            rank=rank_of[c["rank"]],
            thread=new_thread[c["thread"]],
            start_ns=c["start"],
            end_ns=c["end"],
            correlation=c["corr"],
        )
        del c
        ann_names, new_name = _renumbering(self.ann_names, self.ann_keys)
        a = _concat(self.a_parts, ANN_COLUMNS)
        self.a_parts = []
        order = _by_start(a["start"], a["cat"])
        annotations = Annotations(
            names=ann_names,
            name_id=new_name[a["name"][order]],
            rank=rank_of[a["rank"][order]],
            thread=new_thread[a["thread"][order]],
            start_ns=a["start"][order],
            end_ns=(a["start"] + a["dur"])[order],
            on_gpu=a["gpu"][order],
        )
        f = _concat(self.f_parts, FLOW_COLUMNS)
        self.f_parts = []
        flows = Flows(
            flow_id=f["id"],
            is_start=f["start"],
            rank=rank_of[f["rank"]],
            ts_ns=f["ts"],
            category=list(self.flow_cats),
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


def _in_order(category: np.ndarray) -> bool:
    """Whether rows are already grouped as a one-pass read groups them (category order, ``[n]``)."""
    return bool(np.all(category[1:] >= category[:-1]))


def _by_start(start: np.ndarray, category: np.ndarray) -> np.ndarray:
    """Order by start; ties as in a one-pass read (by category order of appearance, then file order)."""
    if _in_order(category):
        return np.argsort(start, kind="stable")
    return np.lexsort((category, start))


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
    "cat": np.int32,
}
CPU_COLUMNS = {
    "name": np.int32,
    "kind": np.int8,
    "rank": np.int32,
    "thread": np.int32,
    "start": np.int64,
    "dur": np.int64,
    "corr": np.int64,
    "cat": np.int32,
}
ANN_COLUMNS = {
    "name": np.int32,
    "rank": np.int32,
    "thread": np.int32,
    "start": np.int64,
    "dur": np.int64,
    "gpu": bool,
    "cat": np.int32,
}
FLOW_COLUMNS = {"id": np.int64, "start": bool, "rank": np.int32, "ts": np.int64, "cat": np.int32}


def _concat(parts: list[dict[str, np.ndarray]], columns: dict[str, Any]) -> dict[str, np.ndarray]:
    """Each column of ``parts`` joined into one array; the parts' columns are emptied as it goes,
    so only one column is ever held twice."""
    if not parts:
        return {key: np.zeros(0, dtype=dtype) for key, dtype in columns.items()}
    return {
        key: np.concatenate([p.pop(key) for p in parts]).astype(dtype, copy=False)
        for key, dtype in columns.items()
    }
