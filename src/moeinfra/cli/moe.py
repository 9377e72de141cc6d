"""``moeinfra moe``: run the expert-parallel DeepSeek-V3 MoE decoder on local gloo processes."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from moeinfra.numfmt import format_number, percent

app = typer.Typer(
    help="Expert-parallel DeepSeek-V3 MoE with redundant experts and dual micro-batch overlap.",
    no_args_is_help=True,
)


@app.command()
def run(
    world_size: int = typer.Option(
        2, "--world-size", "-n", help="Local gloo processes (EP ranks)."
    ),
    preset: str = typer.Option(
        "small",
        "--preset",
        help="Model sizes: small (512-wide experts), tiny (32-wide: too little compute to hide an "
        "exchange behind); deepseek_v3 is refused (46 GB per process).",
    ),
    tokens: int = typer.Option(1024, "--tokens", help="Tokens per rank (each rank's own batch)."),
    redundant: int = typer.Option(0, "--redundant", help="Redundant expert slots per layer."),
    overlap: str = typer.Option("none", "--overlap", help="none, prefill or decode."),
    delay_ms: float = typer.Option(
        0.0, "--delay-ms", help="Injected delay per dispatch/combine exchange, ms."
    ),
    seq_len: int = typer.Option(128, "--seq-len", help="Tokens per sequence."),
    steps: int = typer.Option(7, "--steps", help="Timed steps (median and spread reported)."),
    seed: int = typer.Option(0, "--seed", help="Seed of weights and tokens."),
    trace: Path | None = typer.Option(
        None, "--trace", help="Write a Chrome-trace timeline (compute/comm per rank) here."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    timeout_s: float = typer.Option(600.0, "--timeout", help="Give up after this many seconds."),
) -> None:
    """Run N ranks, compare with the single-process reference, rebalance with EPLB, migrate."""
    from moeinfra.moe.run import RunConfig
    from moeinfra.moe.run import run as run_moe

    config = RunConfig(
        world_size=world_size,
        preset=preset,
        tokens=tokens,
        redundant=redundant,
        overlap=overlap,
        delay_s=delay_ms / 1000.0,
        seq_len=seq_len,
        steps=steps,
        seed=seed,
    )
    result = run_moe(config, trace_path=trace, timeout_s=timeout_s)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    console = Console()
    table = Table(
        title=f"moe run: {world_size} ranks, {format_number(tokens)} tokens/rank, overlap={overlap}"
    )
    table.add_column("rank", justify="right")
    table.add_column("step time (ms)", justify="right")
    table.add_column("comm hidden", justify="right")
    for rank, (t, f) in enumerate(
        zip(result["per_rank_time_s"], result["per_rank_comm_hidden_fraction"], strict=True)
    ):
        table.add_row(str(rank), format_number(t * 1e3), "-" if f is None else percent(f))
    console.print(table)
    steps_ms = [t * 1e3 for t in result["step_times_s"]]
    console.print(
        f"step time, slowest rank: median {format_number(result['step_time_s'] * 1e3)} ms "
        f"(min {format_number(min(steps_ms))}, max {format_number(max(steps_ms))} "
        f"over {format_number(len(steps_ms))} steps)"
    )
    load = result["expert_load"]
    # Space-separated: thousands separators would be ambiguous in a comma-separated list.
    tokens_per_expert = " ".join(format_number(n) for n in load[0])
    console.print(f"expert load (layer 0, tokens per expert): {tokens_per_expert}")
    console.print(
        f"max abs error vs reference: {format_number(result['max_abs_error_vs_reference'])}"
    )
    console.print(
        f"after EPLB rebalance + weight migration ({format_number(result['experts_migrated'])} "
        f"experts moved): max abs error {format_number(result['max_abs_error_after_rebalance'])}"
    )
    console.print(
        f"balancedness: {format_number(result['balancedness_before'])} before, "
        f"{format_number(result['balancedness_after'])} after rebalance"
    )
    hidden = result["comm_hidden_fraction"]
    console.print(f"communication hidden: {'-' if hidden is None else percent(hidden)}")
    # Paths and commands as plain lines: never wrapped to the terminal, so they can be pasted.
    if trace is not None:
        typer.echo(f"trace written to {result['trace']}")
    typer.echo(f"same run under torchrun: {result['torchrun_command']}")


@app.command("schedule")
def show_schedule(
    overlap: str = typer.Option("prefill", "--overlap", help="none, prefill or decode."),
    layers: int = typer.Option(2, "--layers", help="Decoder layers."),
    as_json: bool = typer.Option(False, "--json", help="Print the ops as JSON strings."),
) -> None:
    """Print one rank's op order: compute ops and the exchanges they issue (waits come later)."""
    from moeinfra.moe.schedules import COMM_KINDS, schedule

    ops = schedule(overlap, layers)
    if as_json:
        typer.echo(json.dumps([str(op) for op in ops]))
        return
    table = Table(title=f"{overlap} schedule, {layers} layers")
    table.add_column("step", justify="right")
    table.add_column("compute")
    table.add_column("communication issued (async)")
    for step, op in enumerate(ops):
        comm = op.kind in COMM_KINDS
        table.add_row(str(step), "" if comm else str(op), str(op) if comm else "")
    Console().print(table)
