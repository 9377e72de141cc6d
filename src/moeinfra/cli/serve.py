"""``moeinfra serve``: simulate a prefill/decode fleet, plan capacity, show the performance model."""

from __future__ import annotations

import csv
import io
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from moeinfra.cli.options import input_file, output_folder, parse_duration_s
from moeinfra.errors import InputError
from moeinfra.serving.schedule import DEFAULT_TARGET

app = typer.Typer(
    help="Inference fleet: simulate a day, plan capacity, per-layer performance model.",
    no_args_is_help=True,
)


def _whole_numbers(text: str, count: int, at_least: int) -> tuple[int, ...] | None:
    parts = text.split(":")
    if len(parts) != count or not all(p.strip().isdigit() for p in parts):
        return None
    values = tuple(int(p) for p in parts)
    return values if min(values) >= at_least else None


def check_positive(value: float | None, option: str, at_least_zero: bool = False) -> None:
    """A number option must be finite and > 0 (>= 0 with ``at_least_zero``); None passes."""
    if value is None:
        return
    ok = value >= 0 if at_least_zero else value > 0
    if not (np.isfinite(value) and ok):
        bound = ">= 0" if at_least_zero else "> 0"
        raise InputError(f"{option}={value} must be a finite number {bound}")


def parse_block(text: str) -> tuple[int, int]:
    """``"3:1"`` -> ``(3, 1)`` prefill and decode units per block."""
    values = _whole_numbers(text, 2, 1)
    if values is None:
        raise InputError(f"--block={text!r} must be P:D with whole numbers >= 1, e.g. 3:1")
    return values[0], values[1]


def parse_fleet(text: str | None) -> str | tuple[int, int] | None:
    """``deepseek``, ``auto`` or ``P:D`` (a fixed fleet of P prefill and D decode units)."""
    if text is None or text in ("deepseek", "auto"):
        return text
    values = _whole_numbers(text, 2, 1)
    if values is None:
        raise InputError(
            f"--fleet={text!r} must be deepseek, auto or P:D (fixed prefill:decode units, e.g. 6:2)"
        )
    return values[0], values[1]


def parse_unit(text: str, name: str, phase: str):
    """``"18"`` or ``"18:32"`` -> a Deployment of 18 nodes (with 32 redundant experts)."""
    from moeinfra.serving.specs import Deployment, fitting_redundant_experts

    values = _whole_numbers(text, 2, 0) or _whole_numbers(text, 1, 0)
    if values is None or values[0] < 1:
        raise InputError(
            f"{name}={text!r} must be NODES or NODES:REDUNDANT_EXPERTS, e.g. 18:32 (nodes >= 1)"
        )
    redundant = values[1] if len(values) == 2 else fitting_redundant_experts(values[0])
    return Deployment(phase, values[0], redundant_experts=redundant)


CALIBRATION_HELP = (
    "none (the first-principles model), deepseek-h800, sglang-h100 or rtp-llm-h800 (shipped: "
    "fitted on DeepSeek's H800 profiles / SGLang's H100 figures / RTP-LLM's H800 EP144 decode "
    "curve) or a calibration file written by moeinfra serve "
    "calibrate: its hardware, model, unit shapes and fitted factors are used "
    "[rtp-llm-h800 on h800 with first-principles kernels, none elsewhere]."
)


def _calibration_name(
    value: str | None, hardware: str, kernels: str = "first-principles", model: str | None = None
) -> str:
    """``--calibration`` as given, or the default: the shipped calibration of ``hardware``
    (``rtp-llm-h800`` on h800), none beside measured kernels, where none is shipped, or for a
    DeepSeek-V4 ``model`` (every shipped calibration was fitted on DeepSeek-V3)."""
    from moeinfra.serving.calibration import default_calibration
    from moeinfra.serving.specs import MODELS

    if value is not None:
        return value
    if model in MODELS and MODELS[model].v4:
        return "none"
    return default_calibration(hardware) if kernels == "first-principles" else "none"


def _n(value) -> str:
    """A number for people (:func:`moeinfra.numfmt.format_number`), ``n/a`` when missing."""
    from moeinfra.numfmt import format_number

    return "n/a" if value is None else format_number(value)


def _signed_percent(fraction: float) -> str:
    """``+38%``, ``-0.2%``, ``0%`` (:func:`moeinfra.numfmt.percent` with the sign of a change)."""
    from moeinfra.numfmt import percent

    return ("+" if fraction > 0 else "") + percent(fraction)


