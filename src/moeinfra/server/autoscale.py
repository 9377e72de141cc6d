"""``serve up --autoscale``: add and remove prefill and decode units with the load.

Every ``interval_s`` the autoscaler reads the work each role's units did in the interval (prefill:
busy seconds of their engine steps; decode: slot occupancy, running requests x seconds over the
unit's slots) and applies the simulator's target-utilisation rule
(:func:`moeinfra.serving.schedule.units_for_work`: the whole units that work would keep ``target``
busy), kept between the role's minimum and maximum. More units are started as new processes; fewer
are drained first (no new requests, stopped once their running requests finish), the least loaded
first, and not while a unit of the role is still starting. Colocated units are not scaled.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass

from moeinfra.errors import InputError
from moeinfra.serving.schedule import DEFAULT_TARGET, units_for_work

SCALED_ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class AutoscalePolicy:
    """``units``: ``(min, max)`` units per role; ``interval_s`` between decisions; ``target`` busy
    share."""

    prefill_units: tuple[int, int] = (1, 4)
    decode_units: tuple[int, int] = (1, 4)
    interval_s: float = 10.0
    target: float = DEFAULT_TARGET

    def __post_init__(self) -> None:
        for role in SCALED_ROLES:
            low, high = getattr(self, f"{role}_units")
            if not 1 <= low <= high:
                raise InputError(
                    f"--min-{role}-units={low} and --max-{role}-units={high} must satisfy "
                    "1 <= min <= max"
                )
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise InputError(f"--autoscale-interval={self.interval_s} must be > 0 seconds")
        if not 0 < self.target <= 1:
            raise InputError(f"--autoscale-target={self.target} must be in (0, 1]")

    def bounds(self, role: str) -> tuple[int, int]:
        return getattr(self, f"{role}_units")


class Autoscaler:
    """Scales ``router``'s units by ``policy``; ``spawn(role)`` starts one unit of ``role``."""

    def __init__(self, router, spawn: Callable[[str], object], policy: AutoscalePolicy) -> None:
        self.router, self.spawn, self.policy = router, spawn, policy
        self._seen: dict[str, float] = {}  # unit id -> work done at the last decision
        self.decisions: list[dict] = []

    def _work_since_last(self, role: str) -> float:
        work = 0.0
        for unit in self.router.units.values():
            if unit.role != role:
                continue
            done = unit.work_done_s()
            work += done - self._seen.get(unit.unit_id, 0.0)
            self._seen[unit.unit_id] = done
        return work

    def decide(self, span_s: float) -> list[dict]:
        """One decision per role over the last ``span_s`` seconds; returns what it did."""
        if not self.router.accepting:
            return []
        out = []
        for role in SCALED_ROLES:
            low, high = self.policy.bounds(role)
            work = self._work_since_last(role)
            want = min(int(units_for_work(work, span_s, self.policy.target, low)), high)
            active = [
                u
                for u in self.router.units.values()
                if u.role == role and u.alive and not u.draining
            ]
            if want > len(active):
                for _ in range(want - len(active)):
                    self.spawn(role)
            elif want < len(active) and all(u.ready for u in active):
                # (no removal while a unit of the role is still starting)
                ready = sorted(
                    (u for u in active if u.ready),
                    key=lambda u: sum(len(r.requests) for r in u.ranks),
                )
                for unit in ready[: len(active) - want]:
                    self.router.drain(unit.unit_id)
            else:
                continue
            out.append({"role": role, "work_s": work, "units": len(active), "to": want})
            self.router.notes.append(
                f"autoscale: {role} {len(active)} -> {want} units "
                f"({work:.2f} unit-s of work in {span_s:.1f} s, target {self.policy.target})"
            )
        self.decisions += out
        return out

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.interval_s)
            self.decide(self.policy.interval_s)
