"""Check that a schedule is complete and can run: :func:`validate`."""

from __future__ import annotations

from moeinfra.errors import InputError
from moeinfra.pipeline.schedule import Schedule
from moeinfra.pipeline.simulate import Costs, DeadlockError, index_actions, simulate


class ScheduleError(InputError):
    """A schedule is incomplete, inconsistent or cannot finish; the message names the first offending action."""


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is runnable.

    Checks, in order: every action runs a stage held by its rank, on a micro-batch whose path contains
    that stage; no work appears twice; every micro-batch gets a forward and a backward (``B``, or ``I``
    then ``W``) on every stage of its path; on each rank a stage's backward comes after its forward and
    a ``W`` after its ``I``; and executing the actions in order, each waiting for its inputs (blocking
    receives), finishes without deadlock.
    """
    nm = schedule.num_microbatches
    for r, acts in enumerate(schedule.actions):
        for k, action in enumerate(acts):
            for part in action.parts():
                where = f"rank {r} action {k} ({action})"
                if not 0 <= part.stage < schedule.num_stages:
                    raise ScheduleError(
                        f"{where}: stage {part.stage} does not exist (0..{schedule.num_stages - 1})"
                    )
                if schedule.stage_ranks[part.stage] != r:
                    raise ScheduleError(
                        f"{where}: stage {part.stage} runs on rank {schedule.stage_ranks[part.stage]}, not {r}"
                    )
                if not 0 <= part.mb < nm:
                    raise ScheduleError(
                        f"{where}: micro-batch {part.mb} does not exist (0..{nm - 1})"
                    )
                if schedule.mb_paths[part.mb] != schedule.path_of(part.stage):
                    raise ScheduleError(
                        f"{where}: micro-batch {part.mb} does not pass through stage {part.stage}"
                    )
    try:
        where = index_actions(schedule)
    except InputError as exc:
        raise ScheduleError(str(exc)) from None
    kinds = {}
    for r, acts in enumerate(schedule.actions):
        for k, action in enumerate(acts):
            for part in action.parts():
                kinds[(part.kind, part.stage, part.mb)] = (
                    r,
                    k,
                    action,
                )
    for mb in range(nm):
        for stage in schedule.paths[schedule.mb_paths[mb]]:
            name = f"stage {stage} micro-batch {mb}"
            if ("F", stage, mb) not in where:
                raise ScheduleError(f"{name} has no forward (F{stage}.{mb})")
            if ("B", stage, mb) not in where:
                raise ScheduleError(f"{name} has no backward (B{stage}.{mb} or I{stage}.{mb})")
            has_i = ("I", stage, mb) in kinds
            has_w = ("W", stage, mb) in where
            if has_i and not has_w:
                r, k, action = kinds[("I", stage, mb)]
                raise ScheduleError(
                    f"rank {r} action {k} ({action}): input gradient without a later W{stage}.{mb}"
                )
            if has_w and not has_i:
                r, k = where[("W", stage, mb)]
                raise ScheduleError(
                    f"rank {r} action {k} (W{stage}.{mb}): weight gradient without an I{stage}.{mb}"
                )
            rf, kf = where[("F", stage, mb)]
            rb, kb = where[("B", stage, mb)]
            backward = schedule.actions[rb][kb]
            if kb < kf or (
                kb == kf
                and backward.kind == "FB"
                and (backward.b_stage, backward.b_mb) == (stage, mb)
            ):
                raise ScheduleError(
                    f"rank {rb} action {kb} ({backward}): backward of {name} before its forward"
                )
            if has_w and where[("W", stage, mb)][1] < kb:
                r, k = where[("W", stage, mb)]
                raise ScheduleError(
                    f"rank {r} action {k} (W{stage}.{mb}): weight gradient before I{stage}.{mb}"
                )
    try:
        simulate(schedule, Costs(1.0, 2.0, 1.0), comm="dataflow")
    except DeadlockError as exc:
        raise ScheduleError(str(exc)) from None
