"""What the plan figure draws: bars from 0, the mean and the lower bound both visible with their
values, and the difference from the mean on its own axis."""

import matplotlib.pyplot as plt
import numpy as np
import pytest

from moeinfra.eplb import evaluate, rebalance
from moeinfra.eplb.figures import plan_figure, plot_plan
from moeinfra.eplb.published import EXAMPLE_WEIGHT


@pytest.mark.parametrize("policy", ["deepseek", None])
def test_plan_figure_bars_start_at_zero_and_show_mean_and_bound(policy):
    plan = rebalance(EXAMPLE_WEIGHT, 16, 4, 2, 8, **({"policy": policy} if policy else {}))
    ev = evaluate(plan, EXAMPLE_WEIGHT)
    fig = plan_figure(plan, EXAMPLE_WEIGHT, layer=0)
    try:
        _, ax_bar, ax_diff = fig.axes[:3]
        assert ax_bar.get_ylim()[0] == 0  # bars are not cut off at 15 or 50
        assert ax_bar.get_ylim()[1] >= ev.gpu_load[0].max()
        heights = sorted(p.get_height() for p in ax_bar.patches)
        np.testing.assert_allclose(heights, sorted(ev.gpu_load[0]))
        # mean and lower bound (equal here): two lines, told apart by width and dash, values named
        lines = {line.get_label(): line for line in ax_bar.get_lines()}
        mean_label = next(k for k in lines if k.startswith("mean "))
        bound_label = next(k for k in lines if k.startswith("lower bound"))
        assert f"{ev.gpu_load[0].mean():.4g}" in mean_label
        assert f"{ev.lower_bound[0]:.4g}" in bound_label
        mean, bound = lines[mean_label], lines[bound_label]
        assert mean.get_linestyle() != bound.get_linestyle()
        assert mean.get_linewidth() > bound.get_linewidth()  # the dashed bound on top of it
        assert mean.get_color() != bound.get_color()
        legend = [t.get_text() for t in ax_bar.get_legend().get_texts()]
        assert mean_label in legend and bound_label in legend
        # the difference from the mean, explicitly, in % on its own labelled axis, around 0
        assert "%" in ax_diff.get_ylabel()
        diffs = sorted(p.get_height() for p in ax_diff.patches)
        mean_load = ev.gpu_load[0].mean()
        np.testing.assert_allclose(diffs, sorted((ev.gpu_load[0] / mean_load - 1) * 100))
        low, high = ax_diff.get_ylim()
        assert low < min(diffs) and high > max(diffs) and low == -high
    finally:
        plt.close(fig)


def test_plot_plan_writes_the_figure(tmp_path):
    plan = rebalance(EXAMPLE_WEIGHT, 16, 4, 2, 8)
    out = plot_plan(plan, EXAMPLE_WEIGHT, tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
