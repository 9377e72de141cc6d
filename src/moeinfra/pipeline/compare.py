"""Simulate every schedule on the same devices, model and costs, and pick the fastest: :func:`compare`."""

from __future__ import annotations

from dataclasses import dataclass

from moeinfra.errors import InputError
from moeinfra.pipeline.generators import GENERATORS
from moeinfra.pipeline.simulate import Costs, SimResult, simulate


@dataclass(frozen=True)
class Candidate:
    """One schedule's result in a comparison (``result`` is None when its constraints rule it out)."""

    schedule: str
    stages: int
    stage_scale: float
    result: SimResult | None
    reason: str = ""

    def to_dict(self) -> dict:
        if self.result is None:
            return {"schedule": self.schedule, "feasible": False, "reason": self.reason}
        r = self.result
        return {
            "schedule": self.schedule,
            "feasible": True,
            "stages": self.stages,
            "stage_scale": self.stage_scale,
            "makespan": r.makespan,
            "max_idle": max(x.idle for x in r.per_rank),
            "bubble_fraction": max(x.idle for x in r.per_rank) / r.makespan if r.makespan else 0.0,
            "peak_activations": max(x.peak_activations for x in r.per_rank),
            "params": max(x.params for x in r.per_rank),
            # In units of one stage of the num_ranks-stage split, comparable across schedules.
            "activation_memory": max(x.peak_activations for x in r.per_rank) * self.stage_scale,
            "param_memory": max(x.params for x in r.per_rank) * self.stage_scale,
        }


def compare(
    num_ranks: int, num_microbatches: int, costs: Costs, comm: str = "dataflow"
) -> tuple[list[Candidate], str]:
    """Simulate GPipe, 1F1B, ZB1P, DualPipe and DualPipeV on ``num_ranks`` devices for one model.

    ``costs`` are per stage of a ``num_ranks``-stage split of the model. DualPipeV folds the model into
    ``2*num_ranks`` stages of half the size, so its compute costs are halved (``stage_scale=0.5``);
    activation and parameter counts stay in units of *its* stages. Returns the candidates and the name
    of the fastest feasible one (ties go to the earlier, simpler schedule).
    """
    candidates: list[Candidate] = []
    for name, gen in GENERATORS.items():
        scale = 0.5 if name == "dualpipev" else 1.0
        try:
            schedule = gen(num_ranks, num_microbatches)
        except InputError as exc:
            candidates.append(Candidate(name, 0, scale, None, str(exc)))
            continue
        result = simulate(schedule, costs.scaled(scale) if scale != 1.0 else costs, comm=comm)
        candidates.append(Candidate(name, schedule.num_stages, scale, result))
    feasible = [c for c in candidates if c.result is not None]
    if not feasible:
        raise InputError(
            f"num_ranks={num_ranks}, num_microbatches={num_microbatches}: no schedule is feasible"
        )
    best = min(feasible, key=lambda c: c.result.makespan)  # min keeps the first of equals
    return candidates, best.schedule
