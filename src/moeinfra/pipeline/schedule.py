"""The pipeline schedule: stage layout plus an ordered list of actions per rank.

A :class:`Schedule` is plain data. Generators (:mod:`moeinfra.pipeline.generators`) produce it;
:func:`~moeinfra.pipeline.validate.validate` checks it, :func:`~moeinfra.pipeline.simulate.simulate`
times it, :mod:`moeinfra.pipeline.timeline` draws it and :mod:`moeinfra.pipeline.runtime` executes it.
Communication is not written in the schedule: it follows from the layout (a forward sends to the next
stage of the micro-batch's path, a backward to the previous one; stages on the same rank hand over
locally).

Layout vocabulary:
- *stage*: an integer id; ``stage_ranks[stage]`` is the rank that runs it;
- *path*: the ordered stages a micro-batch goes through (``paths[p]``); the position of a stage in its
  path is its *model stage* (which slice of the model it computes);
- ``mb_paths[mb]``: the path micro-batch ``mb`` takes. DualPipe has two paths (one per direction),
  every other schedule one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from moeinfra.atomicio import write_text_atomic
from moeinfra.errors import InputError
from moeinfra.pipeline.actions import Action, parse_action


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists over a stage layout.

    Attributes:
        name: generator name (``"dualpipe"``, ``"1f1b"``, ...) or anything for hand-made schedules.
        num_ranks: number of devices.
        stage_ranks: ``[num_stages]`` rank of each stage id.
        paths: one tuple of stage ids per path, in forward order.
        mb_paths: ``[num_microbatches]`` path index of each micro-batch.
        actions: ``[num_ranks]`` tuples of :class:`Action`, in execution order.
    """

    name: str
    num_ranks: int
    stage_ranks: tuple[int, ...]
    paths: tuple[tuple[int, ...], ...]
    mb_paths: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    _pos: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pos: dict[int, tuple[int, int]] = {}
        for p, path in enumerate(self.paths):
            for i, s in enumerate(path):
                if s in pos:
                    raise InputError(
                        f"paths: stage {s} appears twice; each stage belongs to one path"
                    )
                if not 0 <= s < len(self.stage_ranks):
                    raise InputError(
                        f"paths: stage {s} has no rank in stage_ranks (0..{len(self.stage_ranks) - 1})"
                    )
                pos[s] = (p, i)
        if len(self.actions) != self.num_ranks:
            raise InputError(
                f"actions: {len(self.actions)} rank lists for num_ranks={self.num_ranks}"
            )
        if any(not 0 <= r < self.num_ranks for r in self.stage_ranks):
            raise InputError(
                f"stage_ranks={list(self.stage_ranks)} must be ranks in 0..{self.num_ranks - 1}"
            )
        if any(not 0 <= p < len(self.paths) for p in self.mb_paths):
            raise InputError(f"mb_paths must be path indices in 0..{len(self.paths) - 1}")
        object.__setattr__(self, "_pos", pos)

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    @property
    def num_microbatches(self) -> int:
        return len(self.mb_paths)

    def stages_on(self, rank: int) -> tuple[int, ...]:
        """Stage ids run by ``rank``, ascending."""
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == rank)

    def path_of(self, stage: int) -> int:
        return self._pos[stage][0]

    def model_stage(self, stage: int) -> int:
        """Position of ``stage`` in its path: which slice of the model it computes."""
        return self._pos[stage][1]

    def prev_stage(self, stage: int) -> int | None:
        """Stage before ``stage`` on its path (where its forward input comes from), or None."""
        p, i = self._pos[stage]
        return self.paths[p][i - 1] if i > 0 else None

    def next_stage(self, stage: int) -> int | None:
        """Stage after ``stage`` on its path (where its forward output goes), or None."""
        p, i = self._pos[stage]
        return self.paths[p][i + 1] if i + 1 < len(self.paths[p]) else None

    def is_first(self, stage: int) -> bool:
        return self._pos[stage][1] == 0

    def is_last(self, stage: int) -> bool:
        p, i = self._pos[stage]
        return i == len(self.paths[p]) - 1

    def microbatches_of_path(self, path: int) -> list[int]:
        """Micro-batch ids that take ``path``, ascending."""
        return [m for m, p in enumerate(self.mb_paths) if p == path]

    def action_strings(self) -> list[list[str]]:
        """``[num_ranks][actions]`` compact strings (``"F0.7&B7.3"``)."""
        return [[str(a) for a in rank_actions] for rank_actions in self.actions]

    def to_dict(self) -> dict:
        """JSON-ready form; :meth:`from_dict` reads it back."""
        return {
            "name": self.name,
            "num_ranks": self.num_ranks,
            "stage_ranks": list(self.stage_ranks),
            "paths": [list(p) for p in self.paths],
            "mb_paths": list(self.mb_paths),
            "actions": self.action_strings(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        try:
            return cls(
                name=str(data["name"]),
                num_ranks=int(data["num_ranks"]),
                stage_ranks=tuple(int(r) for r in data["stage_ranks"]),
                paths=tuple(tuple(int(s) for s in p) for p in data["paths"]),
                mb_paths=tuple(int(p) for p in data["mb_paths"]),
                actions=tuple(tuple(parse_action(a) for a in rank) for rank in data["actions"]),
            )
        except (KeyError, TypeError) as exc:
            raise InputError(f"schedule data is missing or has a malformed field: {exc}") from exc

    def save(self, path: Path | str) -> None:
        """Write the schedule as JSON (atomically)."""
        write_text_atomic(Path(path), json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: Path | str) -> Schedule:
        """Read a schedule written by :meth:`save`."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise InputError(f"path={str(path)!r} is not a schedule JSON file: {exc}") from exc
        return cls.from_dict(data)
