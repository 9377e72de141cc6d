"""Timeline PNG in the style of DeepSeek's overlap figures: one lane per GPU stream, compute and
communication in different colours, F / B / W phase bands on top and the exposed communication.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from moeinfra.atomicio import atomic_path
from moeinfra.trace import intervals
from moeinfra.trace.classify import COMM, COMPUTE, MEMORY
from moeinfra.trace.summary import TraceReport

CLASS_COLOURS = {COMPUTE: "#3b75af", COMM: "#ef8636", MEMORY: "#8c8c8c"}
PHASE_COLOURS = {"F": "#59a14f", "B": "#b07aa1", "W": "#9c755f"}
EXPOSED_COLOUR = "#d62728"
_LABEL_FONTSIZE = 6


def plot_timeline(
    result: TraceReport,
    out_path: str | Path,
    *,
    window_us: tuple[float, float] | None = None,
    max_devices: int = 4,
    title: str | None = None,
) -> Path:
    """Draw the timeline of ``result`` into the PNG ``out_path`` (written atomically); return the path.

    ``window_us`` = (start, end) in µs from the first GPU op of the trace zooms in; ``max_devices``
    limits how many (rank, device) pairs get lanes. The figure is :func:`timeline_figure`'s.
    """
    import matplotlib.pyplot as plt

    out_path = Path(out_path)
    fig = timeline_figure(result, window_us=window_us, max_devices=max_devices, title=title)
    try:
        with atomic_path(out_path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
    return out_path


def timeline_figure(
    result: TraceReport,
    *,
    window_us: tuple[float, float] | None = None,
    max_devices: int = 4,
    title: str | None = None,
):
    """The matplotlib Figure :func:`plot_timeline` saves: one Axes, lanes top to bottom as
    :func:`timeline_lanes` lists them, op names cut to fit their boxes, the legend below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    trace = result.trace
    gpu = trace.gpu
    origin = trace.start_ns or 0
    lanes, labels, shown = timeline_lanes(result, max_devices)
    attribution = result.attribution

    height = max(2.5, 0.45 * len(lanes) + 1.2)
    fig, ax = plt.subplots(figsize=(14, height))
    for y, (_, bars) in enumerate(reversed(lanes)):
        for starts, ends, colour in bars:
            if starts.size == 0:
                continue
            xs = (starts - origin) * 1e-3
            ws = np.maximum((ends - starts) * 1e-3, 0.0)
            ax.broken_barh(
                np.stack([xs, ws], axis=1), (y + 0.1, 0.8), facecolors=colour, edgecolor="none"
            )
    if window_us is None and len(gpu):
        window_us = (0.0, (int(gpu.end_ns.max()) - origin) * 1e-3)
    span_us = window_us[1] - window_us[0] if window_us is not None else 1.0
    # A name goes into its box only as far as it fits (cut with "…"), so names never run into
    # each other; the axes are at least this wide once laid out.
    points_per_us = ax.get_position().width * fig.get_figwidth() * 72.0 / max(span_us, 1e-9)
    char_pt = 0.62 * _LABEL_FONTSIZE  # mean advance of DejaVu Sans at this size, a little generous
    for lane, starts, ends, names in labels:
        y = len(lanes) - 1 - lane
        wide = (ends - starts) * 1e-3 >= 0.03 * span_us  # room for a name
        free_from = -np.inf  # ops overlapping in time (concurrent exchanges): name the first only
        for start, end, name in sorted(zip(starts[wide], ends[wide], names[wide], strict=True)):
            if start < free_from:
                continue
            free_from = end
            if window_us is not None:  # only the visible part of the box holds text
                start = max(start, origin + window_us[0] * 1e3)
                end = min(end, origin + window_us[1] * 1e3)
            text = _label(str(name), int((end - start) * 1e-3 * points_per_us / char_pt) - 1)
            if not text:
                continue
            ax.text(
                ((start + end) / 2 - origin) * 1e-3,
                y + 0.5,
                text,
                ha="center",
                va="center",
                fontsize=_LABEL_FONTSIZE,
                color="white",
                clip_on=True,
            )
    ax.set_yticks(np.arange(len(lanes)) + 0.5)
    ax.set_yticklabels([name for name, _ in reversed(lanes)])
    ax.set_ylim(0, max(len(lanes), 1))
    if window_us is not None:
        ax.set_xlim(*window_us)
    ax.set_xlabel("time since first GPU op (µs)")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_title(title or "GPU timeline: compute vs communication")
    drawn = {
        COMPUTE: ("compute", CLASS_COLOURS[COMPUTE]),
        COMM: ("communication", CLASS_COLOURS[COMM]),
        MEMORY: ("memory", CLASS_COLOURS[MEMORY]),
    }
    legend = [
        Patch(color=colour, label=label)
        for code, (label, colour) in drawn.items()
        if (shown == code).any()
    ]
    if any(name.endswith("exposed comm") for name, _ in lanes):
        legend.append(Patch(color=EXPOSED_COLOUR, label="exposed communication"))
    legend += [
        Patch(color=PHASE_COLOURS.get(p, "#bab0ac"), label=f"phase {p}") for p in attribution.phases
    ]
    ax.legend(
        handles=legend,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 if height < 5 else -0.06),
        ncol=len(legend),
        fontsize=8,
        frameon=False,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def _short(name: str) -> str:
    """A C++ kernel name without return type, template and argument lists and outer namespaces
    (``void dpsk::ep::internode::combine<...>(...)`` -> ``internode::combine``); other names as
    they are (``ATTN(mb1) L0``)."""
    if "::" not in name:
        return name
    bare = re.split(r"[<(]", name.removeprefix("void "), maxsplit=1)[0].strip()
    return "::".join(bare.split("::")[-2:]) or name


