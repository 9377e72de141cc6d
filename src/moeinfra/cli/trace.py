"""``moeinfra trace ...``: overlap report, kernel breakdown and diff of PyTorch Profiler traces.

Thin layer: parse options, call :mod:`moeinfra.trace`, print rich tables or JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from moeinfra.trace.attribution import DEFAULT_PHASE_PATTERN

app = typer.Typer(
    help="PyTorch-profiler trace analysis: how much communication is hidden behind computation.",
    no_args_is_help=True,
)

_COMM_HELP = "Extra communication regex, matched at the start of the kernel name (without 'void '); repeatable."
_UNIT_HELP = "Timestamp unit: auto, us or ns."


def _progress(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


def _parse_zoom(zoom: str | None) -> tuple[float, float] | None:
    if zoom is None:
        return None
    from moeinfra.errors import InputError

    try:
        lo, hi = (float(x) for x in zoom.split(":"))
    except ValueError:
        raise InputError(
            f"--zoom={zoom!r} must be START:END in µs from the trace start, e.g. 0:20000"
        ) from None
    if not hi > lo:
        raise InputError(f"--zoom={zoom!r} must have END > START")
    return lo, hi


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


@app.command()
def report(
    path: Annotated[
        Path, typer.Argument(help="Trace file (.json / .json.gz) or folder of per-rank traces.")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print the full result as JSON.")] = False,
    comm_pattern: Annotated[
        list[str] | None, typer.Option("--comm-pattern", help=_COMM_HELP)
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write a timeline PNG here.")
    ] = None,
    zoom: Annotated[
        str | None,
        typer.Option("--zoom", help="Timeline window START:END in µs from the first GPU op."),
    ] = None,
    time_unit: Annotated[str, typer.Option("--time-unit", help=_UNIT_HELP)] = "auto",
    phase_pattern: Annotated[
        str,
        typer.Option(
            "--phase-pattern",
            help="Regex naming the phase in an annotation name (group 'phase' or 1).",
        ),
    ] = DEFAULT_PHASE_PATTERN,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Per-device decomposition: compute, exposed communication, exposed memory, idle; phases and overlap."""
    from moeinfra.trace.summary import analyze

    window = _parse_zoom(zoom)
    result = analyze(
        path,
        comm_patterns=comm_pattern or (),
        phase_pattern=phase_pattern,
        time_unit=time_unit,  # type: ignore[arg-type]
        progress=_progress(quiet),
    )
    if output is not None:
        from moeinfra.trace.timeline import plot_timeline

        plot_timeline(result, output, window_us=window)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    _print_report(result, output)


