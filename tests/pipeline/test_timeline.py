"""What the schedule timeline draws: every colour in the legend, the legend right under the axis."""

import matplotlib.pyplot as plt
from matplotlib.colors import to_rgba

from moeinfra.pipeline import Costs, dualpipe, dualpipev, simulate
from moeinfra.pipeline.timeline import COLORS, timeline_figure


def test_legend_names_both_directions_of_w_and_sits_under_the_axis_label():
    for result in (
        simulate(dualpipev(4, 10), Costs(1, 2, 1, 2.5)),
        simulate(dualpipe(8, 20), Costs(1, 2, 1, 2.5)),
    ):
        fig = timeline_figure(result)
        try:
            (legend,) = fig.legends
            labels = [t.get_text() for t in legend.get_texts()]
            assert {"W (dir. 0)", "W (dir. 1)"} <= set(labels)
            used = {p.get_facecolor() for p in fig.axes[0].patches}
            for colours in COLORS.values():  # every fill drawn has a legend entry
                for colour in colours:
                    if to_rgba(colour) in used:
                        assert any(
                            to_rgba(colour) == h.get_facecolor() for h in legend.legend_handles
                        )
            fig.canvas.draw()
            renderer = fig.canvas.get_renderer()
            label = fig.axes[0].xaxis.label.get_window_extent(renderer)
            box = legend.get_window_extent(renderer)
            gap_px = label.y0 - box.y1
            assert 0 <= gap_px < 0.25 * fig.dpi  # no blank band between the axis and the legend
        finally:
            plt.close(fig)