def _calibration(value: str):
    from moeinfra.serving.calibration import BUILTIN, load_calibration

    if value != "none" and value not in BUILTIN:
        allowed = (
            f"allowed: none, {', '.join(BUILTIN)} or a file written by moeinfra serve calibrate"
        )
        input_file(Path(value), "--calibration", allowed)
    return load_calibration(value)


def _calibration_summary(calibration) -> dict | str:
    return "none" if calibration is None else calibration.summary()


def _load_workload(
    path: Path,
    skip_bad: bool,
    hit_ratio: float,
    hash_block_tokens: int = 512,
    demand_scale: float = 1.0,
):
    from moeinfra.serving.workload import read_trace

    input_file(path, "--workload")
    if hash_block_tokens < 1:
        raise InputError(f"--hash-block-tokens={hash_block_tokens} must be >= 1")
    workload, bad = read_trace(
        path, skip_bad=skip_bad, hit_ratio=hit_ratio, hash_block_tokens=hash_block_tokens
    )
    if bad:
        typer.echo(f"skipped {_n(bad)} bad line(s) in {path}", err=True)
    return workload.with_demand_scale(demand_scale), bad


_KERNELS_HELP = (
    "first-principles, or aiconfigurator: NVIDIA AIConfigurator's measured all-to-all and MoE "
    "GEMM times where they cover a unit (h100, h200; pip install 'moeinfra[aic]')."
)


def _kernel_tables(kernels: str, calibration: str, hardware: str):
    """``--kernels`` as KernelTables (None: first principles), refused beside a calibration."""
    from moeinfra.serving.kernels import KERNEL_SOURCES, KernelTables

    if kernels not in KERNEL_SOURCES:
        raise InputError(f"--kernels={kernels!r} must be one of {', '.join(KERNEL_SOURCES)}")
    if kernels == "first-principles":
        return None
    if calibration != "none":
        raise InputError(
            f"--kernels={kernels} replaces the first-principles times a calibration scales: "
            "give --calibration none with it"
        )
    return KernelTables.aiconfigurator(hardware)


MODEL_HELP = (
    "deepseek-v3 (also V3.1-Terminus and R1: the same shape), deepseek-v3.2 (DeepSeek Sparse "
    "Attention: a lightning indexer over the whole context, MLA over the top 2,048 tokens), "
    "deepseek-v4-flash or deepseek-v4-pro (a 128-token window plus compressed entries, FP4 "
    "experts; first principles only: no calibration carries to them), built from DeepSeek's "
    "published config.json [deepseek-v3, or the calibration's]."
)
KV_CACHE_DTYPE_HELP = (
    "KV cache format: bf16, or fp8 as vLLM's and SGLang's --kv-cache-dtype fp8 store it (V3: 576 "
    "bytes per token per layer; V3.2: the 656-byte fp8_ds_mla latent plus a 132-byte FP8 index "
    "key; V4: 584-byte entries, FP8 with BF16 RoPE, and 68-byte FP4 index keys) [bf16]."
)


