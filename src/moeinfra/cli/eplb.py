"""``moeinfra eplb``: plan, evaluate, show and benchmark expert placements."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from moeinfra.cli.options import input_file, output_file
from moeinfra.eplb import POLICIES, Plan, evaluate, migration, rebalance
from moeinfra.eplb.loadfile import read_load
from moeinfra.errors import InputError
from moeinfra.numfmt import format_number, percent

app = typer.Typer(
    help="Expert-parallelism load balancer: plan, evaluate, show, benchmark.", no_args_is_help=True
)

_SUMMARY_ROWS = [
    ("balancedness", "balancedness (mean/max GPU load)", format_number),
    ("max_over_mean", "max/mean GPU load", format_number),
    ("mean_gap_to_lower_bound", "mean gap to lower bound", percent),
    ("max_gap_to_lower_bound", "worst layer gap to lower bound", percent),
    ("duplicates", "duplicate replicas on one GPU", format_number),
    ("remote_pair_fraction", "token-expert pairs leaving their node", format_number),
    ("nodes_per_token", "nodes a token is sent to", format_number),
    ("gpus_per_token", "GPUs a token is sent to", format_number),
]


def _summary_table(title: str, columns: dict[str, dict]) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
    for key, label, fmt in _SUMMARY_ROWS:
        table.add_row(label, *(fmt(summary[key]) for summary in columns.values()))
    return table


def _print_json(payload: dict) -> None:
    typer.echo(json.dumps(payload, indent=2))


@app.command()
def plan(
    load: Path = typer.Option(
        ..., "--load", help="Expert loads per layer and expert (.npy .npz .pt .json .csv)."
    ),
    replicas: int = typer.Option(..., "--replicas", help="Physical expert slots per layer."),
    groups: int = typer.Option(..., "--groups", help="Expert groups."),
    nodes: int = typer.Option(..., "--nodes", help="Server nodes."),
    gpus: int = typer.Option(..., "--gpus", help="GPUs in total."),
    policy: str = typer.Option("auto", "--policy", help=f"One of: {', '.join(POLICIES)}."),
    previous: Path | None = typer.Option(
        None, "--previous", help="Plan to migrate from (.npz/.json)."
    ),
    max_moves: int | None = typer.Option(
        None, "--max-moves", help="With --previous: cap on changed slots."
    ),
    bytes_per_expert: int = typer.Option(
        44_040_192,
        "--bytes-per-expert",
        help="Expert size for migration bytes (default: DeepSeek-V3 FP8).",
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the plan (.npz or .json)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary instead of tables."),
) -> None:
    """Compute a placement from expert loads and write it."""
    if out.suffix not in (".npz", ".json"):
        raise InputError(f"--out {str(out)!r} must end in .npz or .json")
    output_file(out, "--out")
    expert_load = read_load(input_file(load, "--load"))
    previous_plan = Plan.load(input_file(previous, "--previous")) if previous is not None else None
    start = time.perf_counter()
    result = rebalance(
        expert_load,
        replicas,
        groups,
        nodes,
        gpus,
        policy=policy,
        previous=previous_plan,
        max_moves=max_moves,
    )
    elapsed_ms = (time.perf_counter() - start) * 1e3
    reference = rebalance(expert_load, replicas, groups, nodes, gpus, policy="deepseek")
    result.save(out)
    ours, theirs = (
        evaluate(result, expert_load).summary(),
        evaluate(reference, expert_load).summary(),
    )
    payload: dict = {
        "plan": str(out),
        "policy": policy,
        "layers": result.num_layers,
        "time_ms": elapsed_ms,
        "summary": ours,
        "deepseek_summary": theirs,
    }
    if "layer_policy" in result.metrics:
        kinds = result.metrics["layer_policy"]
        payload["layer_policy"] = {kind: kinds.count(kind) for kind in sorted(set(kinds))}
    if previous_plan is not None:
        moved = migration(previous_plan, result, bytes_per_expert)
        payload["migration"] = {
            "slots_changed": moved.slots_changed,
            "slots_fraction": moved.slots_changed / result.phy2log.size,
            "transfers": moved.num_transfers,
            "bytes": moved.bytes,
        }
    if as_json:
        _print_json(payload)
        return
    console = Console()
    console.print(
        _summary_table(
            f"plan computed in {format_number(elapsed_ms)} ms", {policy: ours, "deepseek": theirs}
        )
    )
    if "layer_policy" in payload:
        console.print(f"layers by kind: {payload['layer_policy']}")
    if "migration" in payload:
        info = payload["migration"]
        console.print(
            f"migration: {format_number(info['slots_changed'])} slots changed "
            f"({percent(info['slots_fraction'])}), {format_number(info['transfers'])} transfers, "
            f"{format_number(info['bytes'] / 1e9)} GB"
        )
    typer.echo(f"plan written to {out}")  # plain: a long path is not wrapped


@app.command("eval")
def eval_(
    plan_path: Path = typer.Option(..., "--plan", help="Plan file (.npz/.json)."),
    load: Path = typer.Option(..., "--load", help="Expert loads to evaluate the plan under."),
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON (summary and per-layer figures)."
    ),
) -> None:
    """Evaluate a plan under a load: balance, gap to the lower bound, duplicates, traffic."""
    placed = Plan.load(input_file(plan_path, "--plan"))
    evaluation = evaluate(placed, read_load(input_file(load, "--load")))
    if as_json:
        payload = evaluation.to_dict()
        del payload["gpu_load"]
        _print_json(payload)
        return
    Console().print(
        _summary_table(
            f"{plan_path} ({placed.num_layers} layers)", {placed.policy: evaluation.summary()}
        )
    )


@app.command()
def show(
    plan_path: Path = typer.Option(..., "--plan", help="Plan file (.npz/.json)."),
    out: Path = typer.Option(..., "--out", "-o", help="Figure path (.png or .svg)."),
    layer: int | None = typer.Option(
        None, "--layer", help="Layer to draw (default: the least balanced)."
    ),
    load: Path | None = typer.Option(
        None, "--load", help="Loads to colour by (default: those the plan was built for)."
    ),
) -> None:
    """Draw one layer's placement (slots per GPU, grouped by node) and its GPU loads."""
    from moeinfra.eplb.figures import plot_plan

    output_file(out, "--out")
    placed = Plan.load(input_file(plan_path, "--plan"))
    expert_load = read_load(input_file(load, "--load")) if load is not None else placed.expert_load
    if expert_load is None:
        raise InputError(f"plan {str(plan_path)!r} stores no load; pass --load")
    typer.echo(f"figure written to {plot_plan(placed, expert_load, out, layer=layer)}")


