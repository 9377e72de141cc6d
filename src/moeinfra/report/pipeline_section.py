"""Pipeline section of the demo report: DualPipe / DualPipeV timelines and the bubble / memory table."""

from __future__ import annotations

import html
from pathlib import Path

from moeinfra.pipeline import Costs, compare, dualpipe, dualpipev, one_f_one_b, simulate, zb1p
from moeinfra.pipeline.schedule import Schedule
from moeinfra.pipeline.timeline import render_timeline, write_chrome_trace
from moeinfra.report.page import Section, figure_html, table_html

# F = W = B/2, where REFERENCE.md's formulas are exact; F&B slightly cheaper than F + B.
COSTS = Costs(F=1.0, B=2.0, W=1.0, FB=2.5)
PP = 8


def bubble_rows(pp: int = PP, costs: Costs = COSTS) -> list[list[object]]:
    """One row per schedule: published bubble formula vs simulated idle (worst rank and middle rank),
    published vs simulated peak activations, published parameters per device vs the share of the
    model the busiest simulated device holds, devices."""
    F, B, W, FB = costs.F, costs.B, costs.W, costs.fb
    mbs = 2 * pp + 4
    one = simulate(one_f_one_b(pp, mbs), costs)
    zb = simulate(zb1p(pp, mbs), costs)
    dp = simulate(dualpipe(pp, mbs), costs)
    dpv = simulate(dualpipev(pp // 2, mbs), costs)
    rows = []
    for name, res, formula_text, formula, act_text, act, params, devices, mid in (
        ("1F1B", one, "(PP-1)(F+B)", (pp - 1) * (F + B), "PP", pp, "1x", pp, 0),
        ("ZB1P", zb, "(PP-1)(F+B-2W)", (pp - 1) * (F + B - 2 * W), "PP", pp, "1x", pp, 0),
        (
            "DualPipe",
            dp,
            "(PP/2-1)(F&B+B-3W)",
            (pp / 2 - 1) * (FB + B - 3 * W),
            "PP+1",
            pp + 1,
            "2x",
            pp,
            pp // 2 - 1,
        ),
        (
            "DualPipeV",
            dpv,
            "(PP/2-1)(F&B+B-3W)",
            (pp / 2 - 1) * (FB + B - 3 * W),
            "PP+1",
            pp + 1,
            "2x",
            pp // 2,
            pp // 2 - 1,
        ),
    ):
        rows.append(
            [
                name,
                f"{formula_text} = {formula:g}",
                f"{res.per_rank[mid].idle:g}",
                f"{max(r.idle for r in res.per_rank):g}",
                f"{act_text} = {act}",
                max(r.peak_activations for r in res.per_rank),
                params,
                _held(res.schedule, max(r.params for r in res.per_rank)),
                devices,
            ]
        )
    return rows


def build(out_dir: Path) -> Section:
    """Write ``pipeline_dualpipe.png``, ``pipeline_dualpipev.png`` and a trace into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dp = simulate(dualpipe(8, 20), COSTS)
    dpv = simulate(dualpipev(4, 10), COSTS)
    render_timeline(
        dp,
        out_dir / "pipeline_dualpipe.png",
        title="DualPipe, 8 ranks, 20 micro-batches (F=1, B=2, W=1, F&B=2.5)",
    )
    render_timeline(
        dpv,
        out_dir / "pipeline_dualpipev.png",
        title="DualPipeV, 4 ranks (8 stages), 10 micro-batches",
    )
    write_chrome_trace(dp, out_dir / "pipeline_dualpipe_trace.json")
    header = [
        "method",
        "bubble (published)",
        "idle, simulated (middle rank)",
        "idle, simulated (worst rank)",
        "activations (published)",
        "activations, simulated",
        "parameters per device (published)",
        "model held per device, simulated",
        "devices",
    ]
    cands, best = compare(8, 32, COSTS)
    cmp_rows = [
        [
            c.schedule + (" (best)" if c.schedule == best else ""),
            c.result.makespan,
            max(r.idle for r in c.result.per_rank),
            c.to_dict()["activation_memory"],
            f"{c.to_dict()['param_memory']:g}x",
            _held(c.result.schedule, c.to_dict()["params"]),
        ]
        for c in cands
        if c.result is not None
    ]
    body = (
        "<p>Schedules are data (<code>moeinfra.pipeline.Schedule</code>): per-rank action lists "
        "(<code>F0.7&amp;B7.3</code> = forward of stage 0 for micro-batch 7 overlapped with the backward of "
        "stage 7 for micro-batch 3). DualPipe and DualPipeV follow DeepSeek's 8-step order; the simulator "
        "times them under per-stage costs.</p>"
        + figure_html(
            "pipeline_dualpipe.png",
            "DualPipe on 8 ranks, 20 micro-batches (light: direction entering at rank 0; dark: the mirrored direction; split cells: overlapped F&B; hatched: input-gradient-only backward; blue: deferred W)",
        )
        + figure_html(
            "pipeline_dualpipev.png",
            "DualPipeV on 4 ranks (8 stages folded in a V), 10 micro-batches",
        )
        + '<p>Chrome trace of the DualPipe run: <a href="pipeline_dualpipe_trace.json">pipeline_dualpipe_trace.json</a> (open in Perfetto).</p>'
        + f"<h3>Bubble and memory per device, PP = {PP}, {html.escape(_costs_text())}</h3>"
        + table_html(header, bubble_rows())
        + "<p>As in DeepSeek's table, all four run one model cut into PP stages of equal size; "
        "DualPipeV folds them onto PP/2 devices. Bubble and idle in cost units (F = 1); activations "
        "in units of one stage's activations for one micro-batch; parameters per device relative to "
        "1F1B's one stage, so DualPipe and DualPipeV, holding two 1/8 slices of the model on each "
        "device, hold 2x. The formulas are exact for F = W = B/2; the simulated idle comes from running the "
        "schedules.</p>"
        + "<h3>Which schedule for these costs? 8 devices, 32 micro-batches</h3>"
        + table_html(
            [
                "schedule",
                "makespan (cost units)",
                "max idle (cost units)",
                "activations per device",
                "parameters per device (vs 1F1B)",
                "model held per device",
            ],
            cmp_rows,
        )
        + "<p>Here the number of devices is fixed instead: every schedule gets the same 8 "
        "devices, so DualPipeV cuts the model into 16 stages of half the size. Its 2 stages per "
        "device then weigh as much as 1F1B's one (1x), while DualPipe still holds two stages of "
        "an 8-stage split (2x): the 2x of the table above is DualPipeV's price per device when it "
        "runs the same stages on half the devices. Activations in units of one stage of the "
        "8-stage split for one micro-batch. <code>moeinfra pipeline compare --costs "
        "F=..,B=..,W=..,FB=..</code> makes this choice from measured costs.</p>"
    )
    return Section("pipeline", "Pipeline parallelism: DualPipe, DualPipeV and baselines", body)


def _costs_text() -> str:
    return f"F={COSTS.F:g}, B={COSTS.B:g}, W={COSTS.W:g}, F&B={COSTS.fb:g}"


def _held(schedule: Schedule, stages: int) -> str:
    """``"2 × 1/8"``: a device's ``stages`` stages, each one slice of the model (a path's length;
    DualPipe's two paths are two copies of the model)."""
    return f"{stages} × 1/{len(schedule.paths[0])}"