def _served_model(name: str | None, kv_cache_dtype: str | None, calibration=None):
    """``--model`` / ``--kv-cache-dtype`` as a ModelSpec; None when neither is given (the default:
    DeepSeek-V3, or the calibration's model)."""
    from moeinfra.serving.specs import KV_CACHE_DTYPES, MODELS

    if name is not None and name not in MODELS:
        raise InputError(f"--model={name!r} is not one of {', '.join(MODELS)}")
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InputError(
            f"--kv-cache-dtype={kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if name is None and kv_cache_dtype is None:
        return None
    if name is not None:
        base = MODELS[name]
    else:
        base = MODELS["deepseek-v3"] if calibration is None else calibration.model
    model = base.with_kv_cache_dtype(kv_cache_dtype or "bf16")
    if calibration is not None:
        calibration.with_model(model)  # the same MLA and MoE shape, or a one-line error
    return model


def _model_summary(model) -> dict:
    from moeinfra.serving.perfmodel import V4_ASSUMPTIONS

    out = {
        "name": model.name,
        "kv_cache_dtype": model.kv_cache_dtype,
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "sparse_attention": model.sparse,
    }
    if model.v4:
        out["kv_bytes_per_request"] = model.kv_bytes_per_request
        out["assumed"] = list(V4_ASSUMPTIONS)
    return out


def _model_line(model) -> str:
    from moeinfra.numfmt import format_number

    attention = (
        f"sparse attention (indexer {format_number(model.index_n_heads)} heads x "
        f"{format_number(model.index_head_dim)}, top {format_number(model.index_topk)} tokens)"
        if model.sparse
        else "dense MLA"
    )
    if model.v4:
        attention = (
            f"window {format_number(model.arch.sliding_window)} + compressed entries (CSA top "
            f"{format_number(model.index_topk)}, HCA all)"
        )
        per_request = f" + {format_number(model.kv_bytes_per_request / 1e6)} MB per request"
    else:
        per_request = ""
    return (
        f"model {model.name}: {attention}; KV cache {model.kv_cache_dtype}, "
        f"{format_number(model.kv_bytes_per_token)} bytes per token{per_request}"
    )


_SKIP_BAD_HELP = (
    "Skip and count malformed trace lines (a request longer than the model's context is not "
    "malformed: it is refused and counted as rejected, as a server would)."
)
_DEMAND_SCALE_HELP = (
    "Multiply the demand: each request of the trace (or of the generated day) stands for this many."
)


def _hourly_csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


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
    demand_scale: float = typer.Option(1.0, "--demand-scale", help=_DEMAND_SCALE_HELP),
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
    skip_bad: bool = typer.Option(False, "--skip-bad", help=_SKIP_BAD_HELP),
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
    kernels: str = typer.Option("first-principles", "--kernels", help=_KERNELS_HELP),
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
    calibration = _calibration_name(calibration, hardware, kernels, model)
    tables = _kernel_tables(kernels, calibration, hardware)
    cal = _calibration(calibration)
    served = _served_model(model, kv_cache_dtype, cal)
    tick_s = parse_duration_s(tick, "--tick")
    if not tick_s > 0:
        raise InputError(f"--tick={tick!r} must be a duration > 0")
    slo_tpot_s = None if slo_tpot is None else parse_duration_s(slo_tpot, "--slo-tpot")
    slo_ttft_s = None if slo_ttft_p95 is None else parse_duration_s(slo_ttft_p95, "--slo-ttft-p95")
    if out is not None:
        output_folder(out, "--out")  # before the simulation, not after it
    if workload is not None:
        trace, bad = _load_workload(workload, skip_bad, hit_ratio, hash_block_tokens, demand_scale)
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
    payload["calibration"] = _calibration_summary(cal)
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
        write_text_atomic(out / "hourly.csv", _hourly_csv(result.hourly))
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
        title=f"{payload['workload']} on {payload['hardware']} ({_n(payload['hours'])} h, "
        f"calibration {'none' if cal is None else cal.name})"
    )
    spread = payload["ranges"] if runs == 3 else None

    def span(key: str, unit: float = 1.0) -> str:
        lo, hi = (spread or {}).get(key, (None, None))
        return "" if lo is None else f"{_n(lo * unit)} - {_n(hi * unit)}"

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
            cells = [_n(simulated), _n(published), _signed_percent(diff)]
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
            table.add_row(key, _n(payload[key]), *([span(key)] if spread else []))
    console.print(table)
    if served is not None:
        console.print(_model_line(served))
    req = payload["requests"]
    ttft_range = span("ttft_p95_s")
    tpot_range = span("tpot_p95_s", 1e3)
    refused = {k: v for k, v in payload["rejected_by_reason"].items() if v}
    console.print(
        f"requests: {_n(req['arrived'])} arrived = {_n(req['completed'])} completed + "
        f"{_n(req['running'])} running + {_n(req['rejected'])} rejected"
        + (
            " (" + ", ".join(f"{reason}: {_n(count)}" for reason, count in refused.items()) + ")"
            if refused
            else ""
        )
        + f"; TTFT p95 {_n(payload['ttft_s'].get('p95', float('nan')))} s"
        + (f" ({ttft_range})" if ttft_range else "")
        + f", TPOT p95 {_n(payload['tpot_s'].get('p95', float('nan')) * 1e3)} ms"
        + (f" ({tpot_range})" if tpot_range else "")
        + f", inter-token latency p99 {_n(payload['itl_s'].get('p99', float('nan')) * 1e3)} ms"
    )


def _lengths(text: str | None, max_context: int | None = None):
    """``--lengths IN:OUT`` as a LengthModel (None: the published one) of requests up to
    ``max_context`` tokens (default 128K; DeepSeek-V4's 1M)."""
    from moeinfra.serving.workload import MAX_CONTEXT_TOKENS, LengthModel

    if text is None:
        return None
    longest = max_context or MAX_CONTEXT_TOKENS
    try:
        mean_in, mean_out = (float(x) for x in text.split(":"))
    except ValueError:
        mean_in = mean_out = float("nan")
    if not all(np.isfinite(v) and 1 <= v < longest for v in (mean_in, mean_out)):
        raise InputError(
            f"--lengths={text!r} must be IN:OUT, mean prompt and answer tokens in [1, {longest})"
        )
    return LengthModel(mean_in, mean_out, max_context=longest)


