"""``moeinfra serve plan``: the cheapest fleet that meets the latency targets."""

from __future__ import annotations

import json
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
    MTP_HELP,
    MTP_NAMES,
    SKIP_BAD_HELP,
    calibration_name,
    calibration_summary,
    check_positive,
    kernel_tables,
    length_model,
    load_workload,
    model_line,
    model_summary,
    node_list,
    num,
    read_calibration,
    read_mtp,
    served_model,
)
from moeinfra.errors import InputError


@app.command("plan")
def plan_cmd(
    workload: Path | None = typer.Option(
        None,
        "--workload",
        help="Trace (.jsonl or .csv). Default: --demand, else DeepSeek's generated day "
        "(--hours from its start, 12:00 UTC+8).",
    ),
    demand: float | None = typer.Option(
        None,
        "--demand",
        help="Steady demand in output tokens/s (Poisson arrivals, DeepSeek's published lengths "
        "and cache hits) for --hours.",
    ),
    lengths: str | None = typer.Option(
        None,
        "--lengths",
        metavar="IN:OUT",
        help="--demand: mean prompt and answer tokens (lognormal, CV 1.5 and 1.0; default "
        "DeepSeek's published means).",
    ),
    hours: float | None = typer.Option(
        None, "--hours", help="Hours of --demand or the generated day (default 1)."
    ),
    scale: float | None = typer.Option(
        None,
        "--scale",
        help="--demand or the generated day: real requests per simulated one (default 100).",
    ),
    slo_ttft_p95: str = typer.Option(
        "2s",
        "--slo-ttft-p95",
        metavar="DURATION",
        help="TTFT p95 target with a unit (us, ms, s): 2s or 1500ms.",
    ),
    slo_tpot: str = typer.Option(
        "50ms",
        "--slo-tpot",
        metavar="DURATION",
        help="Time per output token p95 target with a unit (us, ms, s): 50ms or 0.05s.",
    ),
    modes: str = typer.Option(
        "disaggregated,aggregated",
        "--modes",
        help="Fleets to search: disaggregated (prefill + decode units), aggregated (units doing "
        "both), comma-separated.",
    ),
    prefill_nodes: str = typer.Option("1,2,4,8", "--prefill-nodes", help="Nodes per prefill unit."),
    decode_nodes: str = typer.Option(
        "1,2,4,8,16,18,32", "--decode-nodes", help="Nodes per decode unit."
    ),
    colocated_nodes: str = typer.Option(
        "1,2,4,8,16,18", "--colocated-nodes", help="Nodes per aggregated unit."
    ),
    micro_batches: str = typer.Option(
        "1,2", "--micro-batches", help="Micro-batch counts to try (2: dual micro-batch overlap)."
    ),
    mtp: str = typer.Option(
        "0",
        *MTP_NAMES,
        metavar="ACCEPTANCE|METRICS",
        help="Also try decoding with multi-token prediction (0: only without). " + MTP_HELP,
    ),
    max_batch_per_gpu: str = typer.Option(
        "",
        "--max-batch-per-gpu",
        help="Also try decode batch limits (requests per GPU), comma-separated; no limit always.",
    ),
    hardware: str = typer.Option("h800", "--hardware", help="h800, h100, h200 or b200."),
    gpu_hour_usd: float | None = typer.Option(
        None, "--gpu-hour-usd", help="GPU-hour price (default: the hardware preset's)."
    ),
    skip_bad: bool = typer.Option(False, "--skip-bad", help=SKIP_BAD_HELP),
    hit_ratio: float = typer.Option(
        0.0, "--hit-ratio", help="Cache-hit share for traces without hash_ids."
    ),
    demand_scale: float = typer.Option(1.0, "--demand-scale", help=DEMAND_SCALE_HELP),
    calibration: str | None = typer.Option(None, "--calibration", help=CALIBRATION_HELP),
    kernels: str = typer.Option("first-principles", "--kernels", help=KERNELS_HELP),
    model: str | None = typer.Option(None, "--model", help=MODEL_HELP),
    kv_cache_dtype: str | None = typer.Option(None, "--kv-cache-dtype", help=KV_CACHE_DTYPE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Folder for plan.json and plan.png."),
) -> None:
    """Cheapest fixed fleet meeting the SLOs, searched over unit shapes (nodes and EP degree,
    redundant experts, micro-batches, MTP, batch limits), disaggregated or aggregated."""
    from moeinfra.serving.planner import candidate_shapes, plan_capacity
    from moeinfra.serving.specs import DEEPSEEK_V3, priced_hardware
    from moeinfra.serving.uncertainty import (
        has_spread,
        plan_figures,
        range_method,
        ranges,
        step_time_bounds,
    )
    from moeinfra.serving.workload import constant_demand, deepseek_day, real_count, real_parts

    slo_ttft_s = parse_duration_s(slo_ttft_p95, "--slo-ttft-p95")
    slo_tpot_s = parse_duration_s(slo_tpot, "--slo-tpot")
    check_positive(gpu_hour_usd, "--gpu-hour-usd", at_least_zero=True)
    check_positive(demand_scale, "--demand-scale")
    if workload is not None and demand is not None:
        raise InputError("--workload and --demand: give one (or neither: DeepSeek's day)")
    if workload is not None and (hours is not None or scale is not None):
        raise InputError(
            f"--hours={hours} / --scale={scale}: for --demand or the generated day; a --workload "
            "trace has its own duration and scale"
        )
    hours = 1.0 if hours is None else hours
    scale = 100.0 if scale is None else scale
    check_positive(scale, "--scale")
    if not (np.isfinite(hours) and 0 < hours <= 24):
        raise InputError(f"--hours={hours} must be in (0, 24]")
    unknown = [m for m in modes.split(",") if m.strip() not in ("disaggregated", "aggregated")]
    if unknown:
        raise InputError(
            f"--modes={modes!r}: allowed disaggregated, aggregated or both, comma-separated"
        )
    if lengths is not None and demand is None:
        raise InputError(f"--lengths={lengths!r} applies to --demand only")
    chosen_modes = tuple(m.strip() for m in modes.split(","))
    mbs = node_list(micro_batches, "--micro-batches")
    if not set(mbs) <= {1, 2}:
        raise InputError(f"--micro-batches={micro_batches!r}: allowed 1, 2 or 1,2")
    mtp_measured = read_mtp(mtp)
    mtp = mtp_measured.acceptance
    limits = []
    for part in filter(None, (p.strip() for p in max_batch_per_gpu.split(","))):
        try:
            limits.append(float(part))
        except ValueError:
            limits.append(float("nan"))
        if not (np.isfinite(limits[-1]) and limits[-1] > 0):
            raise InputError(
                f"--max-batch-per-gpu={max_batch_per_gpu!r} must be numbers > 0, comma-separated"
            )
    if out is not None:
        output_folder(out, "--out")
    hw = priced_hardware(hardware, gpu_hour_usd)
    calibration = calibration_name(calibration, hardware, kernels, model)
    tables = kernel_tables(kernels, calibration, hardware)
    cal = read_calibration(calibration)
    served = served_model(model, kv_cache_dtype, cal)
    shapes = candidate_shapes(
        modes=chosen_modes,
        nodes={
            "prefill": node_list(prefill_nodes, "--prefill-nodes"),
            "decode": node_list(decode_nodes, "--decode-nodes"),
            "colocated": node_list(colocated_nodes, "--colocated-nodes"),
        },
        micro_batches=mbs,
        mtp_acceptance=mtp,
        max_batch_per_gpu=tuple(limits),
        gpus_per_node=hw.gpus_per_node,
        routed_experts=(served or (DEEPSEEK_V3 if cal is None else cal.model)).num_routed_experts,
    )
    if workload is not None:
        trace, _ = load_workload(workload, skip_bad, hit_ratio, demand_scale=demand_scale)
        source = str(workload)
    elif demand is not None:
        check_positive(demand, "--demand")
        context = served.max_context_tokens if served is not None else None
        trace = constant_demand(
            demand * demand_scale, hours, scale, lengths=length_model(lengths, context)
        )
        source = f"{num(demand * demand_scale)} output tokens/s"
    else:
        trace = deepseek_day(scale=scale, hours=hours, demand_scale=demand_scale)
        source = f"DeepSeek's day, first {num(hours)} h"
    args = dict(
        slo_ttft_p95_s=slo_ttft_s,
        slo_tpot_p95_s=slo_tpot_s,
        hw=hw,
        calibration=cal,
        shapes=shapes,
        kernels=tables,
        model=served,
    )
    result = plan_capacity(trace, **args)
    bounds = step_time_bounds(cal) if cal is not None else {}
    bound_figures = []
    for side in ("fast", "slow") if has_spread(bounds) else ():
        try:
            bound = plan_figures(plan_capacity(trace, **args, time_scale=bounds[side]))
        except InputError:  # no candidate meets the SLOs at this bound
            bound = dict.fromkeys(plan_figures(result))
        bound_figures.append(bound)
    payload = result.to_dict() | {
        "workload": source,
        "slo": {"ttft_p95_s": slo_ttft_s, "tpot_p95_s": slo_tpot_s},
        "calibration": calibration_summary(cal),
        "kernels": kernels,
        "ranges": None if cal is None else ranges(plan_figures(result), *bound_figures),
        "range_method": range_method(cal is not None, bool(bound_figures))
        + ("" if cal is None else "; null: at that bound no candidate meets the SLOs"),
        "step_time_bounds": bounds or None,
        "model": model_summary(served or (DEEPSEEK_V3 if cal is None else cal.model)),
        "mtp": mtp_measured.to_dict() if mtp else None,
    }
    # requests refused on arrival (longer than the model's context): counted, not planned for
    refused = real_parts(list(trace.refused.values()), trace.scale)
    payload["requests"] = {
        "arrived": real_count(trace.size + sum(trace.refused.values()), trace.scale),
        "rejected": sum(refused),
    }
    payload["rejected_by_reason"] = dict(zip(trace.refused, refused, strict=True))
    if out is not None:
        from moeinfra.atomicio import write_text_atomic
        from moeinfra.serving.figures import plot_plan

        write_text_atomic(out / "plan.json", json.dumps(payload, indent=1))
        plot_plan(result, out / "plan.png")
    if as_json:
        typer.echo(json.dumps(payload, indent=2))
        return
    _print_plan(result, source, payload, bound_figures, served)
    if mtp_measured.measured:
        Console().print(mtp_measured.describe())


def _print_plan(result, source: str, payload: dict, bound_figures: list, served=None) -> None:
    def ms(value):
        return "-" if value is None else num(value * 1e3)

    table = Table(
        title=f"shapes searched for {source} ({num(payload['hours'])} h); p95 figures, "
        "both: aggregated units, R: redundant experts, mb: micro-batches"
    )
    shapes = [o.shape for o in result.options]
    with_mtp = any(s.mtp_acceptance for s in shapes)
    with_limit = any(s.max_batch_per_gpu is not None for s in shapes)
    table.add_column("phase", no_wrap=True)
    for col in (
        "nodes", "R", "mb", *(("MTP",) if with_mtp else ()), *(("limit",) if with_limit else ()),
        "units", "TTFT ms", "TPOT ms", "SLOs", "USD",
    ):  # fmt: skip
        table.add_column(col, justify="right")
    pruned = 0
    for o in sorted(result.options, key=lambda o: (o.phase, o.cost_usd)):
        if not o.searched:
            pruned += 1
            continue
        s = o.shape
        table.add_row(
            "both" if s.phase == "colocated" else s.phase,
            num(s.nodes),
            num(s.redundant_experts),
            num(s.micro_batches),
            *((num(s.mtp_acceptance) if s.mtp_acceptance else "off",) if with_mtp else ()),
            *(
                ("none" if s.max_batch_per_gpu is None else num(s.max_batch_per_gpu),)
                if with_limit
                else ()
            ),
            num(o.units),
            ms(o.ttft_p95_s),
            ms(o.tpot_p95_s),
            "met" if o.meets_slo else "missed",
            num(o.cost_usd),
        )
    console = Console()
    console.print(table)
    if pruned:
        console.print(
            f"{num(pruned)} more shapes not simulated: their lower bound already costs more than "
            "the best found (--json lists them)"
        )
    if result.unfit:
        console.print(
            f"left out {num(len(result.unfit))} shapes that do not fit in HBM, e.g. "
            f"{result.unfit[0]}"
        )
    refused = {k: v for k, v in payload.get("rejected_by_reason", {}).items() if v}
    if refused:
        console.print(
            "refused on arrival, not planned for: "
            + ", ".join(f"{num(count)} ({reason})" for reason, count in refused.items())
        )
    if result.mode == "aggregated":
        c = result.colocated
        fleet = f"{num(c.units)} x {num(c.shape.nodes)}-node aggregated units"
    else:
        p, d = result.prefill, result.decode
        fleet = (
            f"{num(p.units)} x {num(p.shape.nodes)}-node prefill + {num(d.units)} x "
            f"{num(d.shape.nodes)}-node decode"
        )
    other = (
        f"; the best aggregated fleet costs ${num(result.colocated.cost_usd)}"
        if result.mode == "disaggregated" and result.colocated is not None
        else (
            f"; the best disaggregated fleet costs ${num(result.disaggregated_cost_usd)}"
            if result.mode == "aggregated" and np.isfinite(result.disaggregated_cost_usd)
            else ""
        )
    )
    if served is not None:
        console.print(model_line(served))
    console.print(f"cheapest: {fleet} = {num(result.nodes)} nodes, ${num(result.cost_usd)}{other}")
    if bound_figures:
        (n_lo, n_hi), (c_lo, c_hi) = payload["ranges"]["nodes"], payload["ranges"]["cost_usd"]
        console.print(
            "range (calibration residuals): "
            + (
                "at the slow bound no candidate meets the SLOs"
                if n_lo is None
                else f"{num(n_lo)} - {num(n_hi)} nodes, ${num(c_lo)} - ${num(c_hi)}"
            )
        )
