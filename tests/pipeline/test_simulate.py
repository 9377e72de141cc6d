"""The simulator against REFERENCE.md's bubble / memory table and hand-computed cases."""

import json

import pytest

from moeinfra.errors import InputError
from moeinfra.pipeline import (
    Costs,
    compare,
    dualpipe,
    dualpipev,
    gpipe,
    one_f_one_b,
    simulate,
    zb1p,
)
from moeinfra.pipeline.timeline import chrome_trace, render_timeline


@pytest.mark.parametrize("comm", ["dataflow", "rendezvous"])
@pytest.mark.parametrize("pp", [4, 6, 8])
@pytest.mark.parametrize("fb", [3.0, 2.5, 2.2])
def test_dualpipe_bubble_formula(pp, fb, comm):
    # F = W = B/2: the middle ranks idle (PP/2 - 1)(F&B + B - 3W); peak activations PP + 1; 2x params.
    F, B, W = 1.0, 2.0, 1.0
    costs = Costs(F, B, W, fb)
    result = simulate(dualpipe(pp, 2 * pp + 4), costs, comm=comm)
    expected = (pp / 2 - 1) * (fb + B - 3 * W)
    for r in (pp // 2 - 1, pp // 2):
        assert result.per_rank[r].idle == pytest.approx(expected)
    assert max(r.peak_activations for r in result.per_rank) == pp + 1
    assert all(r.params == 2 for r in result.per_rank)


@pytest.mark.parametrize("pp", [4, 8])
@pytest.mark.parametrize("fb", [3.0, 2.5])
def test_dualpipev_bubble_formula(pp, fb):
    # DualPipeV: PP stages on PP/2 devices, same bubble; its last device is where the directions meet.
    costs = Costs(1.0, 2.0, 1.0, fb)
    result = simulate(dualpipev(pp // 2, pp + 3), costs)
    assert result.per_rank[-1].idle == pytest.approx((pp / 2 - 1) * (fb + 2.0 - 3.0))
    assert max(r.peak_activations for r in result.per_rank) == pp + 1
    assert all(r.params == 2 for r in result.per_rank)


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize(("F", "B"), [(1.0, 2.0), (1.5, 2.5)])
def test_1f1b_and_zb1p_bubble_formulas(pp, F, B):
    W = B / 2
    costs = Costs(F, B, W)
    one = simulate(one_f_one_b(pp, 3 * pp), costs)
    assert all(r.idle == pytest.approx((pp - 1) * (F + B)) for r in one.per_rank)
    assert [r.peak_activations for r in one.per_rank] == list(range(pp, 0, -1))
    zb = simulate(zb1p(pp, 3 * pp), costs)
    assert all(r.idle == pytest.approx((pp - 1) * (F + B - 2 * W)) for r in zb.per_rank)
    assert max(r.peak_activations for r in zb.per_rank) == pp


def test_gpipe_hand_computed():
    # 2 stages, 2 micro-batches, F=1, B=2: rank 1 runs F at 1..3, B at 3..7; rank 0 B at 5..9.
    r = simulate(gpipe(2, 2), Costs(1, 2, 1))
    assert r.makespan == 9
    assert r.per_rank[0].starts == (0, 1, 5, 7)
    assert r.per_rank[1].starts == (1, 2, 3, 5)


def test_rendezvous_exposes_latency():
    costs = Costs(1, 2, 1, latency=0.5)
    flow = simulate(one_f_one_b(4, 8), costs, comm="dataflow")
    rdv = simulate(one_f_one_b(4, 8), costs, comm="rendezvous")
    assert rdv.makespan >= flow.makespan
    one = simulate(gpipe(2, 1), costs)  # F 0..1, send, F 1.5..2.5, B 2.5..4.5, send, B 5..7
    assert one.makespan == pytest.approx(7.0)


def test_costs_parse_and_errors():
    c = Costs.parse("F=1,B=2,W=1,FB=3,latency=0.1")
    assert (c.F, c.B, c.W, c.fb, c.latency) == (1, 2, 1, 3, 0.1)
    assert Costs.parse("F=1,B=2,W=0.5").fb == 3
    with pytest.raises(InputError, match="costs='F=1,Q=2'"):
        Costs.parse("F=1,Q=2")
    with pytest.raises(InputError, match="costs.W=3"):
        Costs(1, 2, 3)
    with pytest.raises(InputError, match="comm='eager'"):
        simulate(gpipe(2, 2), comm="eager")


def test_compare_picks_dualpipe_only_when_overlap_pays():
    _, best_cheap = compare(8, 32, Costs(1, 2, 1, 2.2))
    assert best_cheap in ("dualpipe", "dualpipev")
    # When overlapping costs more than running F and B one after the other, ZB1P wins.
    cands, best = compare(8, 32, Costs(1, 2, 1, 3.3))
    assert best == "zb1p"
    assert {c.schedule for c in cands} == {"gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev"}
    cands, _ = compare(3, 5, Costs())
    infeasible = {c.schedule for c in cands if c.result is None}
    assert infeasible == {"dualpipe", "dualpipev"}


def test_timeline_png_and_chrome_trace(tmp_path):
    result = simulate(dualpipev(2, 4), Costs(1, 2, 1, 2.5))
    png = render_timeline(result, tmp_path / "t.png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "t.png").read_bytes() == png
    trace = chrome_trace(result)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == sum(len(r.actions) for r in result.per_rank)
    pair = next(e for e in events if "&" in e["name"])
    assert pair["args"]["b_stage"] >= 0 and pair["dur"] == pytest.approx(2500.0)
    json.dumps(trace)
