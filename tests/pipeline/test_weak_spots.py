"""Known answers for the simulator and the zero-bubble generators, derived by hand (issue #18).

Every expected number here comes from working the rule of ``simulate``'s module docstring (or the
generator's docstring / DeepSeek's 8-step description) through by hand, or from the small reference
implementations below, written from those docstrings and not from the code.
"""

from functools import cache

import pytest

from moeinfra.errors import InputError
from moeinfra.pipeline import (
    Costs,
    Schedule,
    dualpipe,
    dualpipev,
    gpipe,
    one_f_one_b,
    parse_action,
    simulate,
    validate,
    zb1p,
)


def _hand_made(rank_actions: list[str], num_ranks: int, num_microbatches: int) -> Schedule:
    """A linear pipeline (stage ``r`` on rank ``r``) with the given action strings per rank."""
    return Schedule(
        name="hand",
        num_ranks=num_ranks,
        stage_ranks=tuple(range(num_ranks)),
        paths=(tuple(range(num_ranks)),),
        mb_paths=(0,) * num_microbatches,
        actions=tuple(tuple(parse_action(a) for a in rank.split()) for rank in rank_actions),
    )


# ---------------------------------------------------------------- rendezvous with a link latency


def test_rendezvous_posts_receives_late_and_the_delay_propagates():
    # GPipe, 2 stages, 2 micro-batches, F=1, B=2, latency 0.5. Rendezvous, by hand:
    #   rank 0: F0.0 0-1, F0.1 1-2.
    #   rank 1: F1.0 posts at 0, data ready 1 -> transfer 1..1.5 -> runs 1.5-2.5.
    #           F1.1 posts its receive when F1.0 ends (2.5); F0.1 ended at 2 -> 2.5..3.0 -> 3.0-4.0.
    #           B1.0 4-6, B1.1 6-8 (last stage: only local inputs).
    #   rank 0: B0.0 posted when F0.1 ended (2); B1.0 ends 6 -> 6.5 -> 6.5-8.5.
    #           B0.1 posted when B0.0 ends (8.5), later than B1.1's end (8) -> 9.0 -> 9-11.
    # Dataflow: F1.1 at max(2.5, 2 + 0.5) = 2.5, B1.0 3.5, B1.1 5.5, B0.0 at 5.5 + 0.5 = 6,
    #   B0.1 at max(8, 7.5 + 0.5) = 8 -> makespan 10.
    costs = Costs(F=1, B=2, W=1, latency=0.5)
    rdv = simulate(gpipe(2, 2), costs, comm="rendezvous")
    assert rdv.per_rank[0].starts == (0, 1, 6.5, 9)
    assert rdv.per_rank[0].ends == (1, 2, 8.5, 11)
    assert rdv.per_rank[1].starts == (1.5, 3, 4, 6)
    assert rdv.per_rank[1].ends == (2.5, 4, 6, 8)
    assert rdv.makespan == 11
    flow = simulate(gpipe(2, 2), costs, comm="dataflow")
    assert flow.per_rank[0].starts == (0, 1, 6, 8)
    assert flow.per_rank[1].starts == (1.5, 2.5, 3.5, 5.5)
    assert flow.makespan == 10
    # idle = makespan - busy, busy = 2 F + 2 B = 6 on each rank
    assert [r.idle for r in rdv.per_rank] == [5, 5]


def test_rendezvous_on_1f1b_three_microbatches():
    # 1F1B(2, 3), F=1, B=2, latency 0.5; rank 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2,
    # rank 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2. By hand (rendezvous):
    #   F1.0: ready 1 + 0.5 -> 1.5-2.5; B1.0 2.5-4.5.
    #   F1.1: receive posted when B1.0 ends (4.5), F0.1 ended at 2 -> 5.0-6.0 (dataflow: 4.5).
    #   B1.1 6-8.
    #   B0.0: posted after F0.1 (2), B1.0 ends 4.5 -> 5.0-7.0; F0.2 7-8.
    #   F1.2: posted after B1.1 (8), F0.2 ends 8 -> 8.5-9.5; B1.2 9.5-11.5.
    #   B0.1: posted after F0.2 (8), B1.1 ended 8 -> 8.5-10.5.
    #   B0.2: posted after B0.1 (10.5), B1.2 ends 11.5 -> 12-14.
    costs = Costs(F=1, B=2, W=1, latency=0.5)
    r = simulate(one_f_one_b(2, 3), costs, comm="rendezvous")
    assert r.per_rank[0].starts == (0, 1, 5, 7, 8.5, 12)
    assert r.per_rank[0].ends == (1, 2, 7, 8, 10.5, 14)
    assert r.per_rank[1].starts == (1.5, 2.5, 5, 6, 8.5, 9.5)
    assert r.per_rank[1].ends == (2.5, 4.5, 6, 8, 9.5, 11.5)
    assert r.makespan == 14
    flow = simulate(one_f_one_b(2, 3), costs, comm="dataflow")
    assert flow.per_rank[1].starts == (1.5, 2.5, 4.5, 5.5, 8.5, 9.5)
    assert flow.per_rank[0].starts == (0, 1, 5, 7, 8, 12)


