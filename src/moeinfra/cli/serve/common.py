"""What the ``moeinfra serve`` commands share: option parsers, calibration and workload loading,
number formatting."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
import typer

from moeinfra.cli.options import input_file
from moeinfra.errors import InputError


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


def calibration_name(
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


def num(value) -> str:
    """A number for people (:func:`moeinfra.numfmt.format_number`), ``n/a`` when missing."""
    from moeinfra.numfmt import format_number

    return "n/a" if value is None else format_number(value)


def signed_percent(fraction: float) -> str:
    """``+38%``, ``-0.2%``, ``0%`` (:func:`moeinfra.numfmt.percent` with the sign of a change)."""
    from moeinfra.numfmt import percent

    return ("+" if fraction > 0 else "") + percent(fraction)


def read_calibration(value: str):
    from moeinfra.serving.calibration import BUILTIN, load_calibration

    if value != "none" and value not in BUILTIN:
        allowed = (
            f"allowed: none, {', '.join(BUILTIN)} or a file written by moeinfra serve calibrate"
        )
        input_file(Path(value), "--calibration", allowed)
    return load_calibration(value)


def calibration_summary(calibration) -> dict | str:
    return "none" if calibration is None else calibration.summary()


def load_workload(
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
        typer.echo(f"skipped {num(bad)} bad line(s) in {path}", err=True)
    return workload.with_demand_scale(demand_scale), bad


KERNELS_HELP = (
    "first-principles, or aiconfigurator: NVIDIA AIConfigurator's measured all-to-all and MoE "
    "GEMM times where they cover a unit (h100, h200; pip install 'moeinfra[aic]')."
)


def kernel_tables(kernels: str, calibration: str, hardware: str):
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


def served_model(name: str | None, kv_cache_dtype: str | None, calibration=None):
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


def model_summary(model) -> dict:
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


def model_line(model) -> str:
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


SKIP_BAD_HELP = (
    "Skip and count malformed trace lines (a request longer than the model's context is not "
    "malformed: it is refused and counted as rejected, as a server would)."
)
DEMAND_SCALE_HELP = (
    "Multiply the demand: each request of the trace (or of the generated day) stands for this many."
)


def hourly_csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def length_model(text: str | None, max_context: int | None = None):
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


def node_list(text: str, option: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise InputError(f"{option}={text!r} must be whole numbers >= 1, comma-separated")
    return tuple(sorted({int(p) for p in parts}))


MTP_NAMES = ("--mtp-acceptance", "--mtp")
MTP_HELP = (
    "Share of first MTP drafts accepted (DeepSeek-V3: 0.85-0.9; 0: off), or where it was "
    "measured: a /metrics file or http(s):// URL of moeinfra serve up run with "
    "--speculative-tokens (accepted position-0 drafts / verification rounds with drafts)."
)


def read_mtp(value: str):
    """``--mtp-acceptance`` as a :class:`~moeinfra.serving.mtp_acceptance.MtpAcceptance`."""
    from moeinfra.serving.mtp_acceptance import read_mtp_acceptance

    return read_mtp_acceptance(value, "--mtp-acceptance")
