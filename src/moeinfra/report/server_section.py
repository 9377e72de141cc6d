"""Report section: the inference system running — a live PD-disaggregated server, calibrated."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from moeinfra.numfmt import percent, signed_percent
from moeinfra.report.page import Section, figure_html, table_html

_TITLE = (
    "Live server: prefill/decode disaggregation behind the OpenAI API, and its calibrated model"
)
_ENGINE = ["--block-size", "16", "--num-kv-blocks", "512"]
# the disaggregated system this section describes, whatever serve up's default on this machine
_DISAGGREGATED = ["--prefill-units", "1", "--prefill-ranks", "2", "--decode-units", "1",
                  "--decode-ranks", "2"]  # fmt: skip
_FIGURES = ("TTFT p50", "TTFT p95", "TPOT p50", "TPOT p95")


def _replay(args: list[str], trace: Path) -> dict:
    from moeinfra.server import bench
    from moeinfra.server.process import ServerProcess

    with ServerProcess([*_ENGINE, *args]) as server:
        requests = bench.trace_requests(trace, vocab=1000, block_tokens=64)
        results, wall = asyncio.run(bench.replay(server.url, requests))
    return bench.summarize(results, wall)


def _ms(summary: dict, label: str) -> float:
    group, q = label.split()
    return summary[f"{group.lower()}_s"][q.lower()] * 1e3


def build(out_dir: Path) -> Section:
    """Calibrate the default system (``serve up``: 1 prefill + 1 decode unit of 2 ranks), replay a
    short trace live (~15 s), predict it with the calibrated simulator, and replay it on 2
    colocated units of 2 ranks (the same cores); writes ``server_latency.png``."""
    try:
        import torch  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        return Section(
            "server", _TITLE, "<p>This section needs pip install moeinfra[engine,serve].</p>"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeinfra.server import bench
    from moeinfra.server.calibrate import calibrate_live, compare, predict_replay
    from moeinfra.server.process import ServerProcess

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        trace = bench.synthetic_trace(folder / "trace.jsonl", 48, 4.0, seed=1)
        with ServerProcess(
            [*_ENGINE, *_DISAGGREGATED, "--kv-cache-dir", str(folder / "kv")]
        ) as server:
            calibration = calibrate_live(server.url, name="demo")
            requests = bench.trace_requests(trace, vocab=1000, block_tokens=64)
            results, wall = asyncio.run(bench.replay(server.url, requests))
            live = bench.summarize(results, wall)
        predicted = predict_replay(trace, calibration)
        colocated = _replay(
            ["--prefill-units", "0", "--decode-units", "0", "--colocated-units", "2"], trace
        )
    rows = compare(live, predicted)
    errors = calibration.errors()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.27
    for i, (name, summary) in enumerate(
        (("live, disaggregated", live), ("calibrated simulator", predicted)),
    ):
        ax.bar(
            [x + (i - 1) * width for x in range(4)],
            [_ms(summary, f) for f in _FIGURES],
            width,
            label=name,
        )
    ax.bar(
        [x + width for x in range(4)],
        [_ms(colocated, f) for f in _FIGURES],
        width,
        label="live, colocated",
    )
    ax.set_xticks(range(4), _FIGURES)
    ax.set_ylabel("ms")
    ax.set_title("48 requests at 4/s on 2 CPU cores (tiny DeepSeek-V3)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "server_latency.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    fit, held = errors["fit"], errors["validation"]
    body = (
        "<p><code>moeinfra serve up</code> on built-in defaults: an OpenAI-compatible API server, "
        "one prefill and one decode unit of two gloo ranks each, the prompt's latent KV handed "
        "from prefill to decode over ZeroMQ, an on-disk prefix cache. <code>moeinfra serve "
        f"calibrate</code> fitted the serving model to its engine steps ({fit['points']} bins, "
        f"median error {percent(fit['median_abs'])}; {held['points']} held-out bins, median "
        f"{percent(held['median_abs'])}); then a 48-request trace the fit never saw (Poisson, 4/s, "
        "half the prompts sharing a system block) was replayed live, through the calibrated "
        "simulator, and live on two colocated units of the same size.</p>"
        + table_html(
            ["figure", "live", "calibrated simulator", "error"],
            [
                [
                    r["figure"].replace("(s)", "(ms)"),
                    round(r["live"] * (1e3 if "(s)" in r["figure"] else 1), 1),
                    round(r["predicted"] * (1e3 if "(s)" in r["figure"] else 1), 1),
                    signed_percent(r["error"]),
                ]
                for r in rows
            ],
        )
        + table_html(
            ["system (same 4 ranks)", "TTFT p95 (ms)", "TPOT p95 (ms)", "errors"],
            [
                [
                    "disaggregated: 1 prefill + 1 decode unit",
                    round(_ms(live, "TTFT p95"), 1),
                    round(_ms(live, "TPOT p95"), 1),
                    live["errors"],
                ],
                [
                    "colocated: 2 units",
                    round(_ms(colocated, "TTFT p95"), 1),
                    round(_ms(colocated, "TPOT p95"), 1),
                    colocated["errors"],
                ],
            ],
        )
        + figure_html(path.name, "Latency of the live server, its calibrated model, colocated")
    )
    return Section("server", _TITLE, body)
