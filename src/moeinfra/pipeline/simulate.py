"""Time a :class:`~moeinfra.pipeline.schedule.Schedule` under per-action costs and a communication model.

Each rank runs its actions in order. An action starts when the rank is free and its inputs are there:
a forward needs the previous stage's forward of the same micro-batch, a backward its own forward and
the next stage's backward (input gradient); a ``W`` needs its ``I``. Stages on the same rank hand over
instantly; across ranks a transfer takes ``costs.latency``.

Communication models:
- ``"dataflow"``: sends never block; data arrives ``latency`` after the producing action ends.
- ``"rendezvous"``: a send completes only when the peer has posted the matching receive (gloo's and
  NCCL's p2p): the transfer starts at the later of the send and the receive being posted and takes
  ``latency``. A rank posts the receives of an action when it finishes the compute action before it
  (``W`` actions need no communication and are skipped). The sender does not wait for completion
  (non-blocking ``isend``), so a latency can no longer be hidden by sending early. A model in which the
  sender also blocks until its sends complete deadlocks DualPipe on 8 ranks with sends issued right
  after each compute; DeepSeek's runtime avoids that by delaying particular sends by hand.

Activations are counted in units of one stage's activations for one micro-batch: a forward adds one
(for an ``F&B`` pair it is added before the backward frees its own, so the pair peaks one higher), a
``B`` or ``I`` frees one. Weight gradients still waiting (``I`` done, ``W`` not yet) are reported
separately as ``peak_deferred_w``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeinfra.errors import InputError
from moeinfra.pipeline.actions import Action
from moeinfra.pipeline.schedule import Schedule

COMM_MODELS = ("dataflow", "rendezvous")


@dataclass(frozen=True)
class Costs:
    """Time of one action on one stage for one micro-batch (any unit, used consistently).

    ``B`` is the full backward; ``I`` the input-gradient-only backward (default ``B - W``; measured
    runtimes are often a little more, the split costs a second autograd call); ``FB`` is a forward and
    a backward run overlapped (default ``F + B``); ``latency`` is the time of one p2p transfer.
    """

    F: float = 1.0
    B: float = 2.0
    W: float = 1.0
    FB: float | None = None
    latency: float = 0.0
    I: float | None = None  # noqa: E741 - the paper's name

    def __post_init__(self) -> None:
        for name in ("F", "B", "W", "latency"):
            value = getattr(self, name)
            if not value >= 0:
                raise InputError(f"costs.{name}={value!r} must be >= 0")
        if self.W > self.B:
            raise InputError(
                f"costs.W={self.W} must be <= costs.B={self.B} (W is part of the full backward)"
            )
        for name in ("FB", "I"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise InputError(f"costs.{name}={value!r} must be >= 0")

    @property
    def fb(self) -> float:
        return self.F + self.B if self.FB is None else self.FB

    def of(self, action: Action) -> float:
        """Duration of ``action``."""
        i = self.B - self.W if self.I is None else self.I
        return {"F": self.F, "B": self.B, "I": i, "W": self.W, "FB": self.fb}[action.kind]

    def scaled(self, factor: float) -> Costs:
        """Compute costs multiplied by ``factor`` (latency unchanged), e.g. for half-size stages."""
        return Costs(
            self.F * factor,
            self.B * factor,
            self.W * factor,
            None if self.FB is None else self.FB * factor,
            self.latency,
            None if self.I is None else self.I * factor,
        )

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Read ``"F=1,B=2,W=1,FB=3[,I=1.1][,latency=0.1]"`` (keys case-insensitive; missing keys keep defaults)."""
        keys = {
            "f": "F",
            "b": "B",
            "w": "W",
            "fb": "FB",
            "f&b": "FB",
            "i": "I",
            "latency": "latency",
            "lat": "latency",
        }
        values: dict[str, float] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = item.partition("=")
            key = keys.get(name.strip().lower())
            if not sep or key is None:
                raise InputError(
                    f"costs={text!r}: item {item!r} must be KEY=VALUE with KEY in F, B, W, FB, I, latency"
                )
            try:
                values[key] = float(value)
            except ValueError:
                raise InputError(f"costs={text!r}: {name}={value!r} is not a number") from None
        return cls(**values)


