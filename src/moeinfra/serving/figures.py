"""Figures of a simulated day (matplotlib, Agg backend, PNG written atomically)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from moeinfra.atomicio import atomic_path  # noqa: E402
from moeinfra.numfmt import format_number  # noqa: E402
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
    ax.set_ylim(0, None)
    ax.set_title("Nodes in service (UTC+8)")
    _clock_ticks(ax, schedule.duration_s / 3600.0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # beside the curve
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
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_number(v)))
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
    ax.set_ylim(0, None)
    ax.set_title("Throughput per node (dotted: DeepSeek's daily averages)")
    _clock_ticks(ax, len(h))
    ax.legend(fontsize=8, loc="center right")
    return _save(fig, path)


def data_range(
    values: np.ndarray,
    weights: np.ndarray | None = None,
    *,
    quantiles: tuple[float, float] = (0.005, 0.995),
    margin: float = 0.05,
    log_ratio: float = 10.0,
) -> tuple[float, float, bool]:
    """Axis limits that fit ``values [n]`` (each weighing ``weights [n]``, default 1): from the
    ``quantiles`` of the data widened by ``margin`` of the span on each side (of the log span on a
    log axis), and whether to use a log axis — only when the data span more than ``log_ratio`` (a
    decade by default) and are positive. Returns ``(low, high, log)`` in the units of ``values``."""
    values = np.asarray(values, dtype=np.float64)
    w = np.ones_like(values) if weights is None else np.asarray(weights, dtype=np.float64)
    keep = np.isfinite(values) & (w > 0)
    values, w = values[keep], w[keep]
    if values.size == 0:
        return 0.0, 1.0, False
    order = np.argsort(values)
    values, cumulative = values[order], np.cumsum(w[order]) / w.sum()
    lo = float(values[min(np.searchsorted(cumulative, quantiles[0]), values.size - 1)])
    hi = float(values[min(np.searchsorted(cumulative, quantiles[1]), values.size - 1)])
    log = lo > 0 and hi / lo > log_ratio
    if log:
        pad = (np.log10(hi) - np.log10(lo)) * margin
        return lo / 10**pad, hi * 10**pad, True
    pad = (hi - lo) * margin if hi > lo else max(abs(hi) * margin, 1e-12)
    return lo - pad, hi + pad, False


def _histogram(ax, values: np.ndarray, unit: str, what: str, noun: str) -> None:
    """Histogram of ``values`` as % of the total on an axis fitted by :func:`data_range`; what falls
    outside is counted in a note instead of stretching the axis."""
    lo, hi, log = data_range(values)
    edges = np.geomspace(lo, hi, 61) if log else np.linspace(lo, hi, 61)
    ax.hist(values, bins=edges, weights=np.full(values.size, 100.0 / values.size))
    if log:
        _log_axis(ax)
    ax.set_xlim(lo, hi)
    ax.set_xlabel(f"{what} ({unit}{', log scale' if log else ''})")
    ax.set_ylabel(f"% of {noun}")
    _outside_note(ax, values < lo, values > hi, values, unit, noun)


def _log_axis(ax) -> None:
    """A log x axis labelled at 1, 2 and 5 times the powers of ten, in plain numbers."""
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_number(v)))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _outside_note(ax, below, above, values, unit: str, noun: str, weights=None) -> None:
    w = np.ones(len(values)) if weights is None else weights
    total = w.sum()
    notes = []
    if w[below].sum():
        notes.append(
            f"{100 * w[below].sum() / total:.2g}% below (min {format_number(values[below].min())} {unit})"
        )
    if w[above].sum():
        notes.append(
            f"{100 * w[above].sum() / total:.2g}% beyond (max {format_number(values[above].max())} {unit})"
        )
    if notes:
        ax.text(
            0.98,
            0.97,
            "not shown:\n" + "\n".join(notes),
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize=7,
            color="#555555",
        )


def latency_figure(
    ttft_s: np.ndarray, tpot_s: np.ndarray, itl_edges_s: np.ndarray, itl_tokens: np.ndarray
):
    """The matplotlib Figure :func:`plot_latency` saves: histograms of time to first token
    (``ttft_s [requests]``, s), time per output token (``tpot_s [requests]``, s, drawn in ms) and
    inter-token latency (``itl_tokens [b]`` tokens between ``itl_edges_s [b + 1]``, s, drawn in
    ms), each as % of its total, each x axis fitted to its data by :func:`data_range` (log only where
    the data span more than a decade). Non-finite values (requests without a token) are left out."""
    ttft = ttft_s[np.isfinite(ttft_s)]
    tpot_ms = tpot_s[np.isfinite(tpot_s)] * 1e3
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(12, 3.4), layout="constrained")
    if ttft.size:
        _histogram(a, ttft, "s", "time to first token", "requests")
    else:
        a.set_xlabel("time to first token (s)")
    if tpot_ms.size:
        _histogram(b, tpot_ms, "ms", "time per output token", "requests")
    else:
        b.set_xlabel("time per output token (ms)")
    tokens = np.asarray(itl_tokens, dtype=np.float64)
    if tokens.sum() > 0:
        edges_ms = np.asarray(itl_edges_s, dtype=np.float64) * 1e3
        centres = (
            np.sqrt(edges_ms[:-1] * edges_ms[1:])
            if edges_ms[0] > 0
            else (edges_ms[:-1] + edges_ms[1:]) / 2
        )
        lo, hi, log = data_range(centres, tokens)
        inside = (edges_ms[1:] > lo) & (edges_ms[:-1] < hi)
        span = np.flatnonzero(inside)
        c.stairs(100.0 * tokens[span] / tokens.sum(), edges_ms[span[0] : span[-1] + 2], fill=True)
        if log:
            _log_axis(c)
        c.set_xlim(lo, hi)
        used = tokens > 0
        _outside_note(
            c,
            (edges_ms[1:] <= lo)[used],
            (edges_ms[:-1] >= hi)[used],
            centres[used],
            "ms",
            "tokens",
            tokens[used],
        )
        c.set_xlabel(f"inter-token latency (ms{', log scale' if log else ''})")
    else:
        c.set_xlabel("inter-token latency (ms)")
    c.set_ylabel("% of output tokens")
    fig.suptitle("Latency distributions (axes fitted to the 0.5th-99.5th percentile)")
    return fig


def plot_latency(result: SimulationResult, path: Path) -> Path:
    """Distributions of time to first token, of time per output token (per request) and of the
    inter-token latency (per token): :func:`latency_figure` of ``result``, saved to ``path``."""
    fig = latency_figure(result.ttft_s, result.tpot_s, result.itl_edges_s, result.itl_tokens)
    return _save(fig, path)


def plot_frontier(frontier, path: Path, published: dict | None = None, title: str = "") -> Path:
    """:func:`frontier_figure`, written to ``path`` (PNG)."""
    return _save(frontier_figure(frontier, published, title), path)


def frontier_figure(frontier, published: dict | None = None, title: str = ""):
    """Output tokens/s per GPU against tokens/s per user: one line per decode unit shape (its batch
    growing to the left), the Pareto frontier in black, and ``published`` (a point) as a star."""
    fig, ax = plt.subplots(figsize=(7.5, 5))
    shapes = sorted({(p.nodes, p.micro_batches) for p in frontier.points})
    for nodes, mb in shapes:
        pts = [p for p in frontier.points if (p.nodes, p.micro_batches) == (nodes, mb)]
        ax.plot(
            [p.tokens_per_s_per_user for p in pts],
            [p.tokens_per_s_per_gpu for p in pts],
            lw=1.2,
            ls="-" if mb == 2 else ":",
            label=f"{nodes} node{'s' if nodes > 1 else ''} (EP{nodes * 8}), {mb} micro-batch"
            + ("es" if mb > 1 else ""),
        )
    ax.plot(
        [p.tokens_per_s_per_user for p in frontier.pareto],
        [p.tokens_per_s_per_gpu for p in frontier.pareto],
        color="black",
        lw=2.5,
        alpha=0.6,
        label="frontier",
    )
    if published:
        ax.plot(
            published["tokens_per_s_per_user"],
            published["tokens_per_s_per_gpu"],
            marker="*",
            ms=14,
            color="crimson",
            ls="none",
            label="DeepSeek published (EP144, H800)",
        )
    ax.set_xlabel("output tokens/s per user")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title or f"decode frontier at mean KV {frontier.mean_kv:,.0f} tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    return fig


PHASE_COLOURS = {"prefill": "tab:blue", "decode": "tab:orange", "colocated": "tab:green"}


def plot_plan(plan, path: Path, title: str = "") -> Path:
    """:func:`plan_figure`, written to ``path`` (PNG)."""
    return _save(plan_figure(plan, title), path)


def plan_figure(plan, title: str = ""):
    """Every shape the planner tried, by phase, as the cost of the fewest units meeting its SLOs:
    solid where they do, hatched where no unit count up to the limit does, an outline at the lower
    bound where it was pruned; the chosen fleet's shapes edged in black."""
    chosen = [plan.colocated] if plan.mode == "aggregated" else [plan.prefill, plan.decode]
    order = {"prefill": 0, "decode": 1, "colocated": 2}
    rows = sorted(plan.options, key=lambda o: (order[o.phase], o.cost_usd))
    fig, ax = plt.subplots(figsize=(8.5, 0.25 * len(rows) + 1.4))
    labels = []
    for y, o in enumerate(rows):
        colour = PHASE_COLOURS[o.phase]
        picked = any(o is c for c in chosen)
        kwargs = {"color": colour, "edgecolor": "black" if picked else colour}
        if not o.searched:
            kwargs |= {"fill": False, "linestyle": ":"}
        elif not o.meets_slo:
            kwargs |= {"alpha": 0.35, "hatch": "//"}
        ax.barh(y, o.cost_usd, lw=2.0 if picked else 0.8, **kwargs)
        note = f"{o.units} unit{'s' if o.units > 1 else ''}"
        note = (
            f">= {note}, pruned" if not o.searched else note + ("" if o.meets_slo else ", misses")
        )
        ax.text(o.cost_usd, y, f" {note}", va="center", fontsize=7)
        s = o.shape
        labels.append(
            f"{'both' if s.phase == 'colocated' else s.phase} {s.nodes} node"
            f"{'s' if s.nodes > 1 else ''}, R{s.redundant_experts}, {s.micro_batches} mb"
            + (f", MTP {s.mtp_acceptance:g}" if s.mtp_acceptance else "")
            + (f", <= {s.max_batch_per_gpu:g}/GPU" if s.max_batch_per_gpu is not None else "")
        )
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(o.cost_usd for o in rows) * 1.3)
    ax.set_xlabel("fleet cost over the workload (USD) of the fewest units meeting the SLOs")
    ax.set_title(
        title
        or f"cheapest: {plan.mode}, {plan.nodes} nodes, ${plan.cost_usd:,.2f} "
        f"(TTFT p95 {plan.ttft_p95_s:.2f} s, TPOT p95 {plan.tpot_p95_s * 1e3:.0f} ms); "
        "blue prefill, orange decode, green both",
        fontsize=9,
    )
    ax.grid(axis="x", alpha=0.3)
    return fig