def test_rendezvous_posts_receives_across_weight_gradients():
    # rank 1 runs W1.0 between I1.0 and F1.1: the receive of F1.1 is posted when I1.0 ends (3.5),
    # not after W1.0 (4.5). F=1, B=2, W=1 (I = B - W = 1), latency 0.5. By hand:
    #   rank 0: F0.0 0-1, F0.1 1-2.
    #   rank 1: F1.0 1.5-2.5, I1.0 2.5-3.5, W1.0 3.5-4.5;
    #           F1.1: transfer from max(2, 3.5) = 3.5 to 4.0, rank free at 4.5 -> 4.5-5.5
    #           (posting after W1.0 would give 5.0); I1.1 5.5-6.5, W1.1 6.5-7.5.
    #   rank 0: I0.0 posted after F0.1 (2), I1.0 ends 3.5 -> 4.0-5.0;
    #           I0.1 posted after I0.0 (5), I1.1 ends 6.5 -> 7.0-8.0; W0.0 8-9, W0.1 9-10.
    s = _hand_made(["F0.0 F0.1 I0.0 I0.1 W0.0 W0.1", "F1.0 I1.0 W1.0 F1.1 I1.1 W1.1"], 2, 2)
    validate(s)
    r = simulate(s, Costs(F=1, B=2, W=1, latency=0.5), comm="rendezvous")
    assert r.per_rank[1].starts == (1.5, 2.5, 3.5, 4.5, 5.5, 6.5)
    assert r.per_rank[0].starts == (0, 1, 4, 7, 8, 9)
    assert r.makespan == 10
    assert r.per_rank[0].peak_deferred_w == 2 and r.per_rank[1].peak_deferred_w == 1


def _reference_starts(schedule: Schedule, costs: Costs, comm: str) -> list[list[float]]:
    """Start of every action, from the module docstring's rules (memoised recursion)."""
    where = {}
    for r, acts in enumerate(schedule.actions):
        for k, a in enumerate(acts):
            for p in a.parts():
                where[("B" if p.kind in "BI" else p.kind, p.stage, p.mb)] = (r, k)

    def needs(a):
        out = []
        for p in a.parts():
            path = schedule.paths[schedule.mb_paths[p.mb]]
            i = path.index(p.stage)
            if p.kind == "F" and i > 0:
                out.append(("F", path[i - 1], p.mb))
            elif p.kind in ("B", "I"):
                if not (a.kind == "FB" and p.stage == a.stage and p.mb == a.mb):
                    out.append(("F", p.stage, p.mb))
                if i + 1 < len(path):
                    out.append(("B", path[i + 1], p.mb))
            elif p.kind == "W":
                out.append(("B", p.stage, p.mb))
        return out

    def duration(a):
        i = costs.B - costs.W if costs.I is None else costs.I
        fb = costs.F + costs.B if costs.FB is None else costs.FB
        return {"F": costs.F, "B": costs.B, "I": i, "W": costs.W, "FB": fb}[a.kind]

    @cache
    def end(r, k):
        return start(r, k) + duration(schedule.actions[r][k])

    @cache
    def posted(r, k):
        for j in range(k - 1, -1, -1):
            if schedule.actions[r][j].kind != "W":
                return end(r, j)
        return 0.0

    @cache
    def start(r, k):
        t = end(r, k - 1) if k else 0.0
        for key in needs(schedule.actions[r][k]):
            q, j = where[key]
            if q == r:
                t = max(t, end(q, j))
            elif comm == "dataflow":
                t = max(t, end(q, j) + costs.latency)
            else:
                t = max(t, max(end(q, j), posted(r, k)) + costs.latency)
        return t

    return [[start(r, k) for k in range(len(a))] for r, a in enumerate(schedule.actions)]


