"""Figures of a simulated day (matplotlib, Agg backend, PNG written atomically)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from moeinfra.atomicio import atomic_path  # noqa: E402
from moeinfra.serving.schedule import FleetSchedule  # noqa: E402
from moeinfra.serving.simulate import SimulationResult  # noqa: E402

CLOCK_START = 12  # the published day starts at 12:00 UTC+8


def _clock_ticks(ax, hours: float) -> None:
    ticks = np.arange(0, hours + 0.01, 3)
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{(CLOCK_START + int(t)) % 24:02d}:00" for t in ticks])


def _save(fig, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_nodes(schedule: FleetSchedule, path: Path) -> Path:
    """Nodes in service over the day, split into prefill and decode (DeepSeek's first chart)."""
    t = np.arange(0.0, schedule.duration_s, 60.0)
    p, d = schedule.at(t)
    hours = t / 3600.0
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.fill_between(hours, 0, d * schedule.decode_nodes, step="post", label="decode", alpha=0.8)
    ax.fill_between(
        hours,
        d * schedule.decode_nodes,
        d * schedule.decode_nodes + p * schedule.prefill_nodes,
        step="post",
        label="prefill",
        alpha=0.8,
    )
    ax.set_ylabel("H800 nodes")
    ax.set_title("Nodes in service (UTC+8)")
    _clock_ticks(ax, schedule.duration_s / 3600.0)
    ax.legend(loc="lower left")
    return _save(fig, path)


def plot_cost_income(result: SimulationResult, path: Path, published: tuple | None = None) -> Path:
    """Cost and theoretical income per hour (DeepSeek's second chart), published income as dots."""
    hours = np.arange(len(result.hourly))
    income = [h["revenue_usd"] for h in result.hourly]
    cost = [h["cost_usd"] for h in result.hourly]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.bar(hours + 0.5, income, width=0.8, label="theoretical income (simulated)", color="#4c8bd6")
    ax.step(
        np.append(hours, hours[-1] + 1),
        np.append(cost, cost[-1]),
        where="post",
        color="#d6604c",
        label="cost",
    )
    if published is not None:
        ax.plot(hours[: len(published)] + 0.5, published, "k.", label="income (published chart)")
    ax.set_ylabel("USD per hour")
    ax.set_title("Cost and theoretical income per hour")
    _clock_ticks(ax, len(hours))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8)
    return _save(fig, path)


def plot_throughput(result: SimulationResult, path: Path) -> Path:
    """Prefill input tokens/s and decode output tokens/s per node, per hour."""
    h = result.hourly
    hours = np.arange(len(h)) + 0.5
    prefill = [x["input_tokens"] / 3600.0 / max(x["prefill_nodes"], 1e-9) for x in h]
    decode = [x["output_tokens"] / 3600.0 / max(x["decode_nodes"], 1e-9) for x in h]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.plot(hours, np.array(prefill) / 1e3, "o-", label="prefill: input tokens/s per node")
    ax.plot(hours, np.array(decode) / 1e3, "s-", label="decode: output tokens/s per node")
    ax.axhline(73.7, ls=":", color="C0")
    ax.axhline(14.8, ls=":", color="C1")
    ax.set_ylabel("thousand tokens/s per node")
    ax.set_title("Throughput per node (dotted: DeepSeek's daily averages)")
    _clock_ticks(ax, len(h))
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_latency(result: SimulationResult, path: Path) -> Path:
    """Distributions of time to first token, of time per output token (per request) and of the
    inter-token latency (per token)."""
    ttft = result.ttft_s[np.isfinite(result.ttft_s)]
    tpot = result.tpot_s[np.isfinite(result.tpot_s)]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(12, 3.4), layout="constrained")
    if ttft.size:
        a.hist(np.clip(ttft, 1e-3, None), bins=np.geomspace(1e-3, max(ttft.max(), 1e-2), 60))
        a.set_xscale("log")
    a.set_xlabel("time to first token (s)")
    a.set_ylabel("requests (sampled)")
    if tpot.size:
        b.hist(tpot * 1e3, bins=60)
    b.set_xlabel("time per output token (ms)")
    b.set_ylabel("requests (sampled)")
    used = np.flatnonzero(result.itl_tokens)
    if used.size:
        span = slice(used[0], used[-1] + 1)
        edges_ms = result.itl_edges_s[span.start : span.stop + 1] * 1e3
        c.stairs(result.itl_tokens[span] / result.itl_tokens.sum(), edges_ms, fill=True)
    c.set_xlabel("inter-token latency (ms)")
    c.set_ylabel("share of output tokens")
    fig.suptitle("Latency distributions")
    return _save(fig, path)
