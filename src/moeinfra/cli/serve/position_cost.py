"""``moeinfra serve position-cost``: the cost of a token by its position in the context."""

from __future__ import annotations

import json
from dataclasses import replace

import typer
from rich.console import Console
from rich.table import Table

from moeinfra.cli.serve import app
from moeinfra.cli.serve.common import (
    CALIBRATION_HELP,
    MTP_HELP,
    MTP_NAMES,
    calibration_name,
    calibration_summary,
    check_positive,
    read_calibration,
    read_mtp,
)
from moeinfra.errors import InputError

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
        *MTP_NAMES,
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
    mtp_measured = read_mtp(mtp)
    mtp = mtp_measured.acceptance
    check_positive(decode_batch, "--decode-batch")
    check_positive(gpu_hour_usd, "--gpu-hour-usd", at_least_zero=True)
    cal = read_calibration(calibration_name(calibration, hardware))
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
        "calibration": calibration_summary(cal),
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