def _node_list(text: str, option: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise InputError(f"{option}={text!r} must be whole numbers >= 1, comma-separated")
    return tuple(sorted({int(p) for p in parts}))


_MTP_NAMES = ("--mtp-acceptance", "--mtp")
MTP_HELP = (
    "Share of first MTP drafts accepted (DeepSeek-V3: 0.85-0.9; 0: off), or where it was "
    "measured: a /metrics file or http(s):// URL of moeinfra serve up run with "
    "--speculative-tokens (accepted position-0 drafts / verification rounds with drafts)."
)


def _mtp(value: str):
    """``--mtp-acceptance`` as a :class:`~moeinfra.serving.mtp_acceptance.MtpAcceptance`."""
    from moeinfra.serving.mtp_acceptance import read_mtp_acceptance

    return read_mtp_acceptance(value, "--mtp-acceptance")


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
        *_MTP_NAMES,
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
    skip_bad: bool = typer.Option(False, "--skip-bad", help=_SKIP_BAD_HELP),
    hit_ratio: float = typer.Option(
        0.0, "--hit-ratio", help="Cache-hit share for traces without hash_ids."
    ),
    demand_scale: float = typer.Option(1.0, "--demand-scale", help=_DEMAND_SCALE_HELP),
    calibration: str | None = typer.Option(None, "--calibration", help=CALIBRATION_HELP),
    kernels: str = typer.Option("first-principles", "--kernels", help=_KERNELS_HELP),
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
    mbs = _node_list(micro_batches, "--micro-batches")
    if not set(mbs) <= {1, 2}:
        raise InputError(f"--micro-batches={micro_batches!r}: allowed 1, 2 or 1,2")
    mtp_measured = _mtp(mtp)
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
    calibration = _calibration_name(calibration, hardware, kernels, model)
    tables = _kernel_tables(kernels, calibration, hardware)
    cal = _calibration(calibration)
    served = _served_model(model, kv_cache_dtype, cal)
    shapes = candidate_shapes(
        modes=chosen_modes,
        nodes={
            "prefill": _node_list(prefill_nodes, "--prefill-nodes"),
            "decode": _node_list(decode_nodes, "--decode-nodes"),
            "colocated": _node_list(colocated_nodes, "--colocated-nodes"),
        },
        micro_batches=mbs,
        mtp_acceptance=mtp,
        max_batch_per_gpu=tuple(limits),
        gpus_per_node=hw.gpus_per_node,
        routed_experts=(served or (DEEPSEEK_V3 if cal is None else cal.model)).num_routed_experts,
    )
    if workload is not None:
        trace, _ = _load_workload(workload, skip_bad, hit_ratio, demand_scale=demand_scale)
        source = str(workload)
    elif demand is not None:
        check_positive(demand, "--demand")
        context = served.max_context_tokens if served is not None else None
        trace = constant_demand(
            demand * demand_scale, hours, scale, lengths=_lengths(lengths, context)
        )
        source = f"{_n(demand * demand_scale)} output tokens/s"
    else:
        trace = deepseek_day(scale=scale, hours=hours, demand_scale=demand_scale)
        source = f"DeepSeek's day, first {_n(hours)} h"
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
        "calibration": _calibration_summary(cal),
        "kernels": kernels,
        "ranges": None if cal is None else ranges(plan_figures(result), *bound_figures),
        "range_method": range_method(cal is not None, bool(bound_figures))
        + ("" if cal is None else "; null: at that bound no candidate meets the SLOs"),
        "step_time_bounds": bounds or None,
        "model": _model_summary(served or (DEEPSEEK_V3 if cal is None else cal.model)),
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
        return "-" if value is None else _n(value * 1e3)

    table = Table(
        title=f"shapes searched for {source} ({_n(payload['hours'])} h); p95 figures, "
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
            _n(s.nodes),
            _n(s.redundant_experts),
            _n(s.micro_batches),
            *((_n(s.mtp_acceptance) if s.mtp_acceptance else "off",) if with_mtp else ()),
            *(
                ("none" if s.max_batch_per_gpu is None else _n(s.max_batch_per_gpu),)
                if with_limit
                else ()
            ),
            _n(o.units),
            ms(o.ttft_p95_s),
            ms(o.tpot_p95_s),
            "met" if o.meets_slo else "missed",
            _n(o.cost_usd),
        )
    console = Console()
    console.print(table)
    if pruned:
        console.print(
            f"{_n(pruned)} more shapes not simulated: their lower bound already costs more than "
            "the best found (--json lists them)"
        )
    if result.unfit:
        console.print(
            f"left out {_n(len(result.unfit))} shapes that do not fit in HBM, e.g. "
            f"{result.unfit[0]}"
        )
    refused = {k: v for k, v in payload.get("rejected_by_reason", {}).items() if v}
    if refused:
        console.print(
            "refused on arrival, not planned for: "
            + ", ".join(f"{_n(count)} ({reason})" for reason, count in refused.items())
        )
    if result.mode == "aggregated":
        c = result.colocated
        fleet = f"{_n(c.units)} x {_n(c.shape.nodes)}-node aggregated units"
    else:
        p, d = result.prefill, result.decode
        fleet = (
            f"{_n(p.units)} x {_n(p.shape.nodes)}-node prefill + {_n(d.units)} x "
            f"{_n(d.shape.nodes)}-node decode"
        )
    other = (
        f"; the best aggregated fleet costs ${_n(result.colocated.cost_usd)}"
        if result.mode == "disaggregated" and result.colocated is not None
        else (
            f"; the best disaggregated fleet costs ${_n(result.disaggregated_cost_usd)}"
            if result.mode == "aggregated" and np.isfinite(result.disaggregated_cost_usd)
            else ""
        )
    )
    if served is not None:
        console.print(_model_line(served))
    console.print(f"cheapest: {fleet} = {_n(result.nodes)} nodes, ${_n(result.cost_usd)}{other}")
    if bound_figures:
        (n_lo, n_hi), (c_lo, c_hi) = payload["ranges"]["nodes"], payload["ranges"]["cost_usd"]
        console.print(
            "range (calibration residuals): "
            + (
                "at the slow bound no candidate meets the SLOs"
                if n_lo is None
                else f"{_n(n_lo)} - {_n(n_hi)} nodes, ${_n(c_lo)} - ${_n(c_hi)}"
            )
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
        "0", *_MTP_NAMES, metavar="ACCEPTANCE|METRICS", help="Multi-token prediction. " + MTP_HELP
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

    counts = _node_list(nodes, "--nodes")
    check_positive(kv, "--kv")
    mtp_measured = _mtp(mtp)
    mtp = mtp_measured.acceptance
    if out is not None:
        output_folder(out, "--out")
    cal = _calibration(_calibration_name(calibration, hardware, model=model))
    served = _served_model(model, kv_cache_dtype, cal)
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
        "calibration": _calibration_summary(cal),
        "deepseek_published": DEEPSEEK_DECODE_POINT,
        "best_at_deepseek_speed": None if best is None else best.to_dict(),
        "model": _model_summary(spec),
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
            f"decode frontier on {hw.name}, mean KV {_n(kv)}"
            + (f", MTP {_n(mtp)}" if mtp else "")
            + f" (calibration {'none' if cal is None else cal.name})",
        )
    if as_json:
        typer.echo(json.dumps(payload, indent=2))
        return
    table = Table(
        title=f"decode frontier on {hw.name} at mean KV {_n(kv)} tokens (calibration "
        f"{'none' if cal is None else cal.name})"
    )
    for col in ("nodes", "micro-batches", "requests/GPU", "tokens/s per user", "tokens/s per GPU"):
        table.add_column(col, justify="right")
    for p in front.pareto[:: max(1, len(front.pareto) // 12)]:
        table.add_row(
            _n(p.nodes),
            _n(p.micro_batches),
            _n(p.batch_per_gpu),
            _n(p.tokens_per_s_per_user),
            _n(p.tokens_per_s_per_gpu),
        )
    console = Console()
    console.print(table)
    if served is not None:
        console.print(_model_line(served))
    if mtp:
        console.print(mtp_measured.describe())
    for reason in front.unfit:
        console.print(f"left out: {reason}")
    if best is not None:
        console.print(
            f"at {_n(speed)} tokens/s per user: {_n(best.nodes)}-node units, "
            f"{_n(best.batch_per_gpu)} requests/GPU, {_n(best.tokens_per_s_per_gpu)} tokens/s per "
            f"GPU (DeepSeek published {_n(DEEPSEEK_DECODE_POINT['tokens_per_s_per_gpu'])} on "
            "18-node H800 units)"
        )


@app.command("model")
def model_cmd(
    phase: str = typer.Option("decode", "--phase", help="prefill or decode."),
    hardware: str = typer.Option("h800", "--hardware", help="h800, h100, h200 or b200."),
    nodes: int | None = typer.Option(None, "--nodes", help="Nodes per unit (default 4 / 18)."),
    redundant: int | None = typer.Option(
        None,
        "--redundant-experts",
        help="Redundant expert slots [the fewest >= 32 that fill every GPU equally: 32 on 4 or "
        "18 nodes, 64 on 8].",
    ),
    tokens_per_gpu: int = typer.Option(16_384, "--tokens-per-gpu", help="Prefill tokens per GPU."),
    batch: float = typer.Option(64.0, "--batch", help="Decode requests per GPU."),
    kv: float = typer.Option(4_989.0, "--kv", help="Decode mean KV length (tokens)."),
    prompt_len: float = typer.Option(
        4096.0, "--prompt-len", help="Prefill prompt length (tokens): attention and LM-head rows."
    ),
    micro_batches: int | None = typer.Option(
        None,
        "--micro-batches",
        help="2: dual micro-batch overlap (DeepSeek's, the default); 1: no overlap.",
    ),
    mtp: str | None = typer.Option(
        None,
        *_MTP_NAMES,
        metavar="ACCEPTANCE|METRICS",
        help="--phase decode: each step verifies a draft per request and yields 1 + acceptance "
        "tokens. " + MTP_HELP,
    ),
    calibration: str | None = typer.Option(None, "--calibration", help=CALIBRATION_HELP),
    kernels: str = typer.Option("first-principles", "--kernels", help=_KERNELS_HELP),
    model: str | None = typer.Option(None, "--model", help=MODEL_HELP),
    kv_cache_dtype: str | None = typer.Option(None, "--kv-cache-dtype", help=KV_CACHE_DTYPE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Per-layer time breakdown of one step of one prefill or decode unit (decode with MTP:
    --mtp-acceptance)."""
    from moeinfra.serving.mtp_acceptance import MtpAcceptance
    from moeinfra.serving.perfmodel import PerfModel
    from moeinfra.serving.specs import DEEPSEEK_V3, Deployment, fitting_redundant_experts
    from moeinfra.serving.specs import hardware as hardware_spec

    if phase not in ("prefill", "decode"):
        raise InputError(f"--phase {phase!r} must be prefill or decode")
    if not (np.isfinite(prompt_len) and prompt_len >= 1):
        raise InputError(f"--prompt-len={prompt_len} must be a finite number >= 1")
    if nodes is not None and nodes < 1:
        raise InputError(f"--nodes={nodes} must be >= 1")
    if redundant is not None and redundant < 0:
        raise InputError(f"--redundant-experts={redundant} must be >= 0")
    if tokens_per_gpu < 1:
        raise InputError(f"--tokens-per-gpu={tokens_per_gpu} must be >= 1")
    if micro_batches not in (None, 1, 2):
        raise InputError(f"--micro-batches={micro_batches} must be 1 or 2")
    if mtp is not None and phase == "prefill":
        raise InputError(
            f"--mtp-acceptance={mtp} applies to --phase decode only (prefill does not draft)"
        )
    mtp_measured = None if mtp is None else _mtp(mtp)
    acceptance = 0.0 if mtp_measured is None else mtp_measured.acceptance
    calibration = _calibration_name(calibration, hardware, kernels, model)
    tables = _kernel_tables(kernels, calibration, hardware)
    check_positive(batch, "--batch")
    check_positive(kv, "--kv", at_least_zero=True)
    cal = _calibration(calibration)
    served = _served_model(model, kv_cache_dtype, cal)
    unit_nodes = nodes or (4 if phase == "prefill" else 18)
    hw_spec = None if cal is not None else hardware_spec(hardware)
    if redundant is None:
        hw_used, spec = (
            (hw_spec, served or DEEPSEEK_V3) if cal is None else (cal.hardware, cal.model)
        )
        redundant = fitting_redundant_experts(
            unit_nodes, hw_used.gpus_per_node, spec.num_routed_experts
        )
    dep = Deployment(
        phase,
        unit_nodes,
        redundant,
        micro_batches or 2,
        tokens_per_gpu=tokens_per_gpu,
        mtp_acceptance=acceptance,
    )
    if cal is None:
        perf = PerfModel(dep, hw_spec, served or DEEPSEEK_V3, kernels=tables)
    else:
        if nodes is None and phase in cal.units:
            dep = cal.units[phase]
        if micro_batches is not None:
            dep = dep.with_(micro_batches=micro_batches)
        if mtp_measured is not None:
            dep = dep.with_(mtp_acceptance=acceptance)
        perf = (cal if served is None else cal.with_model(served)).perf_model(dep)
        hardware = cal.hardware.name
    perf.check_fits()
    memory = perf.memory_use()
    if phase == "prefill":
        b = perf.prefill_breakdown(
            attn_keys_per_token=min(prompt_len, tokens_per_gpu) / 2, prompt_len=prompt_len
        )
        tokens_per_s = b.tokens_per_gpu * perf.gpus / b.step_s
    else:
        b = perf.decode_breakdown(batch, kv)
        # with MTP a step verifies a draft per request and yields 1 + acceptance tokens
        tokens_per_s = batch * perf.gpus * dep.tokens_per_step / b.step_s
    payload = {
        "phase": phase,
        "hardware": hardware,
        "calibration": _calibration_summary(cal),
        "kernels": kernels,
        "kernel_sources": b.sources,
        "nodes": dep.nodes,
        "gpus": perf.gpus,
        "micro_batches": dep.micro_batches,
        "step_ms": b.step_s * 1e3,
        "head_ms": b.head_s * 1e3,
        "overhead_ms": b.overhead_s * 1e3,
        "tokens_per_gpu": b.tokens_per_gpu,
        "tokens_per_s_per_node": tokens_per_s / dep.nodes,
        "expert_imbalance": perf.balance.imbalance,
        "kv_capacity_tokens_per_gpu": perf.kv_capacity_tokens_per_gpu,
        "memory_gb_per_gpu": {
            "weights": memory.weights / 1e9,
            "activations": memory.activations / 1e9,
            "kv_one_full_context_request": memory.kv_one_request / 1e9,
            "usable": memory.usable / 1e9,
        },
        "layers": b.rows(),
    }
    if served is not None:
        payload["model"] = _model_summary(served)
    if phase == "decode":
        payload["output_tokens_per_s_per_request"] = dep.tokens_per_step / b.step_s
        payload["output_tokens_per_step_per_request"] = dep.tokens_per_step
        if dep.mtp_acceptance and mtp_measured is None:  # a calibration's unit drafting
            mtp_measured = MtpAcceptance(dep.mtp_acceptance, f"calibration {calibration}")
        payload["mtp"] = mtp_measured.to_dict() if dep.mtp_acceptance else None
    if as_json:
        typer.echo(json.dumps(payload, indent=2))
        return
    per_request = (
        f", {_n(payload['output_tokens_per_s_per_request'])} tokens/s per request"
        if phase == "decode"
        else ""
    )
    table = Table(
        title=f"{phase} step on {_n(dep.nodes)} x {hardware}: {_n(b.step_s * 1e3)} ms, "
        f"{_n(payload['tokens_per_s_per_node'])} tokens/s per node{per_request}"
    )
    m = perf.model
    dense_i, moe_i = 0, m.num_dense_layers
    table.add_column("ms per layer (both micro-batches)")
    columns = []
    if m.num_dense_layers:
        table.add_column(f"dense x{m.num_dense_layers}", justify="right")
        columns.append(dense_i)
    if m.v4:  # one column per layer kind, its first layer
        kinds = m.layer_kinds()
        for kind in dict.fromkeys(kinds):
            table.add_column(f"{kind.replace('_', ' ')} x{kinds.count(kind)}", justify="right")
            columns.append(kinds.index(kind))
    elif m.num_moe_layers:
        table.add_column(f"MoE x{m.num_moe_layers}", justify="right")
        columns.append(moe_i)
    series = dict(b.parts) | {"compute path": b.compute, "comm path": b.comm, "layer": b.layer}
    for name, values in series.items():
        table.add_row(name, *(_n(values[i] * 1e3) for i in columns))
    console = Console()
    console.print(table)
    console.print(
        f"head {_n(b.head_s * 1e3)} ms; host and launch overhead {_n(b.overhead_s * 1e3)} ms; "
        f"expert imbalance {_n(perf.balance.imbalance)}; calibration "
        f"{'none' if cal is None else cal.name}; kernels {kernels}"
    )
    console.print(f"memory per GPU: {memory.describe()}")
    if payload.get("mtp"):
        console.print(
            f"{mtp_measured.describe()}: {_n(dep.tokens_per_step)} tokens per request per step, "
            "the MTP module as one more MoE layer and two query tokens per request"
        )
    if served is not None:
        console.print(_model_line(served))
    for part, source in b.sources.items():
        console.print(f"{part}: {source}")


_POSITIONS_K = (2, 4, 8, 16, 32, 64, 96, 128)


@app.command("position-cost")
def position_cost_cmd(
    hardware: str = typer.Option("h800", "--hardware", help="h800, h100, h200 or b200."),
    gpu_hour_usd: float | None = typer.Option(
        None, "--gpu-hour-usd", help="GPU-hour price (default: the hardware preset's; H800 $2)."
    ),
    kv_cache_dtype: str = typer.Option(
        "fp8",
        "--kv-cache-dtype",
        help="DeepSeek-V3.2's KV cache: fp8 (as DeepSeek's sparse decoding kernel and vLLM/SGLang "
        "store it) or bf16; V3.1-Terminus keeps BF16, as FlashMLA's dense decoding kernel reads it.",
    ),
    mtp: str = typer.Option(
        "0.85",
        *_MTP_NAMES,
        metavar="ACCEPTANCE|METRICS",
        help="Decode with MTP (default 0.85: DeepSeek's service verifies one draft per request, "
        "FlashMLA's production case s_q = 2; the V3.2 / V3.1 ratio does not depend on it). "
        + MTP_HELP,
    ),
    decode_batch: float = typer.Option(
        128.0, "--decode-batch", help="Decode requests per GPU the step is shared by."
    ),
    calibration: str | None = typer.Option(None, "--calibration", help=CALIBRATION_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Cost per million tokens by token position, DeepSeek-V3.1-Terminus (dense MLA) against
    DeepSeek-V3.2 (sparse attention), prefill and decode, beside the curve DeepSeek published
    (V3.2-Exp report, Figure 3: H800, $2 per GPU-hour)."""
    from moeinfra.numfmt import format_number, percent
    from moeinfra.serving.position_cost import compare_with_published, published_cost_by_position
    from moeinfra.serving.specs import DEEPSEEK_V3, KV_CACHE_DTYPES, priced_hardware

    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InputError(
            f"--kv-cache-dtype={kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
        )
    mtp_measured = _mtp(mtp)
    mtp = mtp_measured.acceptance
    check_positive(decode_batch, "--decode-batch")
    check_positive(gpu_hour_usd, "--gpu-hour-usd", at_least_zero=True)
    cal = _calibration(_calibration_name(calibration, hardware))
    if cal is None:
        hw, eff = priced_hardware(hardware, gpu_hour_usd), None
    else:
        cal.with_model(DEEPSEEK_V3)  # its factors carry to V3 and V3.2, or a one-line error
        hw = cal.hardware
        if gpu_hour_usd is not None:
            hw = replace(hw, gpu_hour_usd=gpu_hour_usd)
        eff = cal.efficiency()
    compared = compare_with_published(
        _POSITIONS_K,
        v32_kv_cache_dtype=kv_cache_dtype,
        mtp_acceptance=mtp,
        hw=hw,
        decode_batch_per_gpu=decode_batch,
        **({} if eff is None else {"eff": eff}),
    )
    source = published_cost_by_position()["source"]
    payload = {
        "hardware": hw.name,
        "gpu_hour_usd": hw.gpu_hour_usd,
        "calibration": _calibration_summary(cal),
        "v3.2_kv_cache_dtype": kv_cache_dtype,
        "mtp_acceptance": mtp,
        "mtp": mtp_measured.to_dict() if mtp else None,
        "decode_batch_per_gpu": decode_batch,
        "usd_per_million_tokens": compared,
        "published_source": {k: source[k] for k in ("url", "figure", "uncertainty")},
    }
    if as_json:
        typer.echo(json.dumps(payload, indent=2))
        return
    console = Console()
    for phase, c in compared.items():
        table = Table(
            title=f"{phase}: USD per million tokens by token position on {hw.name} at "
            f"${format_number(hw.gpu_hour_usd)} per GPU-hour"
        )
        table.add_column("position", justify="right")
        for col in ("V3.1-Terminus", "V3.2", "V3.2 / V3.1"):
            table.add_column(f"{col}\nmodel / published", justify="right")
        for i, k in enumerate(c["positions_k"]):
            table.add_row(
                f"{format_number(int(k))}K",
                *(
                    f"{format_number(c[model][i])} / {format_number(c[published][i])}"
                    for model, published in (
                        ("v31_usd", "published_v31_usd"),
                        ("v32_usd", "published_v32_usd"),
                        ("ratio", "published_ratio"),
                    )
                ),
            )
        console.print(table)
    at = {k: i for i, k in enumerate(compared["prefill"]["positions_k"])}
    worst = {
        phase: max(abs(c["model_over_published"][at[k]] - 1) for k in (32.0, 64.0, 128.0))
        for phase, c in compared.items()
    }
    console.print(
        "V3.2 / V3.1 at 32K, 64K and 128K, model against published: worst "
        + ", ".join(f"{phase} {percent(w)} off" for phase, w in worst.items())
        + f"; published points digitised from {source['url']} ({source['figure'].split(',')[0]})"
    )
    if mtp_measured.measured:
        console.print(mtp_measured.describe())