@app.command()
def bench(
    repeats: int = typer.Option(
        5, "--repeats", min=1, help="Timed calls per configuration (median reported)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON rows."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
) -> None:
    """Time and compare the policies at DeepSeek-V3 scale (prefill EP32 and decode EP144 units)."""
    from tqdm import tqdm

    from moeinfra.eplb.bench import DEPLOYMENTS, markdown_table, run_benchmark

    kinds = ("lognormal", "zipf")
    # A bar on stderr that is cleared when done: the table on stdout stays clean and pasteable.
    with tqdm(
        total=len(DEPLOYMENTS) * len(kinds),
        desc="benchmarking",
        unit="config",
        leave=False,
        disable=quiet or not sys.stderr.isatty(),
    ) as bar:
        started = []

        def progress(config: str) -> None:
            if started:  # the previous configuration is done
                bar.update(1)
            started.append(config)
            bar.set_postfix_str(config)

        rows = run_benchmark(repeats=repeats, kinds=kinds, progress=progress)
    typer.echo(json.dumps(rows, indent=2) if as_json else markdown_table(rows))


@app.command()
def warm() -> None:
    """Compile the EPLB kernels into numba's on-disk cache now (the first plan in a fresh environment
    otherwise runs them interpreted while a background process compiles them)."""
    import os
    import subprocess

    from moeinfra.eplb import jit

    start = time.perf_counter()
    env = dict(os.environ, **{jit.MODE_ENV: "compiled"})
    code = "from moeinfra.eplb import jit; print(jit.warm())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise InputError(
            f"compiling the EPLB kernels failed: {proc.stderr.strip().splitlines()[-1]}"
        )
    typer.echo(
        f"EPLB kernels compiled into numba's cache in {format_number(time.perf_counter() - start)} s "
        f"(marker {proc.stdout.strip()})"
    )