@pytest.mark.parametrize("comm", ["dataflow", "rendezvous"])
@pytest.mark.parametrize(
    "schedule",
    [one_f_one_b(3, 5), zb1p(3, 5), dualpipev(2, 5), dualpipe(4, 10)],
    ids=["1f1b", "zb1p", "dualpipev", "dualpipe"],
)
def test_simulator_matches_a_reference_written_from_its_docstring(schedule, comm):
    costs = Costs(F=1.0, B=2.5, W=1.0, FB=3.0, latency=0.375, I=1.75)
    result = simulate(schedule, costs, comm=comm)
    expected = _reference_starts(schedule, costs, comm)
    for r, rank in enumerate(result.per_rank):
        assert list(rank.starts) == pytest.approx(expected[r], abs=1e-12), f"rank {r}"


# ---------------------------------------------------------------- memory peaks, rank by rank


def _reference_peaks(actions) -> tuple[int, int]:
    """(peak live activations, peak deferred weight gradients), counting named (stage, mb) items:
    a forward makes its activations live, a B or I frees them; an I defers a W until it runs."""
    live, deferred = set(), set()
    peak = peak_w = 0
    for a in actions:
        for p in a.parts():  # an F&B pair adds its forward before its backward frees
            if p.kind == "F":
                live.add((p.stage, p.mb))
            peak = max(peak, len(live))
            if p.kind in ("B", "I"):
                live.remove((p.stage, p.mb))
            if p.kind == "I":
                deferred.add((p.stage, p.mb))
            if p.kind == "W":
                deferred.remove((p.stage, p.mb))
            peak_w = max(peak_w, len(deferred))
    return peak, peak_w


@pytest.mark.parametrize(
    ("schedule", "activations", "deferred"),
    [
        # GPipe: every forward first.
        (gpipe(3, 5), [5, 5, 5], [0, 0, 0]),
        # 1F1B: rank r holds P - r micro-batches (its warm-up forwards + one).
        (one_f_one_b(4, 6), [4, 3, 2, 1], [0, 0, 0, 0]),
        (one_f_one_b(4, 2), [2, 2, 2, 1], [0, 0, 0, 0]),
        # ZB1P: same activations; rank r holds back r weight gradients, so r + 1 wait at most
        # (just after an I), never more than there are micro-batches.
        (zb1p(4, 6), [4, 3, 2, 1], [1, 2, 3, 4]),
        (zb1p(4, 2), [2, 2, 2, 1], [1, 2, 2, 2]),
        # DualPipeV on P ranks: 2P live after step 2, the first F&B of step 4 peaks at 2P + 1;
        # step 6 defers r + 1 weight gradients (r = distance from the nearer end).
        (dualpipev(3, 7), [7, 7, 7], [1, 2, 3]),
        # DualPipe on PP ranks: PP + 1 everywhere, deferred r + 1 with r = min(rank, PP - 1 - rank)
        # (REFERENCE.md's table: 1 2 3 4 4 3 2 1 on 8 ranks).
        (dualpipe(8, 20), [9] * 8, [1, 2, 3, 4, 4, 3, 2, 1]),
        (dualpipe(4, 10), [5] * 4, [1, 2, 2, 1]),
    ],
    ids=["gpipe", "1f1b", "1f1b-few", "zb1p", "zb1p-few", "dualpipev", "dualpipe8", "dualpipe4"],
)
def test_peaks_rank_by_rank(schedule, activations, deferred):
    result = simulate(schedule, Costs(F=1, B=2, W=1, FB=2.5))
    assert [r.peak_activations for r in result.per_rank] == activations
    assert [r.peak_deferred_w for r in result.per_rank] == deferred
    for r in range(len(result.per_rank)):
        assert _reference_peaks(schedule.actions[r]) == (activations[r], deferred[r])


def test_an_fb_pair_peaks_one_above_its_forward():
    # rank 0 of a hand-made 2-stage schedule: F0.0, F0.1&B0.0 (live 1 -> 2 -> 1), B0.1.
    s = _hand_made(["F0.0 F0.1&B0.0 B0.1", "F1.0 B1.0 F1.1 B1.1"], 2, 2)
    validate(s)
    result = simulate(s, Costs(F=1, B=2, W=1, FB=2.5))
    assert [r.peak_activations for r in result.per_rank] == [2, 1]
    assert [r.peak_deferred_w for r in result.per_rank] == [0, 0]


