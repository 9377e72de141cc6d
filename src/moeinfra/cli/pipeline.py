"""``moeinfra pipeline ...``: simulate one schedule, or compare all of them for given costs."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from moeinfra.numfmt import format_number

app = typer.Typer(
    help="Pipeline schedules (GPipe, 1F1B, ZB1P, DualPipe, DualPipeV): simulate, compare.",
    no_args_is_help=True,
)

_SCHEDULES = "gpipe, 1f1b, zb1p, dualpipe, dualpipev"


@app.command()
def simulate(
    schedule: str = typer.Option(..., "--schedule", "-s", help=f"One of {_SCHEDULES}."),
    ranks: int = typer.Option(
        ..., "--ranks", "-r", help="Devices (PP for DualPipe, PP/2 for DualPipeV)."
    ),
    microbatches: int = typer.Option(
        ..., "--microbatches", "-m", help="Total micro-batches (DualPipe: half per direction)."
    ),
    costs: str = typer.Option(
        "F=1,B=2,W=1", "--costs", help="Per-stage costs F=..,B=..,W=..,FB=..[,latency=..]."
    ),
    comm: str = typer.Option(
        "dataflow", "--comm", help="dataflow (sends never block) or rendezvous."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Write the timeline PNG here."),
    trace: Path | None = typer.Option(
        None, "--trace", help="Write Chrome-trace JSON here (open in Perfetto)."
    ),
    save: Path | None = typer.Option(
        None, "--save", help="Write the schedule itself as JSON (reload with Schedule.load)."
    ),
) -> None:
    """Generate a schedule, validate it, simulate it and print per-rank busy / idle / memory."""
    from moeinfra.pipeline import Costs, generate, validate
    from moeinfra.pipeline import simulate as run

    sched = generate(schedule, ranks, microbatches)
    validate(sched)
    if save is not None:
        sched.save(save)
    result = run(sched, Costs.parse(costs), comm=comm)
    if out is not None:
        from moeinfra.pipeline.timeline import render_timeline

        render_timeline(result, out)
    if trace is not None:
        from moeinfra.pipeline.timeline import write_chrome_trace

        write_chrome_trace(result, trace)
    if as_json:
        data = result.to_dict()
        for r in data["per_rank"]:
            del r["starts"], r["ends"]
        typer.echo(json.dumps(data))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{sched.name}: {format_number(sched.num_ranks)} ranks, "
        f"{format_number(sched.num_stages)} stages, "
        f"{format_number(sched.num_microbatches)} micro-batches, {comm}"
    )
    for col in ("rank", "busy", "idle", "peak act.", "deferred W", "stages held"):
        table.add_column(col, justify="right")
    for r in result.per_rank:
        table.add_row(
            str(r.rank),
            format_number(r.busy),
            format_number(r.idle),
            format_number(r.peak_activations),
            format_number(r.peak_deferred_w),
            format_number(r.params),
        )
    console = Console(width=max(Console().width, 110))
    console.print(table)
    console.print(f"makespan {format_number(result.makespan)}")


@app.command("validate")
def validate_file(
    path: Path = typer.Argument(..., help="Schedule JSON (as written by --save or Schedule.save)."),
) -> None:
    """Check a schedule file: complete, consistent, deadlock-free; exit 2 naming the first bad action."""
    from moeinfra.pipeline import Schedule, validate

    sched = Schedule.load(path)
    validate(sched)
    typer.echo(
        f"ok: {sched.name}, {format_number(sched.num_ranks)} ranks, "
        f"{format_number(sched.num_stages)} stages, "
        f"{format_number(sched.num_microbatches)} micro-batches"
    )


@app.command()
def compare(
    ranks: int = typer.Option(8, "--ranks", "-r", help="Devices."),
    microbatches: int = typer.Option(32, "--microbatches", "-m", help="Total micro-batches."),
    costs: str = typer.Option(
        "F=1,B=2,W=1",
        "--costs",
        help="Costs per stage of a ranks-stage split: F=..,B=..,W=..,FB=..",
    ),
    comm: str = typer.Option("dataflow", "--comm", help="dataflow or rendezvous."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Simulate every schedule on the same devices and model; print the table and the fastest."""
    from moeinfra.pipeline import Costs
    from moeinfra.pipeline import compare as run

    candidates, best = run(ranks, microbatches, Costs.parse(costs), comm=comm)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "ranks": ranks,
                    "microbatches": microbatches,
                    "best": best,
                    "schedules": [c.to_dict() for c in candidates],
                }
            )
        )
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{format_number(ranks)} devices, {format_number(microbatches)} micro-batches, "
        f"costs {costs} ({comm})"
    )
    for col in (
        "schedule",
        "stages",
        "makespan",
        "max idle",
        "bubble %",
        "act. memory",
        "param memory",
    ):
        table.add_column(col, justify="right")
    for c in candidates:
        d = c.to_dict()
        if not d["feasible"]:
            table.add_row(c.schedule, "-", "-", "-", "-", "-", "-", end_section=False)
            continue
        mark = "*" if c.schedule == best else ""
        table.add_row(
            c.schedule + mark,
            format_number(d["stages"]),
            format_number(d["makespan"]),
            format_number(d["max_idle"]),
            format_number(100 * d["bubble_fraction"]),
            format_number(d["activation_memory"]),
            format_number(d["param_memory"]),
        )
    console = Console(width=max(Console().width, 110))
    console.print(table)
    console.print(
        "memory in units of one stage of a ranks-stage split (DualPipeV stages are half size)"
    )
    for c in candidates:
        if c.result is None:
            console.print(f"{c.schedule}: not feasible: {c.reason}")
    console.print(f"best for these costs: {best}")