def _print_report(result, output: Path | None) -> None:
    console = Console()
    doc = result.to_dict()
    if not doc["devices"]:
        console.print(f"no GPU ops in {', '.join(doc['sources'])}")
    if len(doc["devices"]) > 1:
        summary = Table(title="all devices (µs)")
        for col in (
            "rank",
            "GPU",
            "span",
            "compute",
            "exposed comm",
            "exposed memory",
            "idle",
            "comm hidden",
        ):
            summary.add_column(col, justify="right")
        for dev in doc["devices"]:
            hidden = dev["comm_hidden_fraction"]
            summary.add_row(
                str(dev["rank"]),
                str(dev["device"]),
                _fmt(dev["span_us"]),
                _fmt(dev["compute_us"]),
                _fmt(dev["exposed_comm_us"]),
                _fmt(dev["exposed_memory_us"]),
                _fmt(dev["idle_us"]),
                "-" if hidden is None else f"{100 * hidden:.1f}%",
            )
        console.print(summary)
    for dev in doc["devices"]:
        span = dev["span_us"] or 1.0
        table = Table(title=f"rank {dev['rank']} / GPU {dev['device']}: time decomposition (µs)")
        table.add_column("part")
        table.add_column("µs", justify="right")
        table.add_column("% of span", justify="right")
        for label, key in (
            ("compute", "compute_us"),
            ("exposed communication", "exposed_comm_us"),
            ("exposed memory", "exposed_memory_us"),
            ("idle", "idle_us"),
            ("= span", "span_us"),
            ("communication (all)", "comm_us"),
            ("  of it hidden (overlap)", "overlap_us"),
            ("memory (all)", "memory_us"),
        ):
            table.add_row(label, _fmt(dev[key]), _fmt(100 * dev[key] / span))
        hidden = dev["comm_hidden_fraction"]
        table.caption = "communication hidden: " + (
            "-" if hidden is None else f"{100 * hidden:.1f}%"
        )
        console.print(table)

        streams = Table(title="busy time per stream (µs)")
        streams.add_column("stream")
        streams.add_column("busy µs", justify="right")
        for sid, busy in dev["streams"].items():
            streams.add_row(sid, _fmt(busy))
        console.print(streams)

        if dev["sm_share"]:
            sm = Table(title=f"SM use per class ({dev['num_sms']} SMs, from args.grid)")
            for col in ("class", "share of SM-time", "mean SMs while running", "max SMs"):
                sm.add_column(col, justify="right" if col != "class" else "left")
            for cls, v in dev["sm_share"].items():
                sm.add_row(
                    cls, f"{100 * v['sm_share']:.1f}%", f"{v['mean_sms']:.1f}", str(v["max_sms"])
                )
            console.print(sm)

        if "phases" in dev:
            ph = Table(title="phases (union µs)")
            for col in ("phase", "compute", "comm", "memory", "ops"):
                ph.add_column(col, justify="right" if col != "phase" else "left")
            for name, v in dev["phases"].items():
                ph.add_row(
                    name,
                    _fmt(v["compute_us"]),
                    _fmt(v["comm_us"]),
                    _fmt(v["memory_us"]),
                    str(v["ops"]),
                )
            console.print(ph)
            names = list(dev["phase_overlap"])
            mat = Table(
                title="phase_overlap: comm of phase (row) hidden by compute of phase (column), µs"
            )
            mat.add_column("comm \\ compute")
            for n in names:
                mat.add_column(n, justify="right")
            for x in names:
                mat.add_row(x, *(_fmt(dev["phase_overlap"][x][y]) for y in names))
            console.print(mat)

        exposed = sorted(
            ((n, v) for n, v in dev["regions"].items() if v["comm_us"] > 0),
            key=lambda kv: -kv[1]["exposed_comm_us"],
        )
        if exposed:
            reg = Table(title="where communication is exposed (innermost annotation)")
            for col in ("annotation", "comm µs", "exposed µs", "exposed %"):
                reg.add_column(col, justify="right" if col != "annotation" else "left")
            for name, v in exposed[:10]:
                reg.add_row(
                    name,
                    _fmt(v["comm_us"]),
                    _fmt(v["exposed_comm_us"]),
                    _fmt(100 * v["exposed_comm_us"] / v["comm_us"]),
                )
            console.print(reg)
    if doc["skipped"]:
        console.print(
            "skipped events: " + ", ".join(f"{k}: {v}" for k, v in doc["skipped"].items())
        )
    if output is not None:
        console.print(f"timeline written to {output}")


