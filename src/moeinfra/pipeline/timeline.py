"""Draw a simulated schedule: a timeline PNG (ranks as rows) and Chrome-trace JSON for Perfetto."""

from __future__ import annotations

import io
import json
from pathlib import Path

from moeinfra.atomicio import write_bytes_atomic, write_text_atomic
from moeinfra.pipeline.schedule import Schedule
from moeinfra.pipeline.simulate import SimResult

# (direction 0, direction 1) colours per kind; direction 1 is the darker shade.
COLORS = {
    "F": ("#f9cb9c", "#e69138"),
    "B": ("#b6d7a8", "#6aa84f"),
    "I": ("#b6d7a8", "#6aa84f"),
    "W": ("#9fc5e8", "#3d85c6"),
}


def direction(schedule: Schedule, stage: int) -> int:
    """0 for the direction entering at rank 0 (DualPipe's first path, DualPipeV's way down), else 1."""
    if len(schedule.paths) > 1:
        return schedule.path_of(stage)
    return int(schedule.model_stage(stage) >= schedule.num_ranks)


def render_timeline(
    result: SimResult, path: Path | str | None = None, *, title: str | None = None
) -> bytes:
    """Draw ``result`` like DeepSeek's DualPipe figure and return the PNG bytes (also written to ``path``).

    One row per rank; each action is a box from its start to its end, coloured by kind (F orange,
    B/I green, W blue; the second direction darker), labelled with its micro-batch. An overlapped
    ``F&B`` pair is split: forward on top, backward below. ``I`` boxes are hatched. The figure is
    :func:`timeline_figure`'s.
    """
    import matplotlib.pyplot as plt

    fig = timeline_figure(result, title=title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    data = buf.getvalue()
    if path is not None:
        write_bytes_atomic(Path(path), data)
    return data


def timeline_figure(result: SimResult, *, title: str | None = None):
    """The matplotlib Figure :func:`render_timeline` saves (one Axes, the legend below it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    schedule = result.schedule
    R = schedule.num_ranks
    span = max(result.makespan, 1e-9)
    width = min(max(8.0, span * 0.22), 40.0)
    fig, ax = plt.subplots(figsize=(width, 0.55 * R + 1.6), layout="constrained")
    unit = min(
        r.starts and min(e - s for s, e in zip(r.starts, r.ends, strict=True) if e > s) or span
        for r in result.per_rank
    )
    fontsize = max(4.0, min(9.0, 9.0 * unit * width / span / 0.35))

    def box(
        x: float, w: float, y: float, h: float, color: str, label: str, hatch: str | None = None
    ) -> None:
        ax.add_patch(
            Rectangle(
                (x, y), w, h, facecolor=color, edgecolor="#333333", linewidth=0.4, hatch=hatch
            )
        )
        if w > 0:
            ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=fontsize)

    for rr in result.per_rank:
        y = R - 1 - rr.rank
        for action, s, e in zip(rr.actions, rr.starts, rr.ends, strict=True):
            if action.kind == "FB":
                fcol = COLORS["F"][direction(schedule, action.stage)]
                bcol = COLORS["B"][direction(schedule, action.b_stage)]
                box(s, e - s, y + 0.5, 0.45, fcol, str(action.mb))
                box(s, e - s, y + 0.05, 0.45, bcol, str(action.b_mb))
            else:
                col = COLORS[action.kind][direction(schedule, action.stage)]
                box(
                    s,
                    e - s,
                    y + 0.05,
                    0.9,
                    col,
                    str(action.mb),
                    hatch="//" if action.kind == "I" else None,
                )
    ax.set_xlim(0, span)
    ax.set_ylim(0, R)
    ax.set_yticks([R - 1 - r + 0.5 for r in range(R)], [f"rank {r}" for r in range(R)])
    ax.set_xlabel("time (cost units)")
    ax.set_title(
        title
        or f"{schedule.name}: {R} ranks, {schedule.num_microbatches} micro-batches, makespan {result.makespan:g}"
    )
    handles = [
        Patch(facecolor=COLORS["F"][0], label="F (dir. 0)"),
        Patch(facecolor=COLORS["F"][1], label="F (dir. 1)"),
        Patch(facecolor=COLORS["B"][0], label="B (dir. 0)"),
        Patch(facecolor=COLORS["B"][1], label="B (dir. 1)"),
        Patch(facecolor="white", edgecolor="#333", hatch="//", label="I (input grad only)"),
        Patch(facecolor=COLORS["W"][0], label="W (dir. 0)"),
        Patch(facecolor=COLORS["W"][1], label="W (dir. 1)"),
        Patch(facecolor="white", edgecolor="#333", label="F&B: F top, B bottom"),
    ]
    # Below the axis label, with no band in between: the constrained layout makes room for it.
    fig.legend(handles=handles, loc="outside lower center", ncol=8, fontsize=8, frameon=False)
    return fig


def chrome_trace(result: SimResult, *, us_per_unit: float = 1000.0) -> dict:
    """Chrome-trace JSON (``{"traceEvents": [...]}``): one process per rank, one complete event per
    action; one cost unit becomes ``us_per_unit`` microseconds. Opens in Perfetto / chrome://tracing."""
    events: list[dict] = []
    schedule = result.schedule
    for rr in result.per_rank:
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": rr.rank,
                "tid": 0,
                "args": {"name": f"rank {rr.rank}"},
            }
        )
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": rr.rank,
                "tid": 0,
                "args": {"name": "compute"},
            }
        )
        for action, s, e in zip(rr.actions, rr.starts, rr.ends, strict=True):
            events.append(
                {
                    "name": str(action),
                    "cat": action.kind,
                    "ph": "X",
                    "pid": rr.rank,
                    "tid": 0,
                    "ts": s * us_per_unit,
                    "dur": (e - s) * us_per_unit,
                    "args": {
                        "kind": action.kind,
                        "stage": action.stage,
                        "microbatch": action.mb,
                        "direction": direction(schedule, action.stage),
                        **(
                            {"b_stage": action.b_stage, "b_microbatch": action.b_mb}
                            if action.kind == "FB"
                            else {}
                        ),
                    },
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"schedule": schedule.name, "makespan_units": result.makespan},
    }


def write_chrome_trace(result: SimResult, path: Path | str, *, us_per_unit: float = 1000.0) -> None:
    """Write :func:`chrome_trace` to ``path`` atomically."""
    write_text_atomic(Path(path), json.dumps(chrome_trace(result, us_per_unit=us_per_unit)))
