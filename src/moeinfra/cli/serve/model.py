"""``moeinfra serve model``: the per-layer performance model of a unit."""

from __future__ import annotations

import json

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from moeinfra.cli.serve import app
from moeinfra.cli.serve.common import (
    CALIBRATION_HELP,
    KERNELS_HELP,
    KV_CACHE_DTYPE_HELP,
    MODEL_HELP,
    MTP_HELP,
    MTP_NAMES,
    calibration_name,
    calibration_summary,
    check_positive,
    kernel_tables,
    model_line,
    model_summary,
    num,
    read_calibration,
    read_mtp,
    served_model,
)
from moeinfra.errors import InputError


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
        *MTP_NAMES,
        metavar="ACCEPTANCE|METRICS",
        help="--phase decode: each step verifies a draft per request and yields 1 + acceptance "
        "tokens. " + MTP_HELP,
    ),
    calibration: str | None = typer.Option(None, "--calibration", help=CALIBRATION_HELP),
    kernels: str = typer.Option("first-principles", "--kernels", help=KERNELS_HELP),
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
    mtp_measured = None if mtp is None else read_mtp(mtp)
    acceptance = 0.0 if mtp_measured is None else mtp_measured.acceptance
    calibration = calibration_name(calibration, hardware, kernels, model)
    tables = kernel_tables(kernels, calibration, hardware)
    check_positive(batch, "--batch")
    check_positive(kv, "--kv", at_least_zero=True)
    cal = read_calibration(calibration)
    served = served_model(model, kv_cache_dtype, cal)
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
        "calibration": calibration_summary(cal),
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
        payload["model"] = model_summary(served)
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
        f", {num(payload['output_tokens_per_s_per_request'])} tokens/s per request"
        if phase == "decode"
        else ""
    )
    table = Table(
        title=f"{phase} step on {num(dep.nodes)} x {hardware}: {num(b.step_s * 1e3)} ms, "
        f"{num(payload['tokens_per_s_per_node'])} tokens/s per node{per_request}"
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
        table.add_row(name, *(num(values[i] * 1e3) for i in columns))
    console = Console()
    console.print(table)
    console.print(
        f"head {num(b.head_s * 1e3)} ms; host and launch overhead {num(b.overhead_s * 1e3)} ms; "
        f"expert imbalance {num(perf.balance.imbalance)}; calibration "
        f"{'none' if cal is None else cal.name}; kernels {kernels}"
    )
    console.print(f"memory per GPU: {memory.describe()}")
    if payload.get("mtp"):
        console.print(
            f"{mtp_measured.describe()}: {num(dep.tokens_per_step)} tokens per request per step, "
            "the MTP module as one more MoE layer and two query tokens per request"
        )
    if served is not None:
        console.print(model_line(served))
    for part, source in b.sources.items():
        console.print(f"{part}: {source}")
