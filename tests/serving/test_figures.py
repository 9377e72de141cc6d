"""What the latency figure draws: x axes fitted to the data (log only across decades), units."""

import matplotlib.pyplot as plt
import numpy as np
import pytest

from moeinfra.serving.figures import data_range, latency_figure


def _inside(lim, low, high, margin):
    span = high - low
    return low - margin * span <= lim[0] <= low and high <= lim[1] <= high + margin * span


def test_data_range_fits_percentiles_and_picks_log_only_across_decades():
    rng = np.random.default_rng(0)
    narrow = rng.normal(41.0, 3.0, 100_000)  # ms: 30-50
    low, high, log = data_range(narrow)
    p_lo, p_hi = np.percentile(narrow, [0.5, 99.5])
    assert not log and _inside((low, high), p_lo, p_hi, 0.06)
    wide = rng.lognormal(np.log(0.1), 1.2, 100_000)  # s: 0.005-2, decades
    low, high, log = data_range(wide)
    p_lo, p_hi = np.percentile(wide, [0.5, 99.5])
    pad = 10 ** (0.06 * np.log10(p_hi / p_lo))  # the margin is a share of the log span
    assert log and p_lo / pad < low <= p_lo and p_hi <= high < p_hi * pad
    # weights count: one heavy value pulls both quantiles to it
    low, high, _ = data_range(np.array([1.0, 2.0, 3.0]), np.array([0.0, 1.0, 0.0]))
    assert 1.0 < low < 2.0 < high < 3.0


@pytest.fixture
def latency():
    rng = np.random.default_rng(1)
    ttft = np.concatenate([rng.lognormal(np.log(0.1), 1.0, 20_000), [np.inf] * 5])
    tpot = np.concatenate([rng.normal(0.041, 0.003, 20_000), [0.35, 0.4], [np.nan] * 3])
    edges = np.geomspace(1e-4, 10.0, 1201)
    centres = np.sqrt(edges[:-1] * edges[1:])
    tokens = np.exp(-0.5 * ((centres - 0.041) / 0.003) ** 2) * 1e6
    tokens[np.searchsorted(edges, 0.3)] = 10.0  # a rare slow step far out
    return ttft, tpot, edges, tokens, centres


def test_latency_axes_fit_the_data_not_the_outliers(latency):
    ttft, tpot, edges, tokens, centres = latency
    fig = latency_figure(ttft, tpot, edges, tokens)
    try:
        a, b, c = fig.axes
        t = ttft[np.isfinite(ttft)]
        lo, hi = np.percentile(t, [0.5, 99.5])
        assert a.get_xscale() == "log"  # TTFT spans decades
        assert lo / 1.5 < a.get_xlim()[0] <= lo and hi <= a.get_xlim()[1] < hi * 1.5
        assert "(s" in a.get_xlabel() and "%" in a.get_ylabel()

        ms = tpot[np.isfinite(tpot)] * 1e3
        lo, hi = np.percentile(ms, [0.5, 99.5])
        assert b.get_xscale() == "linear"  # 30-50 ms: no decades, no log axis
        assert _inside(b.get_xlim(), lo, hi, 0.1)
        assert b.get_xlim()[1] < 100  # the two 350-400 ms outliers do not stretch the axis
        assert "(ms" in b.get_xlabel()
        assert any("beyond" in t.get_text() for t in b.texts)  # ... they are counted instead
        # bars are shares of requests, summing to 100% with what is off the axis
        shown = sum(p.get_height() for p in b.patches)
        assert 98.5 < shown <= 100.0 + 1e-9

        assert c.get_xscale() == "linear" and "(ms" in c.get_xlabel()
        assert c.get_xlim()[0] > 25 and c.get_xlim()[1] < 60  # not 0.1 ms to 10 s
    finally:
        plt.close(fig)
