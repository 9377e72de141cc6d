"""Schedule generators: GPipe, 1F1B, ZB1P (zero-bubble H1), DualPipe and DualPipeV.

Each returns a :class:`~moeinfra.pipeline.schedule.Schedule` and nothing else; the constraints of the
original schedules are enforced with :class:`~moeinfra.errors.InputError`.

Stage numbering:
- GPipe / 1F1B / ZB1P on ``P`` ranks: stages ``0..P-1``, stage ``s`` on rank ``s``.
- DualPipeV on ``P`` ranks: a ``2P``-stage model folded in a V; stage ``s`` runs on rank ``s`` for
  ``s < P`` and on rank ``2P-1-s`` otherwise (the last rank hands stage ``P-1`` to ``P`` locally).
- DualPipe on ``PP`` ranks: two copies of a ``PP``-stage model run in opposite directions. Stages
  ``0..PP-1`` are the direction entering at rank 0 (stage ``s`` on rank ``s``); stages ``PP..2PP-1``
  are the mirrored direction entering at rank ``PP-1`` (stage ``PP+k`` computes model stage ``k`` on
  rank ``PP-1-k``). Micro-batches ``0..M/2-1`` take the first direction, ``M/2..M-1`` the second.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from moeinfra.errors import InputError
from moeinfra.pipeline.actions import Action
from moeinfra.pipeline.schedule import Schedule


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{name}={value!r} must be a positive integer")


def _linear(
    name: str, num_ranks: int, num_microbatches: int, actions: list[list[Action]]
) -> Schedule:
    return Schedule(
        name=name,
        num_ranks=num_ranks,
        stage_ranks=tuple(range(num_ranks)),
        paths=(tuple(range(num_ranks)),),
        mb_paths=(0,) * num_microbatches,
        actions=tuple(tuple(a) for a in actions),
    )


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward, on each of ``num_ranks`` stages."""
    _check_positive("num_ranks", num_ranks)
    _check_positive("num_microbatches", num_microbatches)
    actions = [
        [Action("F", r, m) for m in range(num_microbatches)]
        + [Action("B", r, m) for m in range(num_microbatches)]
        for r in range(num_ranks)
    ]
    return _linear("gpipe", num_ranks, num_microbatches, actions)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B: rank ``r`` runs ``P-1-r`` warm-up forwards, then alternates forward and backward."""
    _check_positive("num_ranks", num_ranks)
    _check_positive("num_microbatches", num_microbatches)
    actions = []
    for r in range(num_ranks):
        warmup = min(num_ranks - 1 - r, num_microbatches)
        acts = [Action("F", r, m) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            acts += [Action("F", r, warmup + i), Action("B", r, i)]
        acts += [Action("B", r, m) for m in range(num_microbatches - warmup, num_microbatches)]
        actions.append(acts)
    return _linear("1f1b", num_ranks, num_microbatches, actions)


def zb1p(num_ranks: int, num_microbatches: int) -> Schedule:
    """Zero-bubble H1 (Qi et al. 2023): 1F1B with each backward split into I (input gradient) and W.

    Rank ``r`` keeps the 1F1B order of forwards and input-gradient backwards (so as many micro-batches
    are in flight as in 1F1B) and runs one weight gradient after each ``I``, except that its first
    ``r`` weight gradients are held back to the end, where they fill the time the earlier ranks spend
    on the last input gradients. Weight gradients run first-in first-out.
    """
    _check_positive("num_ranks", num_ranks)
    _check_positive("num_microbatches", num_microbatches)
    P, M = num_ranks, num_microbatches
    actions = []
    for r in range(P):
        warmup = min(P - 1 - r, M)
        held = min(r, M)
        pending: deque[int] = deque()
        acts = [Action("F", r, m) for m in range(warmup)]
        for i in range(M):
            if warmup + i < M:
                acts.append(Action("F", r, warmup + i))
            acts.append(Action("I", r, i))
            pending.append(i)
            if len(pending) > held:
                acts.append(Action("W", r, pending.popleft()))
        acts += [Action("W", r, m) for m in pending]
        actions.append(acts)
    return _linear("zb1p", P, M, actions)


def _dual_rank(
    P: int, r: int, M: int, meet: bool, stage: tuple[int, int], mbs: tuple[list[int], list[int]]
) -> list[Action]:
    """DeepSeek's 8-step DualPipe order for one rank (``r`` = distance from the nearer end).

    ``stage[phase]`` is the stage id of the rank's phase-0 / phase-1 chunk and ``mbs[phase]`` the
    micro-batch ids that chunk sees, in order. ``meet``: the rank where the two directions meet.
    """
    nf, nb = [0, 0], [0, 0]
    pending: deque[tuple[int, int]] = deque()
    out: list[Action] = []

    def fwd(ph: int) -> Action:
        a = Action("F", stage[ph], mbs[ph][nf[ph]])
        nf[ph] += 1
        return a

    def bwd(ph: int, zero_bubble: bool = False) -> Action:
        m = mbs[ph][nb[ph]]
        nb[ph] += 1
        if zero_bubble:
            pending.append((stage[ph], m))
            return Action("I", stage[ph], m)
        return Action("B", stage[ph], m)

    def weight() -> Action:
        s, m = pending.popleft()
        return Action("W", s, m)

    def pair(f: Action, b: Action) -> Action:
        return Action("FB", f.stage, f.mb, b.stage, b.mb)

    for _ in range(2 * (P - r - 1)):  # step 1: nF0
        out.append(fwd(0))
    for _ in range(r + 1):  # step 2: nF0F1
        out += [fwd(0), fwd(1)]
    for _ in range(P - r - 1):  # step 3: nB1W1F1, zero bubble
        out.append(bwd(1, True))
        out.append(weight())
        out.append(fwd(1))
    for i in range(M - 2 * P + r + 1):  # step 4 (main): n(F0&B1)(F1&B0)
        if i == 0 and meet:
            # Unpaired where the two directions meet: shorter than waiting to overlap them.
            out += [fwd(0), bwd(1)]
        else:
            out.append(pair(fwd(0), bwd(1)))
        out.append(pair(fwd(1), bwd(0)))
    for _ in range(P - r - 1):  # step 5: nB1(F1&B0)
        out.append(bwd(1))
        out.append(pair(fwd(1), bwd(0)))
    zero_bubble = False
    for i in range(r + 1):  # step 6: nB1B0, the second half with deferred weight gradients
        if i == (r + 1) // 2 and r % 2 == 1:
            zero_bubble = True
        out.append(bwd(1, zero_bubble))
        if i == (r + 1) // 2 and r % 2 == 0:
            zero_bubble = True
        out.append(bwd(0, zero_bubble))
    for _ in range(P - r - 1):  # step 7: nWB0, zero bubble
        out.append(weight())
        out.append(bwd(0, True))
    for _ in range(r + 1):  # step 8: nW
        out.append(weight())
    assert not pending and nf == [M, M] and nb == [M, M]
    return out


def dualpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipe on ``num_ranks`` = PP devices with ``num_microbatches`` in total (half per direction).

    Requires PP even and ``num_microbatches`` even and >= 2 * PP, as DeepSeek's implementation.
    """
    _check_positive("num_ranks", num_ranks)
    _check_positive("num_microbatches", num_microbatches)
    PP, M = num_ranks, num_microbatches
    if PP % 2:
        raise InputError(
            f"num_ranks={PP} must be even for DualPipe (two halves meet in the middle)"
        )
    if M % 2 or M < 2 * PP:
        raise InputError(
            f"num_microbatches={M} must be even and >= 2*num_ranks={2 * PP} for DualPipe "
            "(half of them enter at each end)"
        )
    P, Mh = PP // 2, M // 2
    dir_mbs = (list(range(Mh)), list(range(Mh, M)))
    actions = []
    for rank in range(PP):
        r = min(rank, PP - 1 - rank)
        dir_stage = (rank, PP + (PP - 1 - rank))
        second = rank >= P
        stage = (dir_stage[second], dir_stage[not second])
        mbs = (dir_mbs[second], dir_mbs[not second])
        actions.append(tuple(_dual_rank(P, r, Mh, r == P - 1, stage, mbs)))
    stage_ranks = tuple(range(PP)) + tuple(PP - 1 - k for k in range(PP))
    return Schedule(
        name="dualpipe",
        num_ranks=PP,
        stage_ranks=stage_ranks,
        paths=(tuple(range(PP)), tuple(range(PP, 2 * PP))),
        mb_paths=(0,) * Mh + (1,) * Mh,
        actions=tuple(actions),
    )


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV ("cut in half") on ``num_ranks`` = P devices: a 2P-stage model folded in a V.

    Requires ``num_microbatches`` >= 2 * P (odd counts are allowed).
    """
    _check_positive("num_ranks", num_ranks)
    _check_positive("num_microbatches", num_microbatches)
    P, M = num_ranks, num_microbatches
    if M < 2 * P:
        raise InputError(f"num_microbatches={M} must be >= 2*num_ranks={2 * P} for DualPipeV")
    mbs = list(range(M))
    actions = tuple(
        tuple(_dual_rank(P, r, M, r == P - 1, (r, 2 * P - 1 - r), (mbs, mbs))) for r in range(P)
    )
    return Schedule(
        name="dualpipev",
        num_ranks=P,
        stage_ranks=tuple(range(P)) + tuple(range(P - 1, -1, -1)),
        paths=(tuple(range(2 * P)),),
        mb_paths=(0,) * M,
        actions=actions,
    )


GENERATORS: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb1p": zb1p,
    "dualpipe": dualpipe,
    "dualpipev": dualpipev,
}


def generate(name: str, num_ranks: int, num_microbatches: int) -> Schedule:
    """Build the schedule called ``name`` (one of :data:`GENERATORS`)."""
    if name not in GENERATORS:
        raise InputError(f"schedule={name!r} is unknown; allowed: {', '.join(GENERATORS)}")
    return GENERATORS[name](num_ranks, num_microbatches)