def _label(name: str, chars: int) -> str:
    """What of ``name`` fits in ``chars`` characters: its :func:`_short` form, else the function
    alone (``combine``), else that cut by :func:`_fit`."""
    short = _short(name)
    last = short.rsplit("::", 1)[-1]
    for candidate in (short, last):
        if len(candidate) <= chars:
            return candidate
    return _fit(last, chars)


def _fit(name: str, chars: int) -> str:
    """``name`` cut to ``chars`` characters ending in "…", or "" when fewer than 4 would show."""
    if len(name) <= chars:
        return name
    return name[: chars - 1] + "…" if chars >= 4 else ""


Lane = tuple[str, list[tuple[np.ndarray, np.ndarray, str]]]


def timeline_lanes(
    result: TraceReport, max_devices: int = 4
) -> tuple[list[Lane], list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], np.ndarray]:
    """The lanes :func:`plot_timeline` draws, top to bottom: ``(label, [(starts, ends, colour)])``;
    the op names to write on each stream lane ``(lane, starts, ends, names)``; and the classes of
    the ops drawn (for the legend)."""
    trace, classes, attribution = result.trace, result.classes, result.attribution
    gpu = trace.gpu
    slices = list(trace.device_slices().items())[:max_devices]
    several_ranks = len({rank for (rank, _), _ in slices}) > 1
    several_devices = len({device for (_, device), _ in slices}) > 1
    names = np.asarray(gpu.names, dtype=object)  # looked up for the drawn ops only
    lanes: list[Lane] = []
    labels: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
    for (rank, device), rows in slices:
        # name what tells the lanes apart (one file of several CPU ranks: one device per rank)
        prefix = (f"rank {rank} " if several_ranks or rank else "") + (
            f"device {device} " if several_devices else ""
        )
        s, e, c = gpu.start_ns[rows], gpu.end_ns[rows], classes[rows]
        phase = attribution.phase[rows]
        for i, name in enumerate(attribution.phases):
            sel = phase == i
            band = intervals.union(s[sel], e[sel])
            lanes.append(
                (f"{prefix}phase {name}", [(band[0], band[1], PHASE_COLOURS.get(name, "#bab0ac"))])
            )
        comp = intervals.union(s[c == COMPUTE], e[c == COMPUTE])
        comm = intervals.union(s[c == COMM], e[c == COMM])
        if comm[0].size:
            exposed = intervals.subtract(comm, comp)
            lanes.append((f"{prefix}exposed comm", [(exposed[0], exposed[1], EXPOSED_COLOUR)]))
        streams = gpu.stream[rows]
        for sid in np.unique(streams):
            sel = streams == sid
            bars = [
                (s[sel & (c == code)], e[sel & (c == code)], colour)
                for code, colour in CLASS_COLOURS.items()
            ]
            lanes.append((f"{prefix}stream {int(sid)}", bars))
            labels.append((len(lanes) - 1, s[sel], e[sel], names[gpu.name_id[rows][sel]]))

    shown = np.concatenate([classes[rows] for _, rows in slices]) if slices else classes[:0]
    return lanes, labels, shown
