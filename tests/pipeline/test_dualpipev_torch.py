"""Our DualPipeV order equals torch.distributed.pipelining's ScheduleDualPipeV (derived from DeepSeek's
open-sourced dualpipev.py), action for action, micro-batch indices included."""

import pytest

from moeinfra.pipeline import dualpipev

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
if not hasattr(schedules, "ScheduleDualPipeV"):
    pytest.skip("this torch has no ScheduleDualPipeV", allow_module_level=True)

KINDS = {
    schedules.FORWARD: "F",
    schedules.BACKWARD_INPUT: "I",
    schedules.BACKWARD_WEIGHT: "W",
    schedules.FULL_BACKWARD: "B",
}


def _as_text(action) -> str:
    if action.computation_type == schedules.OVERLAP_F_B:
        forward, backward = action.sub_actions
        return f"{_as_text(forward)}&{_as_text(backward)}"
    return f"{KINDS[action.computation_type]}{action.stage_index}.{action.microbatch_index}"


def _torch_order(ranks: int, microbatches: int, rank: int) -> list[str]:
    # The order is computed from these two numbers alone; no process group or stage is needed.
    schedule = object.__new__(schedules.ScheduleDualPipeV)
    schedule.pp_group_size = ranks
    schedule._n_microbatches = microbatches
    actions = schedules.ScheduleDualPipeV._calculate_single_rank_operations(schedule, rank)
    return [_as_text(a) for a in actions if a is not None]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 6])
def test_dualpipev_equals_torch(ranks):
    for microbatches in range(2 * ranks, 2 * ranks + 7):
        ours = dualpipev(ranks, microbatches)
        for rank in range(ranks):
            assert [str(a) for a in ours.actions[rank]] == _torch_order(ranks, microbatches, rank)
