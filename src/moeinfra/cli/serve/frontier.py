"""``moeinfra serve frontier``: decode throughput against latency per unit shape."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from moeinfra.cli.options import output_folder
from moeinfra.cli.serve import app
from moeinfra.cli.serve.common import (
    CALIBRATION_HELP,
    KV_CACHE_DTYPE_HELP,
    MODEL_HELP,
    MTP_HELP,
    MTP_NAMES,
    calibration_name,
    calibration_summary,
    check_positive,
    model_line,
    model_summary,
    node_list,
    num,
    read_calibration,
    read_mtp,
    served_model,
)


@app.command("frontier")
def frontier_cmd(
    hardware: str = typer.Option("h800", "--hardware", help="h800, h100, h200 or b200."),
    kv: float = typer.Option(
        4_989.0, "--kv", help="Mean KV length per output token (DeepSeek's day: 4,989)."
    ),
    nodes: str = typer.Option(
        "1,2,4,8,16,18,32", "--nodes", help="Nodes per decode unit to try, comma-separated."
    ),
    mtp: str = typer.Option(
        "0", *MTP_NAMES, metavar="ACCEPTANCE|METRICS", help="Multi-token prediction. " + MTP_HELP
    ),
    calibration: str | None = typer.Option(None, "--calibration", help=CALIBRATION_HELP),
    model: str | None = typer.Option(None, "--model", help=MODEL_HELP),
    kv_cache_dtype: str | None = typer.Option(None, "--kv-cache-dtype", help=KV_CACHE_DTYPE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the frontier as JSON."),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Folder for frontier.json and frontier.png."
    ),
) -> None:
    """Decode's Pareto frontier: output tokens/s per GPU against tokens/s per user over unit
    shapes (nodes, micro-batches) and batch sizes, beside DeepSeek's published point."""
    from moeinfra.serving.frontier import DEEPSEEK_DECODE_POINT, decode_frontier
    from moeinfra.serving.perfmodel import DEFAULT_EFFICIENCY
    from moeinfra.serving.specs import DEEPSEEK_V3
    from moeinfra.serving.specs import hardware as hardware_spec

    counts = node_list(nodes, "--nodes")
    check_positive(kv, "--kv")
    mtp_measured = read_mtp(mtp)
    mtp = mtp_measured.acceptance
    if out is not None:
        output_folder(out, "--out")
    cal = read_calibration(calibration_name(calibration, hardware, model=model))
    served = served_model(model, kv_cache_dtype, cal)
    if cal is None:
        hw, spec, eff, kv_cap = hardware_spec(hardware), DEEPSEEK_V3, DEFAULT_EFFICIENCY, None
    else:
        hw, spec, eff, kv_cap = (
            cal.hardware,
            cal.model,
            cal.efficiency(),
            cal.kv_tokens_per_gpu,
        )
    spec = served or spec
    front = decode_frontier(
        hw,
        spec,
        eff,
        mean_kv=kv,
        nodes=counts,
        kv_tokens_per_gpu=kv_cap,
        mtp_acceptance=mtp,
    )
    speed = DEEPSEEK_DECODE_POINT["tokens_per_s_per_user"]
    best = front.best_at(speed)
    payload = front.to_dict() | {
        "hardware": hw.name,
        "calibration": calibration_summary(cal),
        "deepseek_published": DEEPSEEK_DECODE_POINT,
        "best_at_deepseek_speed": None if best is None else best.to_dict(),
        "model": model_summary(spec),
        "mtp": mtp_measured.to_dict() if mtp else None,
    }
    if out is not None:
        from moeinfra.atomicio import write_text_atomic
        from moeinfra.serving.figures import plot_frontier

        write_text_atomic(out / "frontier.json", json.dumps(payload, indent=1))
        plot_frontier(
            front,
            out / "frontier.png",
            DEEPSEEK_DECODE_POINT if hw.name == "h800" and cal is None else None,
            f"decode frontier on {hw.name}, mean KV {num(kv)}"
            + (f", MTP {num(mtp)}" if mtp else "")
            + f" (calibration {'none' if cal is None else cal.name})",
        )
    if as_json:
        typer.echo(json.dumps(payload, indent=2))
        return
    table = Table(
        title=f"decode frontier on {hw.name} at mean KV {num(kv)} tokens (calibration "
        f"{'none' if cal is None else cal.name})"
    )
    for col in ("nodes", "micro-batches", "requests/GPU", "tokens/s per user", "tokens/s per GPU"):
        table.add_column(col, justify="right")
    for p in front.pareto[:: max(1, len(front.pareto) // 12)]:
        table.add_row(
            num(p.nodes),
            num(p.micro_batches),
            num(p.batch_per_gpu),
            num(p.tokens_per_s_per_user),
            num(p.tokens_per_s_per_gpu),
        )
    console = Console()
    console.print(table)
    if served is not None:
        console.print(model_line(served))
    if mtp:
        console.print(mtp_measured.describe())
    for reason in front.unfit:
        console.print(f"left out: {reason}")
    if best is not None:
        console.print(
            f"at {num(speed)} tokens/s per user: {num(best.nodes)}-node units, "
            f"{num(best.batch_per_gpu)} requests/GPU, {num(best.tokens_per_s_per_gpu)} tokens/s per "
            f"GPU (DeepSeek published {num(DEEPSEEK_DECODE_POINT['tokens_per_s_per_gpu'])} on "
            "18-node H800 units)"
        )
