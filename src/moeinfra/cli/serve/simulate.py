"""``moeinfra serve simulate``: a prefill/decode fleet through a day or a trace."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from moeinfra.cli.options import output_folder, parse_duration_s
from moeinfra.cli.serve import app
from moeinfra.cli.serve.common import (
    CALIBRATION_HELP,
    DEMAND_SCALE_HELP,
    KERNELS_HELP,
    KV_CACHE_DTYPE_HELP,
    MODEL_HELP,
    SKIP_BAD_HELP,
    calibration_name,
    calibration_summary,
    check_positive,
    hourly_csv,
    kernel_tables,
    load_workload,
    model_line,
    num,
    parse_block,
    parse_fleet,
    parse_unit,
    read_calibration,
    served_model,
    signed_percent,
)
from moeinfra.errors import InputError
from moeinfra.serving.schedule import DEFAULT_TARGET


@app.command("simulate")
def simulate_cmd(
    scenario: str = typer.Option("deepseek-v3-day", "--scenario", help="Scenario preset."),
    workload: Path | None = typer.Option(
        None, "--workload", help="Trace to replay (.jsonl Mooncake-style, .csv Azure-style)."
    ),
    hardware: str = typer.Option("h800", "--hardware", help="h800, h100, h200 or b200."),
    hours: float | None = typer.Option(
        None, "--hours", help="Simulate only the first HOURS of the generated day."
    ),
    scale: float = typer.Option(
        100.0, "--scale", help="Real requests per simulated request (generated workload)."
    ),
    demand_scale: float = typer.Option(1.0, "--demand-scale", help=DEMAND_SCALE_HELP),
    fleet: str | None = typer.Option(
        None,
        "--fleet",
        help="deepseek (published node curve), auto (autoscaling) or P:D (fixed prefill:decode "
        "units).",
    ),
    prefill_unit: str | None = typer.Option(
        None,
        "--prefill-unit",
        help="Prefill unit: NODES[:REDUNDANT_EXPERTS] (EP = GPUs per node x nodes) [4:32, or the "
        "calibration's].",
    ),
    decode_unit: str | None = typer.Option(
        None,
        "--decode-unit",
        help="Decode unit: NODES[:REDUNDANT_EXPERTS] [18:32, or the calibration's].",
    ),
    calibration: str | None = typer.Option(None, "--calibration", help=CALIBRATION_HELP),
    tick: str = typer.Option(
        "2s",
        "--tick",
        metavar="DURATION",
        help="Simulation time step with a unit (us, ms, s): 2s, or 10ms for a short live-scale "
        "replay.",
    ),
    drain: bool = typer.Option(
        True,
        "--drain/--no-drain",
        help="A replayed trace: simulate on after the last arrival until every request finishes.",
    ),
    hash_block_tokens: int = typer.Option(
        512, "--hash-block-tokens", help="Tokens per hash_ids block of a .jsonl trace."
    ),
    gpu_hour_usd: float | None = typer.Option(
        None, "--gpu-hour-usd", help="GPU-hour price (default: the hardware preset's)."
    ),
    target: float | None = typer.Option(
        None,
        "--target",
        help=f"With --fleet auto: the busy share units are sized for [{DEFAULT_TARGET}].",
    ),
    slo_tpot: str | None = typer.Option(
        None,
        "--slo-tpot",
        metavar="DURATION",
        help="With --fleet auto: size decode units for this time per output token, with a unit "
        "(us, ms, s): 50ms or 0.05s.",
    ),
    slo_ttft_p95: str | None = typer.Option(
        None,
        "--slo-ttft-p95",
        metavar="DURATION",
        help="With --fleet auto: add prefill units until each 15 minutes' TTFT p95 meets this, "
        "with a unit (us, ms, s): 2s or 1500ms.",
    ),
    block: str | None = typer.Option(
        None,
        "--block",
        help="With --fleet auto: scale in blocks of P:D prefill:decode units (DeepSeek: 3:1).",
    ),
    balancer: str = typer.Option(
        "deepseek", "--balancer", help="deepseek or baseline (round robin / least requests)."
    ),
    seed: int = typer.Option(0, "--seed", help="Workload seed."),
    skip_bad: bool = typer.Option(False, "--skip-bad", help=SKIP_BAD_HELP),
    hit_ratio: float = typer.Option(
        0.0, "--hit-ratio", help="Cache-hit share for traces without hash_ids."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    out: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="Folder for result.json, hourly.csv and requests.npz (per request, plus the per-token "
        "inter-token latency histogram).",
    ),
    kernels: str = typer.Option("first-principles", "--kernels", help=KERNELS_HELP),
    model: str | None = typer.Option(None, "--model", help=MODEL_HELP),
    kv_cache_dtype: str | None = typer.Option(None, "--kv-cache-dtype", help=KV_CACHE_DTYPE_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Simulate a fleet over a day (default: DeepSeek's published day) and report cost and latency."""
    from tqdm import tqdm

    from moeinfra.serving.prefill_ticks import PrefillShare
    from moeinfra.serving.scenario import PUBLISHED, build_scenario, published_vs_simulated
    from moeinfra.serving.simulate import SimConfig
    from moeinfra.serving.uncertainty import (
        has_spread,
        range_method,
        ranges,
        simulate_figures,
        step_time_bounds,
    )

    trace, bad = (None, 0)
    check_positive(scale, "--scale")
    check_positive(demand_scale, "--demand-scale")
    check_positive(hours, "--hours")
    check_positive(gpu_hour_usd, "--gpu-hour-usd", at_least_zero=True)
    calibration = calibration_name(calibration, hardware, kernels, model)
    tables = kernel_tables(kernels, calibration, hardware)
    cal = read_calibration(calibration)
    served = served_model(model, kv_cache_dtype, cal)
    tick_s = parse_duration_s(tick, "--tick")
    if not tick_s > 0:
        raise InputError(f"--tick={tick!r} must be a duration > 0")
    slo_tpot_s = None if slo_tpot is None else parse_duration_s(slo_tpot, "--slo-tpot")
    slo_ttft_s = None if slo_ttft_p95 is None else parse_duration_s(slo_ttft_p95, "--slo-ttft-p95")
    if out is not None:
        output_folder(out, "--out")  # before the simulation, not after it
    if workload is not None:
        trace, bad = load_workload(workload, skip_bad, hit_ratio, hash_block_tokens, demand_scale)
    scenario_args = dict(
        workload=trace,
        hardware_name=hardware,
        hours=hours,
        scale=scale,
        demand_scale=demand_scale,
        seed=seed,
        fleet=parse_fleet(fleet),
        prefill_dep=None
        if prefill_unit is None
        else parse_unit(prefill_unit, "--prefill-unit", "prefill"),
        decode_dep=None
        if decode_unit is None
        else parse_unit(decode_unit, "--decode-unit", "decode"),
        gpu_hour_usd=gpu_hour_usd,
        calibration=cal,
        kernels=tables,
        target=target,
        slo_tpot_s=slo_tpot_s,
        slo_ttft_s=slo_ttft_s,
        block=None if block is None else parse_block(block),
        balancer=balancer,
        model=served,
    )
    built = build_scenario(scenario, **scenario_args)
    bounds = step_time_bounds(cal) if cal is not None else {}
    runs = 3 if has_spread(bounds) else 1
    total_h = round(built.schedule.duration_s / 3600.0, 2)
    show = not quiet and sys.stderr.isatty()
    config = SimConfig(
        tick_s=tick_s,
        record_every_s=max(60.0, tick_s),
        balancer=balancer,
        drain_s=3600.0 if drain and workload is not None else 0.0,
    )
    # the range runs scale decode (and prefill where the calibration moves it): those that leave
    # prefill as it was read the first run's prefill ticks back
    share = PrefillShare() if runs == 3 else None
    with tqdm(total=total_h * runs, unit="h", desc="simulated", disable=not show) as bar:

        def run(scn, done_h: float):
            def progress(t_s: float) -> None:
                bar.n = round(done_h + min(t_s / 3600.0, total_h), 2)
                bar.refresh()

            return scn.run(config, progress=progress, prefill_share=share)

        result = run(built, 0.0)
        payload = result.to_dict()
        point = simulate_figures(payload)
        # the same requests (not generated again), every step time at the bound
        same_requests = scenario_args | {"workload": built.workload}
        bound_figures = [
            simulate_figures(
                run(
                    build_scenario(scenario, **same_requests, time_scale=bounds[side]),
                    total_h * (k + 1),
                ).to_dict()
            )
            for k, side in enumerate(("fast", "slow"))
            if runs == 3
        ]
    payload["scenario"] = scenario
    payload["hardware"] = built.prefill.hw.name
    payload["calibration"] = calibration_summary(cal)
    payload["kernels"] = kernels
    payload["kernel_coverage"] = (
        None
        if tables is None
        else {"prefill": built.prefill.kernel_coverage(), "decode": built.decode.kernel_coverage()}
    )
    payload["ranges"] = None if cal is None else ranges(point, *bound_figures)
    payload["range_method"] = range_method(cal is not None, runs == 3)
    payload["step_time_bounds"] = bounds or None
    payload["workload"] = str(workload) if workload else built.workload.name
    if workload is not None:
        payload["bad_lines_skipped"] = bad
    if out is not None:
        from moeinfra.atomicio import atomic_path, write_text_atomic

        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "result.json", json.dumps(payload, indent=2))
        write_text_atomic(out / "hourly.csv", hourly_csv(result.hourly))
        with atomic_path(out / "requests.npz") as tmp:
            np.savez_compressed(
                tmp,
                status=result.status,
                reason=result.reason,
                ttft_s=result.ttft_s,
                tpot_s=result.tpot_s,
                finish_s=result.finish_s,
                itl_edges_s=result.itl_edges_s,
                itl_tokens=result.itl_tokens,
                arrival_s=built.workload.arrival_s,
                input_tokens=built.workload.input_tokens,
                output_tokens=built.workload.output_tokens,
                cached_tokens=built.workload.cached_tokens,
                scale=np.array(result.scale),
            )
    if as_json:
        typer.echo(json.dumps(payload, indent=2))
        return
    console = Console()
    table = Table(
        title=f"{payload['workload']} on {payload['hardware']} ({num(payload['hours'])} h, "
        f"calibration {'none' if cal is None else cal.name})"
    )
    spread = payload["ranges"] if runs == 3 else None

    def span(key: str, unit: float = 1.0) -> str:
        lo, hi = (spread or {}).get(key, (None, None))
        return "" if lo is None else f"{num(lo * unit)} - {num(hi * unit)}"

    # a narrow terminal wraps the labels and folds a long number, never cuts one short
    table.add_column("figure")
    table.add_column("simulated", justify="right", overflow="fold")
    if spread:
        table.add_column("range (calibration)", justify="right", overflow="fold")
    if workload is None and hours is None:
        table.add_column("published", justify="right", overflow="fold")
        table.add_column("difference", justify="right", overflow="fold")
        rows = zip(PUBLISHED, published_vs_simulated(result.totals), strict=True)
        for key, (label, published, simulated, diff) in rows:
            if key.endswith("tokens"):  # the unit in the label, as the report has it
                label, published, simulated = (
                    f"{label} (billions)",
                    published / 1e9,
                    simulated / 1e9,
                )
            elif key == "margin":
                label, published, simulated = f"{label} (%)", published * 100, simulated * 100
            cells = [num(simulated), num(published), signed_percent(diff)]
            table.add_row(label, *cells[:1], *([span(key)] if spread else []), *cells[1:])
    else:
        for key in (
            "avg_nodes",
            "peak_nodes",
            "cost_usd",
            "input_tokens",
            "output_tokens",
            "revenue_usd",
            "margin",
            "prefill_tokens_per_s_per_node",
            "decode_tokens_per_s_per_node",
            "mean_output_tokens_per_s",
        ):
            table.add_row(key, num(payload[key]), *([span(key)] if spread else []))
    console.print(table)
    if served is not None:
        console.print(model_line(served))
    req = payload["requests"]
    ttft_range = span("ttft_p95_s")
    tpot_range = span("tpot_p95_s", 1e3)
    refused = {k: v for k, v in payload["rejected_by_reason"].items() if v}
    console.print(
        f"requests: {num(req['arrived'])} arrived = {num(req['completed'])} completed + "
        f"{num(req['running'])} running + {num(req['rejected'])} rejected"
        + (
            " (" + ", ".join(f"{reason}: {num(count)}" for reason, count in refused.items()) + ")"
            if refused
            else ""
        )
        + f"; TTFT p95 {num(payload['ttft_s'].get('p95', float('nan')))} s"
        + (f" ({ttft_range})" if ttft_range else "")
        + f", TPOT p95 {num(payload['tpot_s'].get('p95', float('nan')) * 1e3)} ms"
        + (f" ({tpot_range})" if tpot_range else "")
        + f", inter-token latency p99 {num(payload['itl_s'].get('p99', float('nan')) * 1e3)} ms"
    )