@app.command()
def kernels(
    path: Annotated[Path, typer.Argument(help="Trace file or folder.")],
    top: Annotated[
        int, typer.Option("--top", "-n", min=1, help="Show the N kernels with the most total time.")
    ] = 20,
    by: Annotated[str, typer.Option("--by", help="Group by 'name', 'class' or 'kind'.")] = "name",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    comm_pattern: Annotated[
        list[str] | None, typer.Option("--comm-pattern", help=_COMM_HELP)
    ] = None,
    time_unit: Annotated[str, typer.Option("--time-unit", help=_UNIT_HELP)] = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Kernel breakdown: count, total, mean, min, max, std and exposed time per kernel name or class."""
    from moeinfra.trace.classify import Classifier
    from moeinfra.trace.kernels import display_name, kernel_breakdown
    from moeinfra.trace.reader import read_trace
    from moeinfra.trace.summary import build_rules

    trace = read_trace(path, time_unit=time_unit, progress=_progress(quiet))  # type: ignore[arg-type]
    classes = Classifier(build_rules(comm_pattern or ())).classify(trace.gpu)
    stats = kernel_breakdown(trace, classes, by=by)
    if as_json:
        typer.echo(
            json.dumps(
                {"kernels": [s.to_dict() for s in stats[:top]], "total_groups": len(stats)},
                indent=2,
            )
        )
        return
    table = Table(title=f"GPU time per {by} (top {min(top, len(stats))} of {len(stats)})")
    for col in (
        "name",
        "class",
        "count",
        "total µs",
        "share",
        "mean",
        "min",
        "max",
        "std",
        "exposed µs",
    ):
        table.add_column(
            col,
            justify="left" if col in ("name", "class") else "right",
            overflow="fold" if col == "name" else "ellipsis",
        )
    for s in stats[:top]:
        name = display_name(s.name, 90)
        table.add_row(
            name,
            s.op_class,
            str(s.count),
            _fmt(s.total_us),
            f"{100 * s.share:.1f}%",
            _fmt(s.mean_us),
            _fmt(s.min_us),
            _fmt(s.max_us),
            _fmt(s.std_us),
            _fmt(s.exposed_us),
        )
    Console().print(table)


@app.command()
def diff(
    a: Annotated[Path, typer.Argument(help="Baseline trace (file or folder).")],
    b: Annotated[Path, typer.Argument(help="New trace (file or folder).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    top: Annotated[int, typer.Option("--top", "-n", min=1, help="Kernels to list.")] = 15,
    comm_pattern: Annotated[
        list[str] | None, typer.Option("--comm-pattern", help=_COMM_HELP)
    ] = None,
    time_unit: Annotated[str, typer.Option("--time-unit", help=_UNIT_HELP)] = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Two traces side by side: what got slower, what became exposed (B − A)."""
    from moeinfra.trace.diff import diff_reports
    from moeinfra.trace.kernels import display_name
    from moeinfra.trace.summary import analyze

    ra = analyze(
        a, comm_patterns=comm_pattern or (), time_unit=time_unit, progress=_progress(quiet)
    )  # type: ignore[arg-type]
    rb = analyze(
        b, comm_patterns=comm_pattern or (), time_unit=time_unit, progress=_progress(quiet)
    )  # type: ignore[arg-type]
    result = diff_reports(ra, rb, top=top)
    if as_json:
        typer.echo(json.dumps({"a": str(a), "b": str(b), **result.to_dict()}, indent=2))
        return
    console = Console()
    for dev in result.devices:
        table = Table(title=f"rank {dev['rank']} / GPU {dev['device']}: A = {a.name}, B = {b.name}")
        for col in ("metric", "A", "B", "B − A"):
            table.add_column(col, justify="left" if col == "metric" else "right")
        for m, v in dev["metrics"].items():
            digits = 3 if m == "comm_hidden_fraction" else 1
            table.add_row(m, _fmt(v["a"], digits), _fmt(v["b"], digits), _fmt(v["delta"], digits))
        console.print(table)
    table = Table(title="kernels with the largest change in total time (µs)")
    for col in (
        "name",
        "class",
        "A total",
        "B total",
        "Δ total",
        "A exposed",
        "B exposed",
        "Δ exposed",
    ):
        table.add_column(col, justify="left" if col in ("name", "class") else "right")
    for k in result.kernels:
        name = display_name(k["name"], 70)
        table.add_row(
            name,
            k["op_class"],
            _fmt(k["a_total_us"]),
            _fmt(k["b_total_us"]),
            _fmt(k["delta_total_us"]),
            _fmt(k["a_exposed_us"]),
            _fmt(k["b_exposed_us"]),
            _fmt(k["delta_exposed_us"]),
        )
    console.print(table)
