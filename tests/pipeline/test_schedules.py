"""Generators, validation, save/load and the string form of actions."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeinfra.errors import InputError
from moeinfra.pipeline import (
    Action,
    Schedule,
    ScheduleError,
    dualpipe,
    dualpipev,
    generate,
    gpipe,
    one_f_one_b,
    parse_action,
    validate,
)


def test_action_string_round_trip():
    for text in ("F3.1", "B3.1", "I3.1", "W3.1", "F0.7&B7.3"):
        assert str(parse_action(text)) == text
    assert parse_action("F0.7&B7.3") == Action("FB", 0, 7, 7, 3)
    with pytest.raises(InputError, match="action='X1.2'"):
        parse_action("X1.2")


def test_dualpipev_rank0_matches_deepseek_order():
    # DeepSeek's 8 steps for rank 0 of 4 (stages 0 and 7), 10 micro-batches.
    acts = [str(a) for a in dualpipev(4, 10).actions[0]]
    expected = (
        [f"F0.{m}" for m in range(6)]  # step 1: 2(P-r-1) F0
        + ["F0.6", "F7.0"]  # step 2: r+1 (F0, F1)
        + ["I7.0", "W7.0", "F7.1", "I7.1", "W7.1", "F7.2", "I7.2", "W7.2", "F7.3"]  # step 3
        + ["F0.7&B7.3", "F7.4&B0.0", "F0.8&B7.4", "F7.5&B0.1", "F0.9&B7.5", "F7.6&B0.2"]  # step 4
        + ["B7.6", "F7.7&B0.3", "B7.7", "F7.8&B0.4", "B7.8", "F7.9&B0.5"]  # step 5
        + ["B7.9", "I0.6"]  # step 6, r=0: the switch to deferred W happens before B0
        + ["W0.6", "I0.7", "W0.7", "I0.8", "W0.8", "I0.9"]  # step 7
        + ["W0.9"]  # step 8
    )
    assert acts == expected


def test_meeting_rank_runs_the_first_pair_unpaired():
    last = [str(a) for a in dualpipev(4, 10).actions[3]]
    # rank 3 (stages 3, 4): step 2 = 4 x (F0, F1), then step 4 starts with F0 and B1 unpaired.
    assert last[:8] == ["F3.0", "F4.0", "F3.1", "F4.1", "F3.2", "F4.2", "F3.3", "F4.3"]
    assert last[8:11] == ["F3.4", "B4.0", "F4.4&B3.0"]
    mids = [dualpipe(8, 20).actions[r] for r in (3, 4)]
    for acts in mids:
        assert [a.kind for a in acts[8:11]] == ["F", "B", "FB"]


def test_step6_switch_parity():
    # r odd: the switch happens before B1 of the middle repetition; r even: between B1 and B0.
    for r, kinds in ((1, ["B", "B", "I", "I"]), (2, ["B", "B", "B", "I", "I", "I"])):
        acts = dualpipev(4, 10).actions[r]
        step6 = [a for a in acts if a.kind in ("B", "I")][-(2 * (r + 1) + (4 - r - 1)) :][
            : 2 * (r + 1)
        ]
        assert [a.kind for a in step6] == kinds


def test_dualpipe_layout():
    s = dualpipe(4, 8)
    assert s.stage_ranks == (0, 1, 2, 3, 3, 2, 1, 0)
    assert s.paths == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert s.mb_paths == (0,) * 4 + (1,) * 4
    assert s.stages_on(0) == (0, 7) and s.model_stage(7) == 3
    v = dualpipev(3, 6)
    assert v.stage_ranks == (0, 1, 2, 2, 1, 0) and v.next_stage(2) == 3


@pytest.mark.parametrize(
    ("gen", "ranks", "mbs", "match"),
    [
        (dualpipe, 3, 12, "num_ranks=3 must be even"),
        (dualpipe, 4, 6, "num_microbatches=6 must be even and >= 2\\*num_ranks=8"),
        (dualpipe, 4, 9, "num_microbatches=9"),
        (dualpipev, 4, 7, "num_microbatches=7 must be >= 2\\*num_ranks=8"),
        (one_f_one_b, 0, 4, "num_ranks=0"),
        (gpipe, 2, -1, "num_microbatches=-1"),
    ],
)
def test_constraints_rejected(gen, ranks, mbs, match):
    with pytest.raises(InputError, match=match):
        gen(ranks, mbs)


def test_unknown_schedule():
    with pytest.raises(InputError, match="schedule='pipedream'"):
        generate("pipedream", 4, 8)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev"]),
    ranks=st.integers(1, 8),
    extra=st.integers(0, 9),
)
def test_generated_schedules_validate(name, ranks, extra):
    if name == "dualpipe":
        ranks = max(2, ranks - ranks % 2)
        mbs = 2 * ranks + 2 * extra
    elif name == "dualpipev":
        mbs = 2 * ranks + extra
    else:
        mbs = 1 + extra
    s = generate(name, ranks, mbs)
    validate(s)
    assert Schedule.from_dict(s.to_dict()) == s


def test_save_load(tmp_path):
    s = dualpipe(4, 8)
    s.save(tmp_path / "s.json")
    assert Schedule.load(tmp_path / "s.json") == s
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InputError, match="not a schedule JSON"):
        Schedule.load(tmp_path / "bad.json")


def _with(schedule: Schedule, rank: int, actions: list[str]) -> Schedule:
    data = schedule.to_dict()
    data["actions"][rank] = actions
    return Schedule.from_dict(data)


def test_validate_names_first_offending_action():
    s = one_f_one_b(2, 2)
    with pytest.raises(ScheduleError, match=r"rank 0 action 0 \(F1.0\): stage 1 runs on rank 1"):
        validate(_with(s, 0, ["F1.0"]))
    with pytest.raises(ScheduleError, match="stage 0 micro-batch 1 has no backward"):
        validate(_with(s, 0, ["F0.0", "F0.1", "B0.0"]))
    with pytest.raises(
        ScheduleError,
        match=r"rank 0 action 0 \(B0.0\): backward of stage 0 micro-batch 0 before its forward",
    ):
        validate(_with(s, 0, ["B0.0", "F0.0", "F0.1", "B0.1"]))
    with pytest.raises(ScheduleError, match="input gradient without a later W0.1"):
        validate(_with(s, 0, ["F0.0", "F0.1", "B0.0", "I0.1"]))
    with pytest.raises(ScheduleError, match="already scheduled"):
        validate(_with(s, 0, ["F0.0", "F0.0", "F0.1", "B0.0", "B0.1"]))
    # Out-of-order but legal: rank 0 sends micro-batch 1 first.
    validate(
        _with(_with(s, 0, ["F0.1", "F0.0", "B0.0", "B0.1"]), 1, ["F1.1", "F1.0", "B1.0", "B1.1"])
    )
    # Rank 0 sends F0.1 only after B0.0, which needs B1.0, which rank 1 runs after F1.1: deadlock.
    with pytest.raises(
        ScheduleError, match=r"deadlocks.*rank 0 at action 1 \(B0.0\); rank 1 at action 1 \(F1.1\)"
    ):
        validate(
            _with(
                _with(s, 0, ["F0.0", "B0.0", "F0.1", "B0.1"]), 1, ["F1.0", "F1.1", "B1.1", "B1.0"]
            )
        )