@dataclass(frozen=True)
class RankResult:
    """What one rank did: ``starts[i]``/``ends[i]`` of ``actions[i]`` (same unit as the costs)."""

    rank: int
    actions: tuple[Action, ...]
    starts: tuple[float, ...]
    ends: tuple[float, ...]
    finish: float
    busy: float
    idle: float
    peak_activations: int
    peak_deferred_w: int
    params: int

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "busy": self.busy,
            "idle": self.idle,
            "peak_activations": self.peak_activations,
            "peak_deferred_w": self.peak_deferred_w,
            "params": self.params,
            "actions": [str(a) for a in self.actions],
            "starts": list(self.starts),
            "ends": list(self.ends),
        }


@dataclass(frozen=True)
class SimResult:
    """Result of :func:`simulate`: makespan and one :class:`RankResult` per rank."""

    schedule: Schedule
    costs: Costs
    comm: str
    makespan: float
    per_rank: tuple[RankResult, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return {
            "schedule": self.schedule.name,
            "ranks": self.schedule.num_ranks,
            "stages": self.schedule.num_stages,
            "microbatches": self.schedule.num_microbatches,
            "comm": self.comm,
            "costs": {
                "F": self.costs.F,
                "B": self.costs.B,
                "W": self.costs.W,
                "FB": self.costs.fb,
                "latency": self.costs.latency,
            },
            "makespan": self.makespan,
            "max_idle": max(r.idle for r in self.per_rank),
            "peak_activations": max(r.peak_activations for r in self.per_rank),
            "per_rank": [r.to_dict() for r in self.per_rank],
        }


class DeadlockError(InputError):
    """The schedule cannot finish: some rank waits forever."""


def _key(cls: str, stage: int, mb: int) -> tuple[str, int, int]:
    return (cls, stage, mb)


def index_actions(schedule: Schedule) -> dict[tuple[str, int, int], tuple[int, int]]:
    """Map ``(class, stage, mb)`` to ``(rank, position)``; class ``F`` (F or F of a pair), ``B`` (B, I or
    B of a pair) or ``W``. Raises :class:`InputError` on a duplicate."""
    where: dict[tuple[str, int, int], tuple[int, int]] = {}
    for r, acts in enumerate(schedule.actions):
        for k, action in enumerate(acts):
            for part in action.parts():
                cls = "B" if part.kind in ("B", "I") else part.kind
                key = _key(cls, part.stage, part.mb)
                if key in where:
                    q, j = where[key]
                    raise InputError(
                        f"rank {r} action {k} ({action}): {part} already scheduled on rank {q} at position {j}"
                    )
                where[key] = (r, k)
    return where


def dependencies(schedule: Schedule, action: Action) -> list[tuple[str, int, int]]:
    """Keys of the actions whose results ``action`` needs."""
    deps = []
    for part in action.parts():
        s, m = part.stage, part.mb
        if part.kind == "F":
            prev = schedule.prev_stage(s)
            if prev is not None:
                deps.append(_key("F", prev, m))
        elif part.kind in ("B", "I"):
            deps.append(_key("F", s, m))
            nxt = schedule.next_stage(s)
            if nxt is not None:
                deps.append(_key("B", nxt, m))
        else:  # W
            deps.append(_key("B", s, m))
    return deps


def simulate(schedule: Schedule, costs: Costs | None = None, comm: str = "dataflow") -> SimResult:
    """Time ``schedule``; see the module docstring for the rules.

    Returns a :class:`SimResult`; raises :class:`DeadlockError` naming the stuck actions when a rank
    would wait forever and :class:`InputError` when an action's input is never produced.
    """
    costs = costs or Costs()
    if comm not in COMM_MODELS:
        raise InputError(f"comm={comm!r} is unknown; allowed: {', '.join(COMM_MODELS)}")
    where = index_actions(schedule)
    rendezvous = comm == "rendezvous"
    R = schedule.num_ranks
    acts = schedule.actions
    deps: list[list[list[tuple[int, int, bool]]]] = []
    for r in range(R):
        rank_deps = []
        for k, action in enumerate(acts[r]):
            d = []
            for key in dependencies(schedule, action):
                if key not in where:
                    raise InputError(
                        f"rank {r} action {k} ({action}) needs {key[0]}{key[1]}.{key[2]}, which no rank runs"
                    )
                q, j = where[key]
                d.append((q, j, q != r))
            rank_deps.append(d)
        deps.append(rank_deps)

    end: list[list[float | None]] = [[None] * len(a) for a in acts]
    start: list[list[float]] = [[0.0] * len(a) for a in acts]
    ptr = [0] * R

    # A rank posts the receives of an action when it finishes the compute action before it (weight
    # gradients need no communication, so receives are posted across them).
    post_after = []
    for r in range(R):
        last, pa = -1, []
        for k, action in enumerate(acts[r]):
            pa.append(last)
            if action.kind != "W":
                last = k
        post_after.append(pa)

    def posted(q: int, j: int) -> float | None:
        """When rank ``q`` posts the receives of its action ``j``."""
        k = post_after[q][j]
        return 0.0 if k < 0 else end[q][k]

    progress = True
    while progress:
        progress = False
        for r in range(R):
            while ptr[r] < len(acts[r]):
                k = ptr[r]
                t = end[r][k - 1] if k > 0 else 0.0
                post = posted(r, k) if rendezvous else 0.0
                blocked = False
                for q, j, remote in deps[r][k]:
                    e = end[q][j]
                    if e is None:
                        blocked = True
                        break
                    t = max(t, max(e, post) + costs.latency if remote else e)
                if blocked:
                    break
                start[r][k] = t
                end[r][k] = t + costs.of(acts[r][k])
                ptr[r] += 1
                progress = True

    stuck = [r for r in range(R) if ptr[r] < len(acts[r])]
    if stuck:
        detail = "; ".join(f"rank {r} at action {ptr[r]} ({acts[r][ptr[r]]})" for r in stuck)
        raise DeadlockError(
            f"schedule {schedule.name!r} deadlocks under the {comm} model: {detail}"
        )

    finish = []
    for r in range(R):
        n = len(acts[r])
        if n == 0:
            finish.append(0.0)
        else:
            finish.append(end[r][n - 1])
    makespan = max(finish) if finish else 0.0
    per_rank = []
    for r in range(R):
        busy = sum(costs.of(a) for a in acts[r])
        peak, deferred = _peaks(acts[r])
        per_rank.append(
            RankResult(
                rank=r,
                actions=acts[r],
                starts=tuple(start[r]),
                ends=tuple(e for e in end[r]),
                finish=finish[r],
                busy=busy,
                idle=makespan - busy,
                peak_activations=peak,
                peak_deferred_w=deferred,
                params=len(schedule.stages_on(r)),
            )
        )
    return SimResult(schedule, costs, comm, makespan, tuple(per_rank))


def _peaks(actions: tuple[Action, ...]) -> tuple[int, int]:
    """Peak live activations and peak number of deferred weight gradients on one rank."""
    live = peak = waiting = peak_w = 0
    for a in actions:
        if a.kind in ("F", "FB"):
            live += 1
            peak = max(peak, live)
        if a.kind in ("B", "I", "FB"):
            live -= 1
        if a.kind == "I":
            waiting += 1
            peak_w = max(peak_w, waiting)
        elif a.kind == "W":
            waiting -= 1
    return peak, peak_w