# ---------------------------------------------------------------- zero-bubble generators by hand


def _strings(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in rank) for rank in schedule.actions]


def test_zb1p_order_on_three_ranks():
    # Docstring: 1F1B order of F and I; one W after each I except the first r (held to the end);
    # W first-in first-out. P = 3, M = 4, warm-up P - 1 - r forwards.
    assert _strings(zb1p(3, 4)) == [
        "F0.0 F0.1 F0.2 I0.0 W0.0 F0.3 I0.1 W0.1 I0.2 W0.2 I0.3 W0.3",
        "F1.0 F1.1 I1.0 F1.2 I1.1 W1.0 F1.3 I1.2 W1.1 I1.3 W1.2 W1.3",
        "F2.0 I2.0 F2.1 I2.1 F2.2 I2.2 W2.0 F2.3 I2.3 W2.1 W2.2 W2.3",
    ]


@pytest.mark.parametrize(("ranks", "mbs"), [(3, 4), (4, 9), (5, 3)])
def test_zb1p_is_1f1b_with_split_backwards(ranks, mbs):
    zb, one = zb1p(ranks, mbs), one_f_one_b(ranks, mbs)
    for r in range(ranks):
        fi = [str(a).replace("I", "B") for a in zb.actions[r] if a.kind != "W"]
        assert fi == [str(a) for a in one.actions[r]]
        ws = [a.mb for a in zb.actions[r] if a.kind == "W"]
        assert ws == list(range(mbs))  # FIFO
        # r weight gradients are held back: after the last I run the last min(r + 1, M)
        last_i = max(k for k, a in enumerate(zb.actions[r]) if a.kind == "I")
        tail = [a.mb for a in zb.actions[r][last_i + 1 :]]
        assert tail == list(range(mbs - min(r + 1, mbs), mbs))


def test_dualpipev_two_ranks_order():
    # DeepSeek's 8 steps, P = 2, M = 4. Rank 0 (r = 0, stages 0 and 3): 2 F0; (F0, F1); (I1 W1 F1);
    # 1 x (F0&B1, F1&B0); (B1, F1&B0); step 6 (r even: the switch after B1): B1, I0;
    # (W, I0); W. Rank 1 (r = 1, stages 1 and 2, where the directions meet): 2 x (F0, F1);
    # 2 x step 4, the first F0 and B1 unpaired; step 6 (r odd: the switch before B1 of the
    # second repetition): B1 B0, I1 I0; 2 W.
    assert _strings(dualpipev(2, 4)) == [
        "F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 F0.3&B3.1 F3.2&B0.0 B3.2 F3.3&B0.1 B3.3 I0.2 W0.2 "
        "I0.3 W0.3",
        "F1.0 F2.0 F1.1 F2.1 F1.2 B2.0 F2.2&B1.0 F1.3&B2.1 F2.3&B1.1 B2.2 B1.2 I2.3 I1.3 W2.3 W1.3",
    ]


def test_dualpipe_four_ranks_order():
    # PP = 4 (P = 2 per half), 8 micro-batches: 0..3 enter at rank 0 (stages 0..3),
    # 4..7 at rank 3 (stages 4..7, stage 4 + k on rank 3 - k). Ranks 2 and 3 run the mirrored
    # direction as their phase 0.
    assert _strings(dualpipe(4, 8)) == [
        "F0.0 F0.1 F0.2 F7.4 I7.4 W7.4 F7.5 F0.3&B7.5 F7.6&B0.0 B7.6 F7.7&B0.1 B7.7 I0.2 W0.2 "
        "I0.3 W0.3",
        "F1.0 F6.4 F1.1 F6.5 F1.2 B6.4 F6.6&B1.0 F1.3&B6.5 F6.7&B1.1 B6.6 B1.2 I6.7 I1.3 W6.7 W1.3",
        "F5.4 F2.0 F5.5 F2.1 F5.6 B2.0 F2.2&B5.4 F5.7&B2.1 F2.3&B5.5 B2.2 B5.6 I2.3 I5.7 W2.3 W5.7",
        "F4.4 F4.5 F4.6 F3.0 I3.0 W3.0 F3.1 F4.7&B3.1 F3.2&B4.4 B3.2 F3.3&B4.5 B3.3 I4.6 W4.6 "
        "I4.7 W4.7",
    ]


