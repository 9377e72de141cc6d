"""Trace section of the demo report: DeepSeek's published training trace, analysed by moeinfra.trace.

Reads ``examples/data/deepseek_train_trace.json`` of the repository (shipped with it); when it is
missing (an installed package without the repository) the section says so instead of failing.
"""

from __future__ import annotations

import html
from pathlib import Path

from moeinfra.numfmt import percent
from moeinfra.report.page import Section, figure_html, table_html

DEEPSEEK_TRACE = (
    Path(__file__).resolve().parents[3] / "examples" / "data" / "deepseek_train_trace.json"
)

_OP_PATTERN = r"^(?P<phase>attn|mlp|dispatch|combine)\("
_TITLE = "Trace analysis: how much communication is hidden behind computation"


def build(out_dir: Path, trace_path: Path | None = None) -> Section:
    """Analyse the DeepSeek training trace (or ``trace_path``); write ``trace_*.png`` into ``out_dir``."""
    from moeinfra.trace import analyze
    from moeinfra.trace.timeline import plot_timeline

    path = trace_path or DEEPSEEK_TRACE
    if not path.exists():
        return Section(
            "trace",
            _TITLE,
            f"<p>The DeepSeek training trace was not found at <code>{html.escape(str(path))}</code>; "
            "this section needs it (it ships in the shared data folder beside the repository).</p>",
        )
    result = analyze(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    full = plot_timeline(
        result,
        out_dir / "trace_timeline.png",
        title="DeepSeek training trace (DualPipe, EP64, H800): GPU 0",
    )
    zoom = plot_timeline(
        result,
        out_dir / "trace_timeline_zoom.png",
        window_us=(10_000, 50_000),
        title="zoom: 10-50 ms",
    )
    doc = result.to_dict()
    dev = doc["devices"][0]
    span = dev["span_us"]
    decomposition = table_html(
        ["part", "µs", "% of span"],
        [
            [label, dev[key], 100 * dev[key] / span]
            for label, key in (
                ("compute", "compute_us"),
                ("exposed communication", "exposed_comm_us"),
                ("exposed memory", "exposed_memory_us"),
                ("idle", "idle_us"),
                ("span (sum of the four above)", "span_us"),
                ("communication, all", "comm_us"),
                ("communication hidden (overlap)", "overlap_us"),
            )
        ],
    )
    sm_rows = [
        [cls, 100 * v["sm_share"], v["mean_sms"], v["max_sms"]]
        for cls, v in (dev["sm_share"] or {}).items()
    ]
    sm = table_html(["class", "% of SM-time", "mean SMs while running", "max SMs"], sm_rows)
    phase_rows = [
        [p, v["compute_us"], v["comm_us"], v["ops"]] for p, v in dev.get("phases", {}).items()
    ]
    phases = table_html(["phase", "compute µs", "communication µs", "GPU ops"], phase_rows)
    names = list(dev.get("phase_overlap", {}))
    matrix = table_html(
        ["comm of \\ hidden by compute of", *names],
        [[x, *(dev["phase_overlap"][x][y] for y in names)] for x in names],
    )
    regions = table_html(
        ["annotation", "communication µs", "exposed µs"],
        [
            [n, v["comm_us"], v["exposed_comm_us"]]
            for n, v in dev["regions"].items()
            if v["comm_us"] > 0
        ],
    )
    # The same trace with the operation (attn / mlp / dispatch / combine) as the "phase".
    by_op = analyze(result.trace, phase_pattern=_OP_PATTERN).devices[0].to_dict()
    ops = list(by_op.get("phase_overlap", {}))
    op_matrix = table_html(
        ["comm of \\ hidden by compute of", *ops],
        [[x, *(by_op["phase_overlap"][x][y] for y in ops)] for x in ops],
    )
    hidden = dev["comm_hidden_fraction"]
    body = (
        f"<p>DeepSeek's published PyTorch Profiler trace of one DualPipe forward+backward chunk pair "
        f"(<code>{html.escape(path.name)}</code>, {doc['gpu_ops']} GPU ops). DeepEP all-to-all kernels "
        f"(<code>dpsk::ep::</code>) are communication; holistic trace analysis, which looks for <code>nccl</code> "
        f"kernels only, finds none. {percent(hidden)} of the communication time runs under computation; the "
        f"decomposition adds up exactly: compute + exposed communication + exposed memory + idle = span.</p>"
        + figure_html(
            full.name,
            "Streams as lanes (blue compute, orange communication), exposed communication in red, "
            "F/B/W bands from the user annotations enclosing each launch.",
        )
        + figure_html(zoom.name, "The same, 10-50 ms.")
        + "<h3>Decomposition (GPU 0)</h3>"
        + decomposition
        + "<h3>SM share per class (from args.grid and deviceProperties)</h3>"
        + sm
        + "<h3>Phases</h3>"
        + phases
        + "<h3>phase_overlap: communication of a phase (row) hidden by the computation of a phase (column), µs</h3>"
        + matrix
        + "<h3>The same by operation: DualPipe hides combine behind attention, dispatch behind MLP (µs)</h3>"
        + op_matrix
        + "<h3>Where communication is exposed</h3>"
        + regions
        + "<p>Reproduce: <code>moeinfra trace report examples/data/deepseek_train_trace.json -o timeline.png</code></p>"
    )
    return Section("trace", _TITLE, body)
