"""One request's state inside a rank's engine: its tokens, how many have KV in the cache, its status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from moeinfra.engine.sampling import SamplingParams, StopChecker


@dataclass
class Preloaded:
    """KV of positions ``start .. start + kv.shape[1] - 1`` computed elsewhere (a prefill unit, the
    on-disk prefix cache): ``kv [layers, tokens, values]`` in the cache layout. Written into the
    sequence's slots from ``write_from`` (what the in-memory prefix cache lacks) when it is admitted."""

    start: int
    kv: torch.Tensor
    write_from: int = 0

    @property
    def end(self) -> int:
        return self.start + self.kv.shape[1]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """A request on one rank.

    ``num_computed``: leading tokens of ``token_ids`` whose KV is in the cache; the next step feeds
    ``token_ids[num_computed:]`` (or a chunk of it). ``num_cached``: prompt tokens that came from the
    prefix cache when the request was (last) admitted. ``text``: output text exposed so far (stop
    strings withheld / cut). ``preloaded``: KV to write instead of computing (consumed at
    admission). ``handoff``: where a prefill-only request's KV goes after its first token (opaque to
    the engine; None: decode here). ``drafts``: tokens the MTP layer proposed after the last one,
    verified by the next step; ``num_draft_tokens`` / ``num_accepted_tokens``: its drafts so far.
    """

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    num_cached: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    stop_checker: StopChecker | None = None
    preemptions: int = 0
    preloaded: Preloaded | None = None
    handoff: object = None
    drafts: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
