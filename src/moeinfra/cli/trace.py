"""``moeinfra trace ...``: overlap report, kernel breakdown, diff, steps, idle time, launches and
queue length of PyTorch Profiler traces.

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

from moeinfra.numfmt import format_number, percent
from moeinfra.trace.attribution import DEFAULT_PHASE_PATTERN

app = typer.Typer(
    help="PyTorch-profiler trace analysis: how much communication is hidden behind computation.",
    no_args_is_help=True,
)

_COMM_HELP = "Extra communication regex, matched at the start of the kernel name (without 'void '); repeatable."
_UNIT_HELP = "Timestamp unit: auto, us or ns."
_STEP_HELP = "Analyse only iteration ProfilerStep#N (see `moeinfra trace steps`)."
_KERNEL_WAIT_HELP = (
    "Idle gaps shorter than this (µs) without a late launch are kernel wait (HTA: 30)."
)


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


def _fmt(value: float | None) -> str:
    return "-" if value is None else format_number(value)


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else percent(fraction)


def _us_to_ns(name: str, value_us: float) -> int:
    from moeinfra.errors import InputError

    if not value_us >= 0:  # also rejects NaN
        raise InputError(f"{name}={value_us} must be a number of µs >= 0")
    return round(value_us * 1000)


def _load(path: Path, time_unit: str, quiet: bool, step: int | None):
    """Read a trace (file or folder) and, with ``step``, keep only that ProfilerStep."""
    from moeinfra.trace.iterations import select_step
    from moeinfra.trace.reader import read_trace

    trace = read_trace(path, time_unit=time_unit, progress=_progress(quiet))  # type: ignore[arg-type]
    return trace if step is None else select_step(trace, step)


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
    step: Annotated[int | None, typer.Option("--step", help=_STEP_HELP)] = None,
    kernel_wait_us: Annotated[
        float, typer.Option("--kernel-wait-us", help=_KERNEL_WAIT_HELP)
    ] = 30.0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Per-device decomposition: compute, exposed communication, exposed memory, idle (host wait /
    kernel wait / other); phases and overlap."""
    from moeinfra.trace.summary import analyze

    window = _parse_zoom(zoom)
    result = analyze(
        path,
        comm_patterns=comm_pattern or (),
        phase_pattern=phase_pattern,
        time_unit=time_unit,  # type: ignore[arg-type]
        progress=_progress(quiet),
        step=step,
        kernel_wait_ns=_us_to_ns("--kernel-wait-us", kernel_wait_us),
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
                _pct(hidden),
            )
        console.print(summary)
    where = f"step {doc['step']}, " if doc["step"] is not None else ""
    for dev in doc["devices"]:
        span = dev["span_us"] or 1.0
        table = Table(
            title=f"{where}rank {dev['rank']} / GPU {dev['device']}: time decomposition (µs)"
        )
        table.add_column("part")
        table.add_column("µs", justify="right")
        table.add_column("% of span", justify="right")
        idle = dev.get("idle_breakdown") or {}
        for label, value in (
            ("compute", dev["compute_us"]),
            ("exposed communication", dev["exposed_comm_us"]),
            ("exposed memory", dev["exposed_memory_us"]),
            ("idle", dev["idle_us"]),
            ("  host wait", idle.get("host_wait_us")),
            ("  kernel wait", idle.get("kernel_wait_us")),
            ("  other", idle.get("other_us")),
            ("= span", dev["span_us"]),
            ("communication (all)", dev["comm_us"]),
            ("  of it hidden (overlap)", dev["overlap_us"]),
            ("memory (all)", dev["memory_us"]),
        ):
            if value is None:
                continue
            table.add_row(label, _fmt(value), _fmt(100 * value / span))
        hidden = dev["comm_hidden_fraction"]
        table.caption = f"communication hidden: {_pct(hidden)}"
        console.print(table)

        streams = Table(title="busy time per stream (µs)")
        streams.add_column("stream")
        streams.add_column("busy µs", justify="right")
        for sid, busy in dev["streams"].items():
            streams.add_row(sid, _fmt(busy))
        console.print(streams)

        if dev["sm_share"]:
            sm = Table(title=f"SM use per class ({_fmt(dev['num_sms'])} SMs, from args.grid)")
            for col in ("class", "share of SM-time", "mean SMs while running", "max SMs"):
                sm.add_column(col, justify="right" if col != "class" else "left")
            for cls, v in dev["sm_share"].items():
                sm.add_row(cls, percent(v["sm_share"]), _fmt(v["mean_sms"]), _fmt(v["max_sms"]))
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
                    _fmt(v["ops"]),
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
    if doc["steps"] and doc["step"] is None:
        numbers = sorted({s["step"] for s in doc["steps"]})
        shown = ", ".join(str(n) for n in numbers[:8]) + (", ..." if len(numbers) > 8 else "")
        console.print(
            f"iterations (ProfilerStep#N): {shown}; pick one with --step N, "
            "compare them with `moeinfra trace steps`"
        )
    if doc["skipped"]:
        console.print(
            "skipped events: " + ", ".join(f"{k}: {_fmt(v)}" for k, v in doc["skipped"].items())
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
    step: Annotated[int | None, typer.Option("--step", help=_STEP_HELP)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Kernel breakdown: count, total, mean, min, max, std and exposed time per kernel name or class."""
    from moeinfra.trace.classify import Classifier
    from moeinfra.trace.kernels import display_name, kernel_breakdown
    from moeinfra.trace.summary import build_rules

    trace = _load(path, time_unit, quiet, step)
    classes = Classifier(build_rules(comm_pattern or ())).classify(trace.gpu)
    stats = kernel_breakdown(trace, classes, by=by)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "step": step,
                    "kernels": [s.to_dict() for s in stats[:top]],
                    "total_groups": len(stats),
                },
                indent=2,
            )
        )
        return
    table = Table(
        title=f"GPU time per {by} (top {_fmt(min(top, len(stats)))} of {_fmt(len(stats))})"
    )
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
            _fmt(s.count),
            _fmt(s.total_us),
            percent(s.share),
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
            table.add_row(m, _fmt(v["a"]), _fmt(v["b"]), _fmt(v["delta"]))
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


@app.command()
def steps(
    path: Annotated[Path, typer.Argument(help="Trace file or folder.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    comm_pattern: Annotated[
        list[str] | None, typer.Option("--comm-pattern", help=_COMM_HELP)
    ] = None,
    kernel_wait_us: Annotated[
        float, typer.Option("--kernel-wait-us", help=_KERNEL_WAIT_HELP)
    ] = 30.0,
    time_unit: Annotated[str, typer.Option("--time-unit", help=_UNIT_HELP)] = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Iterations (ProfilerStep#N) per rank: CPU window, GPU ops launched, and their decomposition."""
    from moeinfra.trace.summary import step_breakdown

    trace = _load(path, time_unit, quiet, None)
    rows = step_breakdown(
        trace,
        comm_patterns=comm_pattern or (),
        kernel_wait_ns=_us_to_ns("--kernel-wait-us", kernel_wait_us),
    )
    if as_json:
        typer.echo(json.dumps({"steps": rows}, indent=2))
        return
    console = Console()
    if not rows:
        console.print(
            f"no ProfilerStep#N annotations in {', '.join(trace.sources)} "
            "(torch.profiler writes one per prof.step())"
        )
        return
    table = Table(title="iterations (µs; GPU columns over the ops each step launched)")
    several = len({(r["rank"], r["device"]) for r in rows}) > len({r["rank"] for r in rows})
    columns = ["rank", "step", "CPU dur", "GPU ops", "GPU span", "compute", "exposed comm"]
    columns += ["idle", "host wait", "comm hidden"]
    if several:
        columns.insert(2, "GPU")
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        hidden = r.get("comm_hidden_fraction")
        cells = [
            str(r["rank"]),
            f"{r['step']}{' (last)' if r['last'] else ''}",
            _fmt(r["dur_us"]),
            _fmt(r["gpu_ops"]),
            _fmt(r.get("span_us")),
            _fmt(r.get("compute_us")),
            _fmt(r.get("exposed_comm_us")),
            _fmt(r.get("idle_us")),
            _fmt(r.get("host_wait_us")),
            _pct(hidden),
        ]
        if several:
            cells.insert(2, "-" if r["device"] is None else str(r["device"]))
        table.add_row(*cells)
    console.print(table)
    console.print(
        "GPU ops belong to the step whose window holds their launch call. With several steps, "
        "HTA leaves out the last one by default (often cut short when the profiler stops)."
    )


@app.command()
def idle(
    path: Annotated[Path, typer.Argument(help="Trace file or folder.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    step: Annotated[int | None, typer.Option("--step", help=_STEP_HELP)] = None,
    kernel_wait_us: Annotated[
        float, typer.Option("--kernel-wait-us", help=_KERNEL_WAIT_HELP)
    ] = 30.0,
    time_unit: Annotated[str, typer.Option("--time-unit", help=_UNIT_HELP)] = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Idle time per device and per stream: host wait, kernel wait, other (HTA's breakdown)."""
    from moeinfra.trace.idle import IDLE_CATEGORIES, idle_breakdown

    threshold_ns = _us_to_ns("--kernel-wait-us", kernel_wait_us)
    trace = _load(path, time_unit, quiet, step)
    devices, streams = idle_breakdown(trace, threshold_ns)
    if as_json:
        doc = {
            "step": step,
            "kernel_wait_threshold_us": threshold_ns * 1e-3,
            "devices": [d.to_dict() for d in devices],
            "streams": [s.to_dict() for s in streams],
        }
        typer.echo(json.dumps(doc, indent=2))
        return
    console = Console()
    if not devices:
        console.print(f"no GPU ops in {', '.join(trace.sources)}")
        return
    where = f"step {step}: " if step is not None else ""
    for title, rows in (("device (all streams)", devices), ("stream", streams)):
        table = Table(
            title=f"{where}idle time per {title} (µs; kernel wait = gap < {_fmt(kernel_wait_us)} µs)"
        )
        for col in ("rank", "GPU", "stream", "ops", "span", "idle", *IDLE_CATEGORIES, "h/k/o %"):
            table.add_column(col.replace("_", " "), justify="right")
        for r in rows:
            total = r.total_idle_ns
            shares = "/".join(_fmt(100 * x / total) if total else "-" for x in r.idle_ns)
            table.add_row(
                str(r.rank),
                str(r.device),
                "all" if r.stream is None else str(r.stream),
                _fmt(r.ops),
                _fmt(r.span_ns * 1e-3),
                _fmt(total * 1e-3),
                *(_fmt(x * 1e-3) for x in r.idle_ns),
                shares,
            )
        console.print(table)
    console.print(
        "host wait: the op's launch call started after the GPU went idle; kernel wait: a short gap "
        "between back-to-back launches; other: e.g. waiting on another stream."
    )


@app.command()
def launches(
    path: Annotated[Path, typer.Argument(help="Trace file or folder.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    step: Annotated[int | None, typer.Option("--step", help=_STEP_HELP)] = None,
    runtime_cutoff_us: Annotated[
        float,
        typer.Option(
            "--runtime-cutoff-us", help="Launch calls longer than this are outliers (HTA: 50)."
        ),
    ] = 50.0,
    launch_delay_cutoff_us: Annotated[
        float,
        typer.Option(
            "--launch-delay-cutoff-us",
            help="Launch delays longer than this are outliers (HTA: 100).",
        ),
    ] = 100.0,
    top: Annotated[int, typer.Option("--top", "-n", min=0, help="Names and launches to list.")] = 5,
    time_unit: Annotated[str, typer.Option("--time-unit", help=_UNIT_HELP)] = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Kernel-launch statistics per rank: launch-call time, launch delay, short kernels, outliers."""
    from moeinfra.trace.kernels import display_name
    from moeinfra.trace.launches import launch_stats

    runtime_ns = _us_to_ns("--runtime-cutoff-us", runtime_cutoff_us)
    delay_ns = _us_to_ns("--launch-delay-cutoff-us", launch_delay_cutoff_us)
    trace = _load(path, time_unit, quiet, step)
    stats = launch_stats(trace, runtime_ns, delay_ns, top=top)
    if as_json:
        typer.echo(json.dumps({"step": step, "ranks": [s.to_dict() for s in stats]}, indent=2))
        return
    console = Console()
    if not stats:
        console.print(f"no GPU ops in {', '.join(trace.sources)}")
        return
    where = f"step {step}: " if step is not None else ""
    for s in stats:
        d = s.to_dict()
        table = Table(
            title=f"{where}rank {s.rank}: {_fmt(s.launches)} of {_fmt(s.gpu_ops)} GPU ops joined "
            "to a launch call (µs)"
        )
        for col in ("", "mean", "p50", "p95", "max"):
            table.add_column(col, justify="left" if not col else "right")
        for label, key in (
            ("launch call (CPU)", "cpu_duration"),
            ("GPU op", "gpu_duration"),
            ("launch delay", "launch_delay"),
        ):
            v = d[key]
            table.add_row(
                label, _fmt(v["mean_us"]), _fmt(v["p50_us"]), _fmt(v["p95_us"]), _fmt(v["max_us"])
            )
        console.print(table)
        console.print(
            "short kernels (GPU op shorter than its launch call, "
            f"call <= {_fmt(runtime_cutoff_us)} µs): "
            f"{_fmt(s.short_kernels)} ({_fmt(d['short_kernel_gpu_us'])} µs of GPU time); "
            f"launch calls > {_fmt(runtime_cutoff_us)} µs: {_fmt(s.runtime_outliers)}; "
            f"launch delay > {_fmt(launch_delay_cutoff_us)} µs: {_fmt(s.launch_delay_outliers)}"
            + (f"; negative delays clipped to 0: {_fmt(s.clipped)}" if s.clipped else "")
        )
        if s.short_by_name and top:
            names = Table(title="most frequent short kernels")
            for col in ("name", "count", "GPU µs"):
                names.add_column(col, justify="left" if col == "name" else "right")
            for n, c, g in s.short_by_name:
                names.add_row(display_name(n, 70), _fmt(c), _fmt(g * 1e-3))
            console.print(names)
        if s.worst and top:
            worst = Table(title="longest launch delays (op start from the first GPU op)")
            for col in ("name", "stream", "op start", "delay", "call", "op"):
                worst.add_column(col, justify="left" if col == "name" else "right")
            for w in s.worst:
                worst.add_row(
                    display_name(w["name"], 60),
                    str(w["stream"]),
                    _fmt(w["op_start_us"]),
                    _fmt(w["launch_delay_us"]),
                    _fmt(w["cpu_duration_us"]),
                    _fmt(w["gpu_duration_us"]),
                )
            console.print(worst)


@app.command()
def queue(
    path: Annotated[Path, typer.Argument(help="Trace file or folder.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    step: Annotated[int | None, typer.Option("--step", help=_STEP_HELP)] = None,
    until: Annotated[
        str,
        typer.Option(
            "--until",
            help="An op leaves the queue at its 'start' (HTA: launched, not yet running) or 'end'.",
        ),
    ] = "start",
    max_queue_length: Annotated[
        int,
        typer.Option(
            "--max-queue-length",
            min=1,
            help="Report the time at or above this length (CUDA: 1024).",
        ),
    ] = 1024,
    series: Annotated[
        bool, typer.Option("--series", help="With --json: include every change (t_us, length).")
    ] = False,
    time_unit: Annotated[str, typer.Option("--time-unit", help=_UNIT_HELP)] = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Queue length per stream: launched GPU ops not yet started (or finished), over time."""
    from moeinfra.trace.queue import queue_series, summarize_series

    trace = _load(path, time_unit, quiet, step)
    all_series = queue_series(trace, until)  # type: ignore[arg-type]
    summaries = [summarize_series(s, max_queue_length) for s in all_series]
    if as_json:
        origin = trace.start_ns or 0
        doc: dict = {"step": step, "until": until, "streams": [q.to_dict() for q in summaries]}
        if series:
            for entry, s in zip(doc["streams"], all_series, strict=True):
                entry["series"] = {
                    "t_us": ((s.ts_ns - origin) * 1e-3).tolist(),
                    "length": s.length.tolist(),
                }
        typer.echo(json.dumps(doc, indent=2))
        return
    console = Console()
    if not summaries:
        console.print(f"no GPU ops joined to a launch call in {', '.join(trace.sources)}")
        return
    where = f"step {step}: " if step is not None else ""
    table = Table(
        title=f"{where}queue length per stream (ops launched, not yet {'started' if until == 'start' else 'finished'})"
    )
    for col in (
        "rank",
        "GPU",
        "stream",
        "changes",
        "mean",
        "p50",
        "p75",
        "max",
        "time-weighted mean",
        f"µs at >= {_fmt(max_queue_length)}",
    ):
        table.add_column(col, justify="right")
    for q in summaries:
        table.add_row(
            str(q.rank),
            str(q.device),
            str(q.stream),
            _fmt(q.changes),
            _fmt(q.mean),
            _fmt(q.p50),
            _fmt(q.p75),
            _fmt(q.max),
            _fmt(q.time_mean),
            _fmt(q.time_at_max_ns * 1e-3),
        )
    console.print(table)
