"""How much communication is hidden behind computation: the per-device time decomposition.

Definitions (per device; all intervals half-open ``[start, end)``; ``|X|`` is the length of the
union of the intervals in X; C, K, M = the compute, communication and memory ops of the device):

- ``span``   = last op end − first op start on the device
- ``busy``   = |C ∪ K ∪ M|, ``idle`` = span − busy
- ``compute`` = |C|, ``comm`` = |K|, ``memory`` = |M|
- ``overlap`` = |K ∩ C| (communication running while some compute runs)
- ``exposed_comm`` = |K \\ C|, ``exposed_memory`` = |M \\ (C ∪ K)|
- ``comm_hidden_fraction`` = overlap / comm (None without communication)

so that ``compute + exposed_comm + exposed_memory + idle = span`` exactly (in ns). The SM view
weights each kernel by the SMs it can occupy, ``min(blocks, numSms)`` (``blocks`` = product of
``args.grid``; ``numSms`` from ``deviceProperties``): ``sm_share`` = Σ dur·sms / (numSms·span), the
fraction of the device's SM-time the class held; ``mean_sms`` = Σ dur·sms / Σ dur.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeinfra.trace import intervals
from moeinfra.trace.classify import CLASS_NAMES, COMM, COMPUTE, MEMORY
from moeinfra.trace.model import KERNEL, Trace


@dataclass(frozen=True)
class SmUse:
    """SM usage of one op class on one device (kernels with a known grid only)."""

    sm_share: float
    mean_sms: float
    max_sms: int


@dataclass(frozen=True)
class Decomposition:
    """Time decomposition of one device, in ns (see the module docstring for the definitions)."""

    rank: int
    device: int
    start_ns: int
    end_ns: int
    busy_ns: int
    compute_ns: int
    comm_ns: int
    memory_ns: int
    overlap_ns: int
    exposed_comm_ns: int
    exposed_memory_ns: int
    stream_busy_ns: dict[int, int]
    num_sms: int | None
    sm: dict[str, SmUse] | None

    @property
    def span_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def idle_ns(self) -> int:
        return self.span_ns - self.busy_ns

    @property
    def comm_hidden_fraction(self) -> float | None:
        return self.overlap_ns / self.comm_ns if self.comm_ns else None

    def to_dict(self) -> dict:
        """JSON-ready dict, times in µs (floats)."""
        us = 1e-3
        return {
            "rank": self.rank,
            "device": self.device,
            "span_us": self.span_ns * us,
            "busy_us": self.busy_ns * us,
            "idle_us": self.idle_ns * us,
            "compute_us": self.compute_ns * us,
            "comm_us": self.comm_ns * us,
            "memory_us": self.memory_ns * us,
            "overlap_us": self.overlap_ns * us,
            "exposed_comm_us": self.exposed_comm_ns * us,
            "exposed_memory_us": self.exposed_memory_ns * us,
            "comm_hidden_fraction": self.comm_hidden_fraction,
            "streams": {str(k): v * us for k, v in self.stream_busy_ns.items()},
            "num_sms": self.num_sms,
            "sm_share": None
            if self.sm is None
            else {
                k: {"sm_share": v.sm_share, "mean_sms": v.mean_sms, "max_sms": v.max_sms}
                for k, v in self.sm.items()
            },
        }


def class_sets(trace: Trace, classes: np.ndarray, rows: slice) -> dict[int, intervals.IntervalSet]:
    """Union interval set per class code (COMPUTE / COMM / MEMORY) for the GPU op rows ``rows``."""
    s, e, c = trace.gpu.start_ns[rows], trace.gpu.end_ns[rows], classes[rows]
    return {code: intervals.union(s[c == code], e[c == code]) for code in (COMPUTE, COMM, MEMORY)}


def decompose(trace: Trace, classes: np.ndarray) -> list[Decomposition]:
    """Decomposition of every device of ``trace`` (``classes``: int8 ``[n_ops]`` from the classifier)."""
    out = []
    for (rank, device), rows in trace.device_slices().items():
        out.append(decompose_device(trace, classes, rank, device, rows))
    return out


def decompose_device(
    trace: Trace, classes: np.ndarray, rank: int, device: int, rows: slice
) -> Decomposition:
    """Decomposition of one device whose GPU ops are the rows ``rows`` of ``trace.gpu``."""
    gpu = trace.gpu
    sets = class_sets(trace, classes, rows)
    c, k, m = sets[COMPUTE], sets[COMM], sets[MEMORY]
    ck = intervals.union_sets(c, k)
    ckm = intervals.union_sets(ck, m)
    len_c, len_k, len_ck = intervals.length(c), intervals.length(k), intervals.length(ck)
    busy = intervals.length(ckm)
    streams = gpu.stream[rows]
    stream_busy = {}
    # Rows are sorted by stream within a device, so each stream is one contiguous block.
    cuts = np.flatnonzero(np.diff(streams)) + 1
    for lo, hi in zip(
        np.concatenate([[0], cuts]), np.concatenate([cuts, [streams.size]]), strict=True
    ):
        sub = slice(rows.start + int(lo), rows.start + int(hi))
        stream_busy[int(streams[lo])] = intervals.length(
            intervals.union(gpu.start_ns[sub], gpu.end_ns[sub])
        )
    start = int(gpu.start_ns[rows].min())
    end = int(gpu.end_ns[rows].max())
    props = trace.devices.get((rank, device))
    num_sms = props.num_sms if props is not None else None
    return Decomposition(
        rank=rank,
        device=device,
        start_ns=start,
        end_ns=end,
        busy_ns=busy,
        compute_ns=len_c,
        comm_ns=len_k,
        memory_ns=intervals.length(m),
        overlap_ns=len_c + len_k - len_ck,
        exposed_comm_ns=len_ck - len_c,
        exposed_memory_ns=busy - len_ck,
        stream_busy_ns=stream_busy,
        num_sms=num_sms,
        sm=_sm_use(trace, classes, rows, num_sms, end - start),
    )


def _sm_use(
    trace: Trace, classes: np.ndarray, rows: slice, num_sms: int | None, span_ns: int
) -> dict[str, SmUse] | None:
    if not num_sms or span_ns <= 0:
        return None
    gpu = trace.gpu
    blocks = gpu.blocks[rows]
    known = (gpu.kind[rows] == KERNEL) & (blocks > 0)
    sms = np.minimum(blocks, num_sms)
    dur = gpu.dur_ns[rows]
    out = {}
    for code, name in enumerate(CLASS_NAMES):
        sel = known & (classes[rows] == code)
        if not sel.any():
            continue
        weighted = float((dur[sel] * sms[sel]).sum())
        total = float(dur[sel].sum())
        out[name] = SmUse(
            sm_share=weighted / (num_sms * span_ns),
            mean_sms=weighted / total if total else float(sms[sel].mean()),
            max_sms=int(sms[sel].max()),
        )
    return out