@pytest.mark.parametrize(("gen", "ranks", "mbs"), [(dualpipev, 3, 8), (dualpipe, 6, 14)])
def test_dual_weight_gradients_follow_their_input_gradients_fifo(gen, ranks, mbs):
    # Steps 3, 7 and 8 run deferred weight gradients in the order of their I.
    for acts in gen(ranks, mbs).actions:
        i_order = [(a.stage, a.mb) for a in acts if a.kind == "I"]
        w_order = [(a.stage, a.mb) for a in acts if a.kind == "W"]
        assert w_order == i_order


def test_costs_parse_every_spelling_the_docstring_names():
    costs = Costs.parse("f=1, B=2.5, w=0.5, F&B=3, i=1.75, lat=0.25")
    assert (costs.F, costs.B, costs.W, costs.fb, costs.I, costs.latency) == (
        1.0,
        2.5,
        0.5,
        3.0,
        1.75,
        0.25,
    )
    assert Costs.parse("FB=4,latency=0.5").fb == 4.0
    assert Costs(F=1, B=2, W=1, latency=0).latency == 0  # zero latency is allowed
    assert Costs(F=1, B=2, W=1, FB=0, I=0).fb == 0  # so are zero pair and input-gradient costs


@pytest.mark.parametrize(
    "generator,name",
    [(gpipe, "gpipe"), (one_f_one_b, "1f1b"), (dualpipe, "dualpipe"), (dualpipev, "dualpipev"),
     (zb1p, "zb1p")],
)  # fmt: skip
def test_a_bad_rank_count_names_num_ranks(generator, name):
    with pytest.raises(InputError, match=r"^num_ranks=0 must be a positive integer"):
        generator(0, 4)
    assert generator(2, 4).name == name


def test_a_pair_whose_backward_needs_its_own_forward_deadlocks():
    """validate() rejects such a pair; simulate() on it names the pair instead of timing it."""
    from moeinfra.pipeline.actions import Action
    from moeinfra.pipeline.simulate import DeadlockError

    schedule = Schedule("hand", 1, (0,), ((0,),), (0,), ((Action("FB", 0, 0, 0, 0),),))
    with pytest.raises(DeadlockError, match=r"rank 0 at action 0 \(F0\.0&B0\.0\)"):
        simulate(schedule)


def test_a_simulation_reports_its_schedule_costs_and_ranks_by_name():
    """The JSON ``moeinfra pipeline simulate --json`` prints: 1F1B, 2 ranks, 2 micro-batches, F=1,
    B=2, worked by hand: rank 0 runs F0 [0, 1], F1 [1, 2], waits for rank 1's B0 [2, 4], B0 [4, 6],
    waits for B1 [5, 7], B1 [7, 9]; rank 1 F0 [1, 2], B0 [2, 4], F1 [4, 5], B1 [5, 7]. Makespan 9,
    each rank busy 6 and idle 3; rank 0 holds two activations at once, rank 1 one."""
    result = simulate(one_f_one_b(2, 2), Costs(F=1, B=2, W=1))
    doc = result.to_dict()
    assert {k: doc[k] for k in ("schedule", "ranks", "stages", "microbatches", "comm")} == {
        "schedule": "1f1b",
        "ranks": 2,
        "stages": 2,
        "microbatches": 2,
        "comm": "dataflow",
    }
    assert doc["costs"] == {"F": 1.0, "B": 2.0, "W": 1.0, "FB": 3.0, "latency": 0.0}
    assert doc["makespan"] == 9.0 and doc["max_idle"] == 3.0
    ranks = doc["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert set(ranks[0]) == {
        "rank", "busy", "idle", "peak_activations", "peak_deferred_w", "params", "actions",
        "starts", "ends",
    }  # fmt: skip
    assert [(r["busy"], r["idle"], r["peak_activations"]) for r in ranks] == [(6, 3, 2), (6, 3, 1)]
    assert [r.finish for r in result.per_rank] == [9.0, 7.0]
    # a schedule with no ranks takes no time
    assert simulate(Schedule("none", 0, (), (), (), ())).makespan == 0.0
    assert doc["peak_activations"] == 2
    assert ranks[0]["actions"] == ["F0.0", "F0.1", "B0.0", "B0.1"]
    assert (ranks[0]["starts"], ranks[0]["ends"]) == ([0, 1, 4, 7], [1, 2, 6, 9])
    assert (ranks[1]["starts"], ranks[1]["ends"]) == ([1, 2, 4, 5], [2, 4, 5, 7])
