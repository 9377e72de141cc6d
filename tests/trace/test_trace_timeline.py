"""What the trace timeline writes into its boxes: short kernel names that fit, never overrunning."""

import matplotlib.pyplot as plt
import numpy as np
import pytest

from moeinfra.report.trace_section import DEEPSEEK_TRACE
from moeinfra.trace import analyze
from moeinfra.trace.timeline import _fit, _label, _short, timeline_figure


def test_short_names_and_fitting():
    assert (
        _short("void dpsk::ep::internode::combine<float, 8>(int*, float)") == "internode::combine"
    )
    assert _short("ATTN(mb1) L0") == "ATTN(mb1) L0"  # annotations stay as written
    assert _fit("internode::combine", 40) == "internode::combine"
    assert _fit("internode::combine", 8) == "interno…"
    assert _fit("internode::combine", 3) == ""
    kernel = "void dpsk::ep::internode::combine<float, 8>(int*, float)"
    assert _label(kernel, 30) == "internode::combine"
    assert _label(kernel, 10) == "combine"  # the function alone before cutting
    assert _label(kernel, 5) == "comb…"


@pytest.mark.parametrize("window_us", [None, (10_000, 50_000)])
def test_op_names_fit_inside_their_boxes(window_us):
    result = analyze(DEEPSEEK_TRACE)
    fig = timeline_figure(result, window_us=window_us)
    try:
        ax = fig.axes[0]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        texts = [t for t in ax.texts if t.get_text()]
        assert texts, "wide ops carry names"
        boxes = []
        for t in texts:
            extent = t.get_window_extent(renderer)
            boxes.append((extent.x0, extent.x1, round(extent.y0)))
            assert "void " not in t.get_text() and "<" not in t.get_text()
        # on each lane, no two names overlap
        for y in {b[2] for b in boxes}:
            row = sorted(b[:2] for b in boxes if b[2] == y)
            assert all(a[1] <= b[0] + 1 for a, b in zip(row, row[1:], strict=False))
        # x axis: plain numbers with separators, no offset or exponent
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert labels and not any("e" in s for s in labels)
        assert np.isclose(ax.get_xlim()[0], window_us[0] if window_us else 0.0)
    finally:
        plt.close(fig)
