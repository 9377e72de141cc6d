"""Action records: the unit of work a pipeline rank executes, with a compact string form.

Kinds:
- ``F``: forward of one stage for one micro-batch (``F3.1`` = stage 3, micro-batch 1);
- ``B``: full backward (input and weight gradients, ``B3.1``);
- ``I``: input-gradient-only backward; its weight gradient is deferred to a later ``W`` (``I3.1``);
- ``W``: the deferred weight gradient of an earlier ``I`` (``W3.1``);
- ``FB``: a forward and a full backward run overlapped as one unit (``F0.7&B7.3``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moeinfra.errors import InputError

KINDS = ("F", "B", "I", "W", "FB")

_SINGLE = re.compile(r"^([FBIW])(\d+)\.(\d+)$")
_PAIR = re.compile(r"^F(\d+)\.(\d+)&B(\d+)\.(\d+)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work on a rank.

    ``stage``/``mb`` are the forward part for ``FB`` and the only part otherwise; ``b_stage``/``b_mb``
    are the backward part of an ``FB`` pair (``-1`` for other kinds).
    """

    kind: str
    stage: int
    mb: int
    b_stage: int = -1
    b_mb: int = -1

    def __str__(self) -> str:
        if self.kind == "FB":
            return f"F{self.stage}.{self.mb}&B{self.b_stage}.{self.b_mb}"
        return f"{self.kind}{self.stage}.{self.mb}"

    def parts(self) -> tuple[Action, ...]:
        """The single actions this one is made of: ``(F, B)`` for a pair, ``(self,)`` otherwise."""
        if self.kind == "FB":
            return (Action("F", self.stage, self.mb), Action("B", self.b_stage, self.b_mb))
        return (self,)


def F(stage: int, mb: int) -> Action:  # noqa: N802 - mirrors the notation of the papers
    return Action("F", stage, mb)


def B(stage: int, mb: int) -> Action:  # noqa: N802
    return Action("B", stage, mb)


def I(stage: int, mb: int) -> Action:  # noqa: N802, E743
    return Action("I", stage, mb)


def W(stage: int, mb: int) -> Action:  # noqa: N802
    return Action("W", stage, mb)


def FB(f: Action, b: Action) -> Action:  # noqa: N802
    """Pair a forward ``f`` with a full backward ``b`` to run overlapped."""
    return Action("FB", f.stage, f.mb, b.stage, b.mb)


def parse_action(text: str) -> Action:
    """Parse ``F3.1`` / ``B3.1`` / ``I3.1`` / ``W3.1`` / ``F0.7&B7.3`` into an :class:`Action`."""
    text = text.strip()
    if m := _SINGLE.match(text):
        return Action(m.group(1), int(m.group(2)), int(m.group(3)))
    if m := _PAIR.match(text):
        return Action("FB", int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)))
    raise InputError(
        f"action={text!r} is not an action; allowed: F<stage>.<mb>, B.., I.., W.. or F<s>.<m>&B<s>.<m>"
    )
